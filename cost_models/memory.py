"""Memory cost per device of model states: parameters, gradients, optimizer state.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and Fig. 1): Adam under
mixed precision keeps 2 + 2 + 12 bytes per parameter (fp16/bf16 weights and gradients; fp32
master weights, momentum and variance), fp32 Adam 4 + 4 + 8. ZeRO stage 1 shards the optimizer
state over the data-parallel group, stage 2 also the gradients, stage 3 also the parameters::

    >>> s = model_state_bytes(7.5e9, precision="mixed", zero_stage=1, dp_degree=64)
    >>> round(s.total / 1e9, 1)
    31.4

Activations are not costed here: capture records what autograd saves for each node
(:mod:`autopar.passes.capture.saved`) and :mod:`autopar.planner.peak` walks the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.errors import AutoparError
from autopar.core.precision import named


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per device of parameters, gradients and optimizer state (and their total)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_parameter(*, precision: str = "mixed", optimizer: str = "adam") -> tuple[int, int, int]:
    """``(param, grad, optimizer)`` bytes per parameter: mixed Adam (2, 2, 12), fp32 Adam (4, 4, 8),
    bf16 Adam (2, 2, 4); ``precision`` names one of :data:`~autopar.core.precision.PRECISIONS`."""
    return named(precision).state_bytes(optimizer)


def model_state_bytes(num_params: float, *, precision: str = "mixed", optimizer: str = "adam",
                      zero_stage: int = 0, dp_degree: int = 1) -> ModelStateBytes:
    """Model-state bytes on one device holding ``num_params`` parameters (already divided by any
    tensor/pipeline parallelism), with ZeRO ``zero_stage`` (0-3) over ``dp_degree`` devices."""
    if zero_stage not in (0, 1, 2, 3):
        raise AutoparError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(dp_degree, int) or dp_degree < 1:
        raise AutoparError(f"dp_degree must be a positive int, got {dp_degree!r}")
    if num_params < 0:
        raise AutoparError(f"num_params must be >= 0, got {num_params}")
    p, g, o = bytes_per_parameter(precision=precision, optimizer=optimizer)
    n = dp_degree
    return ModelStateBytes(
        params=num_params * p / (n if zero_stage >= 3 else 1),
        grads=num_params * g / (n if zero_stage >= 2 else 1),
        optimizer=num_params * o / (n if zero_stage >= 1 else 1),
    )


def parameter_count(captured) -> int:
    """Parameters in a captured graph, each tied parameter once -- what
    ``sum(p.numel() for p in model.parameters())`` gives.

    ``captured``: a :class:`~autopar.passes.capture.CapturedGraph` (its parameter placeholders,
    one per tied weight) or a ``torch.export.ExportedProgram`` (tied names share one tensor in its
    ``state_dict``, counted once).
    """
    if hasattr(captured, "inputs") and hasattr(captured, "graph_module"):
        kinds = {i.node: i.kind for i in captured.inputs}
        return sum(node.meta["val"].numel() for node in captured.graph_module.graph.nodes
                   if node.op == "placeholder" and kinds.get(node.name) == "parameter")
    seen, total = set(), 0
    for name in captured.graph_signature.parameters:
        tensor = captured.state_dict[name]
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel()
    return int(total)


__all__ = [
    "ModelStateBytes",
    "bytes_per_parameter",
    "model_state_bytes",
    "parameter_count",
]
