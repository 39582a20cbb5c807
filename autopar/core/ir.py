"""The IR every layer shares: tensor metadata, one op call as rules see it, a strategy, and the
conventions for reading an FX graph (tensor inputs in pytree order, the returned tensors).

A :class:`Strategy` is one sharding (a placement per mesh axis) per tensor input and output of an
op; tensors are numbered in pytree order of ``(args, kwargs)`` and of the result, the order
:func:`tensor_inputs` and :func:`output_leaves` walk a graph in.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.core.placement import Replicate, Sharding, format_sharding


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor, standing in for it where rules look at an op's arguments."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class TensorPart:
    """Memory of one op call measured against one of its tensors, as capture saw autograd use it
    (a tensor its backward saves, a gradient or scratch its backward makes): ``elements`` per
    element of its input (``where="input"``) or output number ``index``, in ``dtype``; ``share``:
    the part this op holds of it (``1/k`` when ``k`` ops keep the same storage); ``storage``: which
    storage a saved tensor is, numbered by capture (ops that keep one storage at one sharding keep
    one copy, at two shardings two; a stamped layer repeats its template's numbers, so a number
    names a storage within one layer), None for what is not saved."""

    where: str
    index: int
    elements: float
    dtype: torch.dtype
    share: float = 1.0
    storage: int | None = None


@dataclass(frozen=True)
class OpSpec:
    """One call of an op as a rule sees it: tensors replaced by :class:`TensorMeta`."""

    op: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[TensorMeta, ...] = ()

    @property
    def inputs(self) -> list[TensorMeta]:
        """The tensor inputs in pytree order (walked once: planning asks a spec many times)."""
        return list(self._inputs)

    @functools.cached_property
    def _inputs(self) -> tuple[TensorMeta, ...]:
        return tuple(x for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, TensorMeta))

    def arg(self, index: int, name: str, default=None):
        """Positional-or-keyword argument ``index``/``name``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class Strategy:
    """A full-mesh strategy: a sharding (placement per mesh axis) per tensor input and output.

    ``local`` names the rule's local implementation that each rank runs instead of the plain
    op (None: the plain op).
    """

    inputs: tuple[Sharding, ...]
    outputs: tuple[Sharding, ...]
    local: str | None = None

    @property
    def name(self) -> str:
        ins = " ".join(f"[{format_sharding(s)}]" for s in self.inputs)
        outs = " ".join(f"[{format_sharding(s)}]" for s in self.outputs)
        via = f" via {self.local}" if self.local else ""
        return f"{ins} -> {outs}{via}"

    def replicated_on(self, axis: int) -> bool:
        """Whether every rank of mesh ``axis`` computes the same thing (all inputs and outputs R)."""
        return all(isinstance(s[axis], Replicate) for s in self.inputs + self.outputs)


# Ops that compute nothing planning cares about (asserts); they never need a rule.
IGNORED_OPS: set = {torch.ops.aten._assert_tensor_metadata.default}


def drop_unread_asserts(graph: torch.fx.Graph) -> None:
    """Erase the ``IGNORED_OPS`` nodes nothing reads: export keeps a value alive by such an
    assert alone, which plans would otherwise price and programs never run."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in IGNORED_OPS and not node.users:
            graph.erase_node(node)

# What a program runs for a captured view: a reshape takes the same values and also a tensor
# whose layout differs from the one eager PyTorch handed at capture (a collective's output, or
# an attention kernel whose choice depends on which inputs need gradients).
VIEWS_AS_RESHAPES: dict = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                           torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


def histc_any_dtype(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``aten.histc`` that also counts an integer tensor, which CPU kernels (and fake ones on a CPU
    device) refuse: in float64, exact for every int32 (transformers' sorted experts count their
    int32 expert ids so on any device but the CPU, and on meta, where full-size models are
    captured), the counts cast back."""
    if x.is_floating_point():
        return torch.ops.aten.histc.default(x, bins, min, max)
    return torch.ops.aten.histc.default(x.double(), bins, min, max).to(x.dtype)


# What a program (and capture's run of the graph on CPU tensors) calls for some captured ops:
# the same values, on any layout (views) and device (integer histograms)
PROGRAM_TARGETS: dict = {**VIEWS_AS_RESHAPES, torch.ops.aten.histc.default: histc_any_dtype}


def to_meta(value):
    """Replace tensors (real, fake or meta) in a pytree by :class:`TensorMeta`."""

    def conv(x):
        if isinstance(x, torch.Tensor):
            return TensorMeta(tuple(int(s) for s in x.shape), x.dtype)
        return x

    return pytree.tree_map(conv, value)


def spec_of_call(op, args, kwargs, result) -> OpSpec:
    """An :class:`OpSpec` from a call's real (or fake) arguments and result."""
    outs = tuple(x for x in pytree.tree_leaves(to_meta(result)) if isinstance(x, TensorMeta))
    return OpSpec(op, to_meta(tuple(args)), to_meta(dict(kwargs)), outs)


def spec_of_node(node: torch.fx.Node) -> OpSpec:
    """An :class:`OpSpec` from an FX node whose args carry ``meta["val"]``."""

    def val(x):
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x

    args = pytree.tree_map(val, tuple(node.args))
    kwargs = pytree.tree_map(val, dict(node.kwargs))
    return spec_of_call(node.target, args, kwargs, node.meta.get("val"))


def is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued argument nodes in pytree order of ``(args, kwargs)``: the order
    the registry numbers a strategy's inputs in."""
    return [x for x in pytree.tree_leaves((node.args, node.kwargs)) if is_tensor_node(x)]


def remembered_inputs(node: torch.fx.Node, memo: dict | None) -> list[torch.fx.Node]:
    """:func:`tensor_inputs` of ``node``, kept in ``memo`` (where passes run again over an
    unchanged graph: a plan's analysis for each choice the search weighs)."""
    if memo is None:
        return tensor_inputs(node)
    hit = memo.get(node)
    if hit is None:
        hit = memo[node] = tensor_inputs(node)
    return hit


def output_leaves(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The tensor nodes the graph returns, in order (the order of ``output_shardings``)."""
    out = graph.output_node()
    return [x for x in pytree.tree_leaves(out.args) if is_tensor_node(x)]


def differentiable(dtype: torch.dtype) -> bool:
    """Whether autograd carries a gradient for a tensor of ``dtype``: floating or complex (a
    rotary table multiplied in as complex64 passes its gradient on)."""
    return dtype.is_floating_point or dtype.is_complex


def gradient_values(graph: torch.fx.Graph, trainable) -> frozenset[str]:
    """Names of the graph's values a gradient reaches. Forward, a value may need one: the
    differentiable placeholders named in ``trainable``, and every value with a differentiable
    tensor computed from one (an integer value, e.g. a top-k index or a one-hot mask, stops it)
    where autograd, run at capture, saw it need one (``meta["autopar_grad_out"]``: ``type_as``
    takes only a dtype from its second argument). Backward, it gets one: those from which the
    graph's outputs are reached through the inputs each call's backward hands a gradient
    (``meta["autopar_grad_in"]``; every input where capture could not tell): a value read only
    for its shape (``zeros_like``) gets none, and the call that made it runs no backward.
    Kept on the graph while its nodes' arguments and values stay the same objects (a search
    asks it of one graph for every cost graph and plan it builds)."""
    key = frozenset(trainable)
    now = [(n.args, n.kwargs, n.meta.get("val")) for n in graph.nodes]
    kept = graph.__dict__.setdefault("_autopar_gradient_values", {}).get(key)
    if kept is not None and len(kept[0]) == len(now) and all(
            a is x and b is y and c is z for (a, b, c), (x, y, z) in zip(kept[0], now)):
        return kept[1]
    out = _gradient_values(graph, key)
    graph.__dict__["_autopar_gradient_values"][key] = (now, out)
    return out


def _floating(val) -> bool:
    if isinstance(val, torch.Tensor):
        return differentiable(val.dtype)
    return any(isinstance(v, torch.Tensor) and differentiable(v.dtype) for v in pytree.tree_leaves(val))


def _gradient_values(graph: torch.fx.Graph, trainable: frozenset) -> frozenset[str]:
    needs: set[str] = set()
    for node in graph.nodes:
        if (node.name in trainable if node.op == "placeholder"
                else node.op == "call_function" and node.meta.get("autopar_grad_out", True)
                and any(a.name in needs for a in node.all_input_nodes)) and _floating(node.meta.get("val")):
            needs.add(node.name)
    out: set[str] = set()
    for node in reversed(graph.nodes):
        if node.op == "output":
            sources = node.all_input_nodes
        elif node.name not in out or node.op != "call_function":
            continue
        else:
            given = node.meta.get("autopar_grad_in")
            sources = node.all_input_nodes if given is None or node.target is operator.getitem \
                else [a for i, a in enumerate(tensor_inputs(node)) if i in given]
        out.update(a.name for a in sources if a.name in needs)
    return frozenset(out)


def gradient_inputs(node: torch.fx.Node, reached: set[str], inputs: list | None = None) -> tuple[bool, ...]:
    """Per tensor input of ``node`` (``inputs``: :func:`tensor_inputs` of it, where the caller
    has them): whether its backward hands that input a gradient, given the values a gradient
    reaches (:func:`gradient_values`): none where none reaches its output."""
    inputs = tensor_inputs(node) if inputs is None else inputs
    if node.name not in reached:
        return (False,) * len(inputs)
    given = node.meta.get("autopar_grad_in")
    return tuple(a.name in reached and (given is None or i in given) for i, a in enumerate(inputs))


@functools.cache
def aliases_input(target) -> bool:
    """Whether an ATen op returns one view of its first input (its schema's single return aliases
    it, unwritten): at run time the result's ``_base`` is the input's (``detach`` aliases in its
    schema only). Kept per op: planning asks it of every edge of every cost graph."""
    schema = getattr(target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or target is torch.ops.aten.detach.default:
        return False
    alias, first = schema.returns[0].alias_info, schema.arguments[0].alias_info if schema.arguments else None
    return (alias is not None and not alias.is_write and first is not None and not first.is_write
            and set(alias.before_set) == set(first.before_set) and str(schema.returns[0].type) == "Tensor")


def view_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node ``node`` is a chain of views of (itself where it is no view, :func:`aliases_input`)."""
    while node.op == "call_function" and aliases_input(node.target) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node meta copied shallowly)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


__all__ = [
    "PROGRAM_TARGETS",
    "aliases_input",
    "copy_graph_module",
    "differentiable",
    "drop_unread_asserts",
    "gradient_inputs",
    "gradient_values",
    "histc_any_dtype",
    "IGNORED_OPS",
    "VIEWS_AS_RESHAPES",
    "OpSpec",
    "TensorPart",
    "Strategy",
    "TensorMeta",
    "is_tensor_node",
    "output_leaves",
    "spec_of_call",
    "spec_of_node",
    "tensor_inputs",
    "view_root",
    "to_meta",
]
