"""The captured graph and its parts: placeholders (:class:`GraphInput`), outputs
(:class:`GraphOutput`) and :class:`CapturedGraph`, with the shape metadata every node carries."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.export.graph_signature import InputKind

from autopar.core.errors import CaptureError
from autopar.core.ir import IGNORED_OPS, TensorMeta

INPUT_KIND_OF = {  # torch.export input kind -> ours
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.USER_INPUT: "user_input",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.CUSTOM_OBJ: "constant",
    InputKind.TOKEN: "token",
}


INPUT_KINDS = frozenset(INPUT_KIND_OF.values())


OUTPUT_KINDS = frozenset(
    {"user_output", "loss", "buffer_mutation", "user_input_mutation", "parameter_mutation",
     "token"})


@dataclass(frozen=True)
class GraphInput:
    """One placeholder: its kind, its FQN (or the user input's name) and its placeholder node;
    ``frozen``: a parameter that gets no gradient (``requires_grad=False``, or no op of the graph
    reads it, as a decoder-only run's cross-attention), planned and run without gradient or
    optimizer state."""

    kind: str
    name: str
    node: str
    meta: TensorMeta | None
    frozen: bool = False

    def __post_init__(self):
        if self.kind not in INPUT_KINDS:
            raise CaptureError(f"input kind {self.kind!r} is not one of {sorted(INPUT_KINDS)}")


@dataclass(frozen=True)
class GraphOutput:
    """One graph output: what it is, its name (pytree key path or mutated FQN) and its node."""

    kind: str
    name: str
    node: str | None
    meta: TensorMeta | None

    def __post_init__(self):
        if self.kind not in OUTPUT_KINDS:
            raise CaptureError(f"output kind {self.kind!r} is not one of {sorted(OUTPUT_KINDS)}")


@dataclass(frozen=True, eq=False)
class CapturedGraph:
    """The result of :func:`capture`; see the module docstring for the node meta it adds.

    ``graph_module`` is the graph to plan. ``exported_program`` is what torch.export returned:
    with stamping (``stamped`` non-empty) its graph and signature hold only the traced layers,
    while its ``call_spec`` (the input and output pytrees), the kinds and order of its outputs
    and its ``constants`` (stamping never copies a constant) are the model's.
    """

    graph_module: torch.fx.GraphModule
    exported_program: torch.export.ExportedProgram
    inputs: tuple[GraphInput, ...]
    outputs: tuple[GraphOutput, ...]
    parameters: Mapping[str, TensorMeta]
    buffers: Mapping[str, TensorMeta]
    tied: Mapping[str, str]
    layers: tuple[str, ...]
    stamped: tuple[str, ...] = ()
    moe_dispatch: str = "dense"  # how transformers' routed experts were traced (passes/capture/moe.py)
    moe_capacity_factor: float | None = None  # the dense dispatch's capacity

    def __post_init__(self):
        placeholders = [n.name for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        if placeholders != [i.node for i in self.inputs]:
            raise CaptureError("CapturedGraph.inputs must list the graph's placeholders in order")
        missing = sorted(set(self.tied.values()) - set(self.parameters) - set(self.buffers))
        if missing:
            raise CaptureError(f"tied weights point at unknown canonical FQNs {missing}")
        if len(set(self.layers)) != len(self.layers):
            raise CaptureError("CapturedGraph.layers has duplicates")
        for name in ("parameters", "buffers", "tied"):
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))

    @property
    def num_parameters(self) -> int:
        """Elements in the model's parameters, each tied parameter counted once."""
        return sum(math.prod(m.shape) for m in self.parameters.values())

    def nodes_in_layer(self, layer: str | None) -> list[torch.fx.Node]:
        """The nodes whose ``autopar_layer`` is ``layer`` (``None``: the pre/post parts)."""
        return [n for n in self.graph_module.graph.nodes if n.meta.get("autopar_layer") == layer]


def distinct_ops(captured: CapturedGraph) -> set[str]:
    """Names of the distinct ATen ops the graph calls (e.g. ``aten.linear.default``)."""
    return {
        str(n.target)
        for n in captured.graph_module.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and n.target not in IGNORED_OPS
    }


def lazy_graph_module(root: nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule that writes its Python code only when it is first called or its ``.code``
    read: planning never does either, and for a 70B model's graph the code takes a second."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # a torch without it: recompile now
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def static_dim(size, node) -> int:
    if isinstance(size, int):
        return size
    value = size.node.maybe_as_int() if isinstance(size, torch.SymInt) else None
    if value is None:
        raise CaptureError(
            f"node {node.name} ({node.target}) has a data-dependent shape {size}",
            reason="its size depends on tensor values (nonzero, boolean-mask indexing, unique, "
                   "repeat_interleave with tensor repeats)",
            hint="autopar plans static shapes: use fixed-shape masks (torch.where, multiplying "
                 "by a mask) instead of selecting elements")
    return int(value)


def tensor_meta(val, node):
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(static_dim(s, node) for s in val.shape), val.dtype)
    if isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
        return tuple(tensor_meta(v, node) for v in val)
    return None


__all__ = ["INPUT_KINDS", "INPUT_KIND_OF", "OUTPUT_KINDS", "CapturedGraph", "GraphInput", "GraphOutput", "distinct_ops",
           "lazy_graph_module", "static_dim", "tensor_meta"]
