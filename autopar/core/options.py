"""Options: the knobs of one compilation, frozen and checked."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.errors import AutoparError
from autopar.core.precision import MIXED, MOMENTS

OPTIMIZERS = tuple(MOMENTS)  # ("adam", "sgd"): the optimizers whose states the costs know
BACKENDS = ("highs", "cpsat")
SCHEDULES = ("1f1b", "gpipe")
MOE_DISPATCHES = ("auto", "dense", "sorted")  # passes/capture/moe.py's DISPATCHES, and "auto"


class OptionsError(AutoparError, ValueError):
    """An Options field is out of range."""


@dataclass(frozen=True)
class Options:
    """How autopar plans.

    memory_fraction: share of each device's memory the plan may use (the rest is headroom).
    optimizer: "adam" (two fp32 states per parameter) or "sgd" (none).
    mixed_precision: compute in 16 bits with fp32 master weights (ZeRO's 2+2+12 bytes/param):
        True (bf16; fp16 for a model in fp16), "bf16" or "fp16" (with dynamic loss scaling at
        run time), or False.
    shard_parameters: let the solver store parameters sharded (ZeRO-3/FSDP), gathered on use.
    time_limit_s / backend / relative_gap: the intra-op ILP's limits.
    share_layers: identical repeated layers take one decision (solve one, reuse).
    pipeline: search pipeline stages and micro-batches (True), plan one program on the whole
        mesh (False), or ("auto") search both on several devices and keep the faster plan.
    micro_batches: micro-batches per step (None: searched; 1: no pipelining or accumulation).
    schedule: the pipeline schedule, "1f1b" (a stage keeps at most as many micro-batches in
        flight as there are stages from it to the end) or "gpipe" (every stage keeps all).
    recompute: activation checkpointing of every layer: True, False, "selective" (keep what
        matmuls, convolutions and attention make, recompute the cheap ops between them), or
        "auto" (chosen per stage of a pipelined plan, none, selective or full; in a one-program
        plan, selective or full where nothing fits without, or where it lets a faster sharding
        fit: autopar.planner.savers).
    search_meshes: without pipelining, also plan on every (devices / t, t) logical mesh of the
        same devices (t up to a node) and keep the fastest.
    moe_dispatch: how transformers' routed experts are traced: "dense" (a dispatch to stacked
        experts, so the search can shard the experts over a mesh axis: expert parallelism with
        all-to-all; exact, but the experts' matmuls run on E/k times the routed tokens unless a
        capacity factor is set), "sorted" (the model's own sorted grouped matmul: no padding,
        tensor parallelism inside the experts only) or "auto" (``compile`` plans both where
        the dense one may win by its FLOPs and keeps the faster; a baseline or a given plan: "dense").
    moe_capacity_factor: slots per expert of the dense dispatch: None (every token kept,
        the model's numbers) or f > 0, C = min(n, ceil(f * n * k / E)) slots per expert and
        group of n tokens (a batch row); an expert past C drops the later (token, choice)
        pairs, first choices before second ones, GShard-style (passes/capture/moe.py).
    offload: the optimizer's state, fp32 master weights and step on the host CPUs (ZeRO-Offload)
        in one-program plans: True, False, "parameters" (the parameters on the host too, fetched
        layer by layer: ZeRO-Infinity) or "auto" (the optimizer only where no plan fits on the
        devices, the parameters too only where none fits even then).
    stage_meshes: "any" (Alpa's stages, each on its own sub-mesh and (dp, tp), where that beats
        equal meshes) or "equal" (every pipeline stage on the same logical mesh (dp, tp)); the
        runtime executes both.
    """

    memory_fraction: float = 0.9
    optimizer: str = "adam"
    mixed_precision: bool | str = False
    shard_parameters: bool = True
    time_limit_s: float = 30.0
    backend: str = "highs"
    relative_gap: float = 1e-4
    share_layers: bool = True
    pipeline: bool | str = "auto"
    micro_batches: int | None = None
    schedule: str = "1f1b"
    recompute: bool | str = "auto"
    search_meshes: bool = True
    stage_meshes: str = "any"
    offload: bool | str = "auto"  # True, False, "parameters" or "auto"
    moe_dispatch: str = "auto"
    moe_capacity_factor: float | None = None

    def moe_capture(self, dispatch: str | None = None) -> dict:
        """The capture's arguments for routed experts (``dispatch`` instead of "auto": "dense")."""
        dispatch = dispatch or self.moe_dispatch
        return {"moe_dispatch": "dense" if dispatch == "auto" else dispatch,
                "moe_capacity_factor": self.moe_capacity_factor}

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
        if not (isinstance(self.mixed_precision, bool) or self.mixed_precision in ("bf16", "fp16")):
            raise OptionsError(f"mixed_precision must be one of {MIXED}, got {self.mixed_precision!r}")
        if self.pipeline not in (True, False, "auto"):
            raise OptionsError(f"pipeline must be True, False or 'auto', got {self.pipeline!r}")
        if self.micro_batches is not None and (isinstance(self.micro_batches, bool) or not isinstance(
                self.micro_batches, int) or self.micro_batches < 1):
            raise OptionsError(f"micro_batches must be a positive int or None, got {self.micro_batches!r}")
        if self.schedule not in SCHEDULES:
            raise OptionsError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise OptionsError(f"moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        factor = self.moe_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise OptionsError(f"moe_capacity_factor must be a positive number or None, got {factor!r}")
        if self.stage_meshes not in ("equal", "any"):
            raise OptionsError(f"stage_meshes must be 'equal' or 'any', got {self.stage_meshes!r}")
        if self.offload not in (True, False, "auto", "parameters"):
            raise OptionsError(f"offload must be True, False, 'parameters' or 'auto', got {self.offload!r}")
        if self.offload in (True, "parameters") and self.pipeline is True:
            raise OptionsError("pipelined plans do not offload their optimizer yet: use offload=True with"
                               " pipeline=False or 'auto' (one-program plans), or pipeline=True without offload")
        if self.recompute not in (True, False, "auto", "selective"):
            raise OptionsError(f"recompute must be True, False, 'selective' or 'auto', got {self.recompute!r}")
