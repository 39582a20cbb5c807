"""Memory cost per device: model states (parameters, gradients, optimizer) and activations.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and Fig. 1): Adam under
mixed precision keeps 2 + 2 + 12 bytes per parameter (fp16/bf16 weights and gradients; fp32
master weights, momentum and variance), fp32 Adam 4 + 4 + 8. ZeRO stage 1 shards the optimizer
state over the data-parallel group, stage 2 also the gradients, stage 3 also the parameters::

    >>> s = model_state_bytes(7.5e9, precision="mixed", zero_stage=1, dp_degree=64)
    >>> round(s.total / 1e9, 1)
    31.4

Activations are costed with liveness over a topologically ordered graph: a tensor lives from its
producer to its last forward use, or, when a backward needs it, until that backward has run;
gradients of activations live from their producer's backward to their consumer's. The result is
the peak of the running total, not the sum of every tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

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


# --- activations -----------------------------------------------------------------------------

# Ops whose backward needs none of their inputs (linear in them, or shape-only): they save nothing.
NO_SAVE_OPS = {
    "add", "sub", "neg", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand",
    "unsqueeze", "squeeze", "slice", "select", "alias", "detach", "split", "split_with_sizes",
    "unbind", "clone", "contiguous", "_to_copy", "cat", "stack", "sum", "mean", "pad",
    "constant_pad_nd", "flatten", "unflatten", "_assert_tensor_metadata", "lift_fresh_copy",
    "arange", "zeros", "ones", "full", "new_zeros", "new_ones", "new_full", "scalar_tensor",
    "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "logical_and", "logical_or",
    "logical_not", "cumsum", "diff",
}
# Aliasing ops: the output shares its input's storage (no new memory; it keeps the input alive).
ALIAS_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "slice", "select", "alias", "detach", "split", "split_with_sizes", "unbind", "flatten",
    "unflatten", "_assert_tensor_metadata", "lift_fresh_copy",
}


def _name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(node.target, "__name__", str(node.target))


def saves_inputs(node: torch.fx.Node) -> bool:
    """Whether ``node``'s backward needs its tensor inputs (the default for nonlinear ops)."""
    if node.op != "call_function":
        return False
    if _name(node) == "getitem":
        return False
    return _name(node) not in NO_SAVE_OPS


def is_alias(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (_name(node) in ALIAS_OPS or _name(node) == "getitem")


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)


@dataclass(frozen=True)
class ActivationPeak:
    """``peak``: most activation bytes live at once (forward or backward), reached at node
    ``peak_at`` in phase ``phase``; ``saved``: bytes held for backward at the end of forward."""

    peak: float
    saved: float
    peak_at: str
    phase: str


def peak_activation_memory(graph_module, *, node_bytes: Mapping | Callable,
                           saves: Callable[[torch.fx.Node], bool] = saves_inputs,
                           backward: bool = True) -> ActivationPeak:
    """Liveness of activations over a topologically ordered FX graph.

    ``node_bytes``: bytes one device holds for each node's output (a mapping from node or node
    name, or a callable); parameters and buffers should map to 0 (they are model state). Aliasing
    ops (views, getitem) allocate nothing and keep their base alive. A node takes part in the
    backward when its output is floating and depends on a floating placeholder (a parameter).
    With ``backward``, the backward pass runs in reverse order: node ``v``'s backward allocates
    gradients for its inputs that need them, frees the gradient of its output, and releases the
    tensors it was the last to need.
    """
    graph = graph_module.graph if hasattr(graph_module, "graph") else graph_module
    nodes = [n for n in graph.nodes if n.op != "output"]
    order = {n: i for i, n in enumerate(nodes)}
    outputs = [a for n in graph.nodes if n.op == "output" for a in n.all_input_nodes if a in order]

    def size(n) -> float:
        if callable(node_bytes):
            return float(node_bytes(n))
        return float(node_bytes.get(n, node_bytes.get(n.name, 0)))

    base, grad_needed = {}, {}
    for n in nodes:
        ins = [a for a in n.all_input_nodes if a in order]
        base[n] = base[ins[0]] if is_alias(n) and ins else n
        grad_needed[n] = _is_float(n) and (n.op == "placeholder" or any(grad_needed[a] for a in ins))
    own = {n: (size(n) if base[n] is n else 0.0) for n in nodes}

    last_fwd = {n: order[n] for n in nodes}   # per base: last forward use
    release = {}                              # per base: the backward step that frees it
    for n in nodes:
        keep = backward and grad_needed[n] and saves(n)
        for a in n.all_input_nodes:
            if a in order:
                last_fwd[base[a]] = max(last_fwd[base[a]], order[n])
                if keep:
                    release[base[a]] = min(release.get(base[a], order[n]), order[n])
    for a in outputs:
        last_fwd[base[a]] = len(nodes)

    frees: dict = {}
    for b, t in last_fwd.items():
        if b not in release:
            frees.setdefault(t, []).append(b)
    live = peak = 0.0
    peak_at, phase = "", "forward"
    for i, n in enumerate(nodes):
        live += own[n]
        if live > peak:
            peak, peak_at, phase = live, n.name, "forward"
        for b in frees.get(i, ()):
            live -= own[b]
    saved = sum(own[b] for b in release)
    if not backward:
        return ActivationPeak(peak, 0.0, peak_at, phase)

    releases: dict = {}
    for b, t in release.items():
        releases.setdefault(t, []).append(b)
    grads: dict = {}
    for n in reversed(nodes):
        if n.op == "call_function" and grad_needed[n]:
            for a in n.all_input_nodes:
                b = base.get(a)
                if b is not None and grad_needed[a] and b not in grads:
                    grads[b] = own[b]
                    live += own[b]
            if live > peak:
                peak, peak_at, phase = live, n.name, "backward"
            if base[n] is n:
                live -= grads.pop(n, 0.0)
        for b in releases.get(order[n], ()):
            live -= own[b]
    return ActivationPeak(peak, saved, peak_at, phase)


__all__ = [
    "ActivationPeak",
    "ModelStateBytes",
    "bytes_per_parameter",
    "is_alias",
    "model_state_bytes",
    "parameter_count",
    "peak_activation_memory",
    "saves_inputs",
]
