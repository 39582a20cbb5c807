"""The precision a plan computes in: one fact, read from the model's dtypes and the options.

Costs (compute speed, bytes of activations, gradients and collectives, model states), the MFU
the plan reports and the runtime all read it from :func:`precision_of`::

    model in   Options(mixed_precision=)  computes in  parameter  gradient  optimizer state (Adam)
    fp32       False                      fp32         4          4         8 (two fp32 moments)
    bf16/fp16  False                      bf16/fp16    2          2         4 (moments in bf16/fp16)
    any        True                       bf16 (fp16   2          2         12 (fp32 master + moments)
                                          for fp16)
    any        "bf16" / "fp16"            bf16 / fp16  2          2         12

Under mixed precision floating tensors of the program (parameters, activations, their gradients,
what collectives move) are in the compute dtype; the optimizer keeps fp32 master weights (ZeRO's
2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020, Sec. 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.core.errors import AutoparError

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
MIXED = (False, True, "bf16", "fp16")  # Options(mixed_precision=): off, the model's own, or a compute dtype
MOMENTS = {"adam": 2, "sgd": 0}  # the optimizers Options names: states per parameter (parameter's dtype or fp32)


def stepped_copy_share(optimizer: str) -> float:
    """The share of a parameter's optimizer bytes that is the copy the optimizer steps, where it
    steps one (an fp32 master, a ZeRO shard: the copy and its moments make those bytes)."""
    return 1.0 / (1 + MOMENTS[optimizer])


@dataclass(frozen=True)
class Precision:
    """``compute``: the dtype of the program's floating tensors and of its matmuls; ``master``:
    whether the optimizer keeps fp32 master weights (mixed precision)."""

    compute: torch.dtype
    master: bool = False

    def __post_init__(self):
        if self.compute not in _NAMES:
            raise AutoparError(f"a plan computes in float64/32, bfloat16 or float16, not {self.compute}")

    @property
    def name(self) -> str:
        """Its entry in :data:`PRECISIONS`: ``"mixed"`` (``"mixed-fp16"``) under master weights,
        else the compute dtype's short name (``"bf16"``)."""
        if self.master:
            return "mixed" if self.compute == torch.bfloat16 else "mixed-fp16"
        return _NAMES[self.compute]

    @property
    def mixed_precision(self) -> bool | str:
        """The ``Options(mixed_precision=)`` that captures for this precision: the compute dtype's
        name (``"bf16"``) under master weights, else False."""
        return self.master and _NAMES[self.compute]

    @property
    def peak_dtype(self) -> str:
        """The dtype whose peak FLOP/s bound the program's matmuls (``"bf16"``)."""
        return _NAMES[self.compute]

    def itemsize(self, dtype: torch.dtype) -> int:
        """Bytes per element the program holds a tensor of captured ``dtype`` in."""
        return self.compute.itemsize if dtype.is_floating_point else dtype.itemsize

    def dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the program holds a tensor of captured ``dtype`` in."""
        return self.compute if dtype.is_floating_point else dtype

    def state_bytes(self, optimizer: str) -> tuple[int, int, int]:
        """``(parameter, gradient, optimizer state)`` bytes per parameter under ``optimizer``."""
        if optimizer not in MOMENTS:
            raise AutoparError(f"optimizer must be one of {sorted(MOMENTS)}, got {optimizer!r}")
        p = self.compute.itemsize
        if self.master:
            return p, p, 4 + 4 * MOMENTS[optimizer]
        return p, p, p * MOMENTS[optimizer]


PRECISIONS = {p.name: p for p in (Precision(torch.float32), Precision(torch.bfloat16), Precision(torch.float16),
                                   Precision(torch.float64), Precision(torch.bfloat16, master=True),
                                   Precision(torch.float16, master=True))}


def named(name: str) -> Precision:
    """The :class:`Precision` called ``name`` (a plan stores the name)."""
    if name not in PRECISIONS:
        raise AutoparError(f"unknown precision {name!r}; use one of {sorted(PRECISIONS)}")
    return PRECISIONS[name]


def precision_of(dtypes, *, mixed_precision: bool | str) -> Precision:
    """The precision of a model whose parameters have ``dtypes`` (an iterable), planned with
    ``Options(mixed_precision=...)``, one of :data:`MIXED` (module docstring)."""
    if mixed_precision not in MIXED:
        raise AutoparError(f"mixed_precision must be one of {MIXED}, got {mixed_precision!r}")
    floating = [d for d in dtypes if d.is_floating_point]
    own = max(floating, key=lambda d: d.itemsize, default=torch.float32)  # a mixed model: its widest
    if mixed_precision in ("bf16", "fp16"):
        return Precision(torch.bfloat16 if mixed_precision == "bf16" else torch.float16, master=True)
    if mixed_precision:
        return Precision(torch.float16 if own == torch.float16 else torch.bfloat16, master=True)
    return Precision(own)


__all__ = ["MIXED", "MOMENTS", "PRECISIONS", "Precision", "named", "precision_of", "stepped_copy_share"]
