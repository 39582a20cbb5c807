"""Options: the knobs of one compilation, frozen and checked."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import AutoparError

OPTIMIZERS = ("adam", "sgd")
BACKENDS = ("highs", "cpsat")


class OptionsError(AutoparError, ValueError):
    """An Options field is out of range."""


@dataclass(frozen=True)
class Options:
    """How autopar plans.

    memory_fraction: share of each device's memory the plan may use (the rest is headroom).
    optimizer: "adam" (two fp32 states per parameter) or "sgd" (none).
    mixed_precision: bf16/fp16 compute with fp32 master weights (ZeRO's 2+2+12 bytes/param).
    shard_parameters: let the solver store parameters sharded (ZeRO-3/FSDP), gathered on use.
    time_limit_s / backend / relative_gap: the intra-op ILP's limits.
    share_layers: identical repeated layers take one decision (solve one, reuse).
    """

    memory_fraction: float = 0.9
    optimizer: str = "adam"
    mixed_precision: bool = False
    shard_parameters: bool = True
    time_limit_s: float = 30.0
    backend: str = "highs"
    relative_gap: float = 1e-4
    share_layers: bool = True

    def __post_init__(self):
        if not 0 < self.memory_fraction <= 1:
            raise OptionsError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.optimizer not in OPTIMIZERS:
            raise OptionsError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.backend not in BACKENDS:
            raise OptionsError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.time_limit_s <= 0:
            raise OptionsError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if not 0 <= self.relative_gap < 1:
            raise OptionsError(f"relative_gap must be in [0, 1), got {self.relative_gap}")
