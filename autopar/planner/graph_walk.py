"""Walking an FX graph forward, as the cost graph and the micro-batch analysis do: which planned
node produces each value (:class:`GraphWalk`), what each node depends on (a parameter, the
batch), and each op call as an :class:`~autopar.core.ir.OpSpec` with a hashable key that
identical calls share (:func:`op_call`).
"""

from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree

from autopar.core.ir import OpSpec, TensorMeta, spec_of_node


def value_meta(node) -> TensorMeta | tuple | None:
    """The TensorMeta of a node's tensor value, a tuple of them (None for non-tensors) for a
    multi-output node, None otherwise."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in val.shape), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(
            TensorMeta(tuple(int(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
            for v in val
        )
    return None


def leaf_dependency(kind: str, *, frozen: bool = False) -> frozenset:
    """What a graph input makes the nodes reading it depend on: a trained parameter or the batch."""
    return frozenset({"param"}) if kind == "parameter" and not frozen else frozenset({"input"}) \
        if kind == "user_input" else frozenset()


class GraphWalk:
    """The forward walk the cost graph and the micro-batch analysis share: which node (and output index)
    produces each fx value, getitem nodes resolved to their multi-output producer, and what
    each node depends on (``"param"``, ``"input"``: a parameter, the batch).

    :meth:`nodes` yields placeholders and op calls (getitem handled here); the caller passes
    those it plans to :meth:`accept`, which makes them producers for the nodes after them."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.producer: dict[str, tuple[str, int]] = {}  # fx value -> (accepted node, output index)
        self.depends: dict[str, frozenset] = {}

    def nodes(self):
        for node in self.graph.nodes:
            if node.op == "placeholder":
                yield node
            elif node.op == "call_function":
                if node.target is operator.getitem:
                    src, k = node.args
                    if src.name in self.producer:
                        self.producer[node.name] = (self.producer[src.name][0], k)
                        self.depends[node.name] = self.depends.get(src.name, frozenset())
                    continue
                yield node

    def dependencies(self, inputs) -> frozenset:
        """The union of what the fx nodes ``inputs`` depend on."""
        deps = frozenset()
        for a in inputs:
            deps |= self.depends.get(a.name, frozenset())
        return deps

    def accept(self, node, depends) -> None:
        """``node`` is planned: its outputs are produced by it, and it depends on ``depends``."""
        self.producer[node.name] = (node.name, 0)
        self.depends[node.name] = frozenset(depends)


_SIMPLE = (int, float, bool, str, type(None), TensorMeta)
_CONTAINERS = (tuple, list, dict, torch.fx.immutable_collections.immutable_list,
               torch.fx.immutable_collections.immutable_dict)


class _Unusual(Exception):
    """A call argument in a container :func:`op_call` does not walk (e.g. a namedtuple)."""


def _walk(x, nodes: list | None):
    """``(x with fx nodes and tensors as TensorMeta, hashable key)``; fx nodes go to ``nodes``."""
    if isinstance(x, torch.fx.Node):
        if nodes is None:
            raise _Unusual("a node inside a node's value")
        nodes.append(x)
        return _walk(x.meta.get("val"), None)
    if isinstance(x, torch.Tensor):
        meta = TensorMeta(tuple(int(d) for d in x.shape), x.dtype)
        return meta, meta
    kind = type(x)
    if kind in _CONTAINERS:
        if isinstance(x, dict):
            pairs = [(k, _walk(v, nodes)) for k, v in x.items()]
            return kind({k: v for k, (v, _) in pairs}), (kind.__name__, tuple((k, key) for k, (_, key) in pairs))
        parts = [_walk(v, nodes) for v in x]
        return kind(v for v, _ in parts), (kind.__name__, tuple(key for _, key in parts))
    if isinstance(x, (tuple, list, dict)):
        raise _Unusual(kind.__name__)
    return x, (x if isinstance(x, _SIMPLE) else str(x))


def op_call(node) -> tuple[OpSpec, tuple, list]:
    """``(spec_of_node(node), a hashable key of the call, its fx-node arguments in pytree order)``,
    walking the arguments once instead of the several pytree passes spec_of_node makes. Kept on
    the node's graph while the node's arguments and value stay the same objects: a search builds
    many cost graphs of one graph, and a kept spec keeps its walked inputs."""
    calls = node.graph.__dict__.setdefault("_autopar_op_calls", {})
    val = node.meta.get("val")
    hit = calls.get(node)
    if hit is not None and hit[0] is node.args and hit[1] is node.kwargs and hit[2] is val:
        return hit[3]
    result = _op_call(node)
    calls[node] = (node.args, node.kwargs, val, result)
    return result


def _op_call(node) -> tuple[OpSpec, tuple, list]:
    nodes: list = []
    try:
        args, args_key = _walk(tuple(node.args), nodes)
        kwargs, kwargs_key = _walk(dict(node.kwargs), nodes)
        outputs, _ = _walk(node.meta.get("val"), None)
    except _Unusual:
        spec = spec_of_node(node)
        nodes = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
        return spec, (spec.op, str(spec.args), str(spec.kwargs)), nodes
    outs = tuple(x for x in pytree.tree_leaves(outputs) if isinstance(x, TensorMeta))
    return OpSpec(node.target, args, kwargs, outs), (node.target, args_key, kwargs_key), nodes


__all__ = ["GraphWalk", "leaf_dependency", "op_call", "value_meta"]
