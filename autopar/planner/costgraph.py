"""The cost graph: every planned tensor-producing node with its strategies and their costs,
and every producer→consumer tensor edge with a resharding-cost matrix.

Nodes are parameters, buffers and user inputs (their strategies are storage shardings) and
ATen ops (their strategies come from the rule registry). Costs are seconds per training step
(forward + backward) and bytes per device, from :class:`autopar.planner.costs.CostModel`.

Gradient synchronisation lives on edges: when a consumer's strategy computes differently on
the ranks of mesh axis ``a`` (its option there is not all-replicated) and takes a ``Replicate``
input on ``a``, that input's gradient is a partial sum over ``a`` and must be all-reduced in
backward (Megatron's *f*; for a replicated weight under a sharded batch it is data parallelism's
gradient all-reduce). When the input is a parameter stored sharded on ``a`` (ZeRO-3/FSDP) the
all-gather on use is re-done in backward and the all-reduce becomes a reduce-scatter.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils import _pytree as pytree

from autopar.core.ir import OpSpec, Strategy, TensorMeta, spec_of_node
from autopar.core.placement import Replicate, Shard, fits
from autopar.passes.rules.registry import strategies

LEAF_KINDS = ("parameter", "buffer", "user_input")


@dataclass
class CostNode:
    """One planned node: strategies and per-strategy costs (seconds, bytes)."""

    name: str
    kind: str  # "op" or one of LEAF_KINDS
    strategies: list[Strategy]
    compute: np.ndarray
    communication: np.ndarray
    memory: np.ndarray
    memory_kind: str  # "parameters" or "activations": which breakdown its memory counts in
    layer: str | None = None
    op: str = ""
    target: str | None = None  # FQN of a parameter/buffer, name of a user input
    requires_grad: bool = False
    fixed: bool = False  # depends on no input or parameter: computed replicated, no choice
    batch_dependent: bool = False  # depends on a user input (the batch)
    spec: OpSpec | None = None  # the op call an "op" node stands for
    forward: np.ndarray | None = None  # forward part of ``compute`` (None: not kept)
    flops: float | None = None  # forward + backward FLOPs of the whole op (None: not kept)

    @property
    def size(self) -> int:
        return len(self.strategies)

    def cost(self) -> np.ndarray:
        return self.compute + self.communication


@dataclass
class CostEdge:
    """A tensor from output ``out_index`` of ``src`` to tensor input ``in_index`` of ``dst``."""

    src: int
    dst: int
    out_index: int
    in_index: int
    meta: TensorMeta
    cost: np.ndarray  # [src strategy, dst strategy] seconds


@dataclass
class CostGraph:
    nodes: list[CostNode]
    edges: list[CostEdge]
    index: dict[str, int]
    unary: dict[int, np.ndarray] = field(default_factory=dict)  # extra per-strategy costs (outputs)
    flops_per_step: float = 0.0


def storage_shardings(meta: TensorMeta, mesh_shape, *, allow_shard: bool) -> list[tuple]:
    """Candidate storage shardings of a leaf tensor: replicated, or any even Shard per axis."""
    per_axis = []
    for n in mesh_shape:
        opts = [Replicate()]
        if allow_shard and n > 1:
            opts += [Shard(d) for d in range(meta.ndim)]
        per_axis.append(opts)
    out = [s for s in itertools.product(*per_axis) if fits(meta.shape, s, mesh_shape)]
    return out


def _tensor_meta(node) -> TensorMeta | tuple | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in val.shape), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(
            TensorMeta(tuple(int(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
            for v in val
        )
    return None


def leaf_dependency(kind: str) -> frozenset:
    """What a graph input makes the nodes reading it depend on: a parameter or the batch."""
    return frozenset({"param"}) if kind == "parameter" else frozenset({"input"}) if kind == "user_input" \
        else frozenset()


class GraphWalk:
    """The forward walk the cost graph and stage costing share: which node (and output index)
    produces each fx value, getitem nodes resolved to their multi-output producer, and what
    each node depends on (``"param"``, ``"input"``: a parameter, the batch).

    :meth:`nodes` yields placeholders and op calls (getitem handled here); the caller passes
    those it plans to :meth:`accept`, which makes them producers for the nodes after them."""

    def __init__(self, graph: torch.fx.Graph, depends: dict | None = None):
        self.graph = graph
        self.producer: dict[str, tuple[str, int]] = {}  # fx value -> (accepted node, output index)
        self.depends: dict[str, frozenset] = {} if depends is None else depends

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


def build_cost_graph(captured, mesh_shape, cost_model, *, shard_parameters: bool = True) -> CostGraph:
    """Build the cost graph of a captured model on ``mesh_shape`` (see the module docstring)."""
    gm = captured.graph_module
    kinds = {inp.node: inp for inp in captured.inputs}
    nodes: list[CostNode] = []
    index: dict[str, int] = {}
    walk = GraphWalk(gm.graph)
    edges: list[CostEdge] = []
    strategy_cache: dict = {}
    leaf_cache: dict = {}
    flops = 0.0

    for node in walk.nodes():
        if node.op == "placeholder":
            meta = _tensor_meta(node)
            inp = kinds.get(node.name)
            if not isinstance(meta, TensorMeta) or inp is None:
                continue
            kind = inp.kind if inp.kind in LEAF_KINDS else "buffer"
            allow = shard_parameters if kind == "parameter" else kind == "user_input"
            leaf_key = (meta, kind, allow)
            if leaf_key not in leaf_cache:  # one list per kind of leaf: edges from it share matrices
                strats = [Strategy((), (s,)) for s in storage_shardings(meta, mesh_shape, allow_shard=allow)]
                leaf_cache[leaf_key] = strats, np.array([cost_model.leaf_memory(meta, s.outputs[0], kind)
                                                         for s in strats])
            strats, mem = leaf_cache[leaf_key]
            zeros = np.zeros(len(strats))
            index[node.name] = len(nodes)
            nodes.append(
                CostNode(node.name, kind, strats, zeros, zeros.copy(), mem,
                         "parameters" if kind == "parameter" else "activations",
                         layer=node.meta.get("autopar_layer"), op="placeholder", target=inp.name,
                         requires_grad=kind == "parameter" and meta.dtype.is_floating_point)
            )
            walk.accept(node, leaf_dependency(kind))
            continue
        meta = _tensor_meta(node)
        if meta is None:
            continue
        spec, key, in_nodes = op_call(node)
        if not spec.outputs:
            continue
        cached = strategy_cache.get(key)
        if cached is None:  # identical calls (every repeated layer) share strategies and costs
            strats = strategies(spec, mesh_shape)
            times = np.array([cost_model.op_times(spec, s) for s in strats]).reshape(len(strats), 2)
            saved = np.array([cost_model.activation_memory(spec, s) for s in strats])
            cached = strategy_cache[key] = (strats, times.sum(axis=1), times[:, 0].copy(), saved,
                                            cost_model.op_flops(spec))
        strats, compute, forward, saved, op_flops = cached
        tensor_inputs = [a for a in in_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        spec_inputs = spec.inputs
        deps = walk.dependencies(in_nodes)
        flops += op_flops
        requires_grad = "param" in deps and meta_is_float(spec.outputs)
        mem = saved if requires_grad else np.zeros(len(strats))
        idx = len(nodes)
        nodes.append(
            CostNode(node.name, "op", strats, compute, np.zeros(len(strats)), mem, "activations",
                     layer=node.meta.get("autopar_layer"), op=str(node.target),
                     requires_grad=requires_grad, fixed=not deps, batch_dependent="input" in deps, spec=spec,
                     forward=forward, flops=op_flops)
        )
        index[node.name] = idx
        walk.accept(node, deps)
        for in_index, a in enumerate(tensor_inputs):
            if a.name not in walk.producer:
                continue
            base, out_index = walk.producer[a.name]
            src = index[base]
            src_node = nodes[src]
            in_meta = spec_inputs[in_index]
            grad = src_node.requires_grad and in_meta.dtype.is_floating_point
            cost = cost_model.edge_matrix(
                in_meta, src_node.strategies, out_index, strats, in_index,
                grad=grad, regather=src_node.kind == "parameter",
            )
            edges.append(CostEdge(src, idx, out_index, in_index, in_meta, cost))

    graph = CostGraph(nodes, edges, index, flops_per_step=flops)
    producer = {name: (index[base], k) for name, (base, k) in walk.producer.items()}
    _add_output_costs(graph, captured, producer, cost_model)
    return graph


def meta_is_float(outputs) -> bool:
    return any(o.dtype.is_floating_point for o in outputs)


def _add_output_costs(graph: CostGraph, captured, producer, cost_model) -> None:
    """The loss must end replicated and buffer updates must match the buffer's storage."""
    out_node = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out_node.args)
    for spec, arg in zip(captured.outputs, flat):
        if not isinstance(arg, torch.fx.Node) or arg.name not in producer:
            continue
        if spec.kind not in ("loss", "buffer_mutation"):
            continue
        src, k = producer[arg.name]
        node = graph.nodes[src]
        meta = _tensor_meta(arg)
        if not isinstance(meta, TensorMeta):
            continue
        extra = np.array([
            cost_model.reshard_time(meta, s.outputs[k], (Replicate(),) * len(s.outputs[k]), grad=False)
            for s in node.strategies
        ])
        graph.unary[src] = graph.unary.get(src, 0) + extra


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
    walking the arguments once instead of the several pytree passes spec_of_node makes."""
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
