"""The cost graph: every planned tensor-producing node with its strategies and their costs,
and every producer→consumer tensor edge with a resharding-cost matrix, built by
:func:`build_cost_graph` for the intra-op planner and for stage costing alike.

Nodes are parameters, buffers and user inputs (their strategies are storage shardings) and
ATen ops (their strategies come from the rule registry). Costs are seconds per training step
(forward + backward) and bytes per device, from :class:`autopar.planner.costs.CostModel`.

Gradient synchronisation lives on edges: when a consumer's strategy computes differently on
the ranks of mesh axis ``a`` (its option there is not all-replicated) and takes a ``Replicate``
input on ``a``, that input's gradient is a partial sum over ``a`` and must be all-reduced in
backward (Megatron's *f*; for a replicated weight under a sharded batch it is data parallelism's
gradient all-reduce). When the input is a parameter stored sharded on ``a`` (ZeRO-3/FSDP) the
all-gather on use is re-done in backward and the all-reduce becomes a reduce-scatter.

**Micro-batch mode** (``microbatch=``, a window's :class:`~autopar.planner.microbatch.WindowInfo`,
with a :class:`~autopar.planner.microbatch.MicroBatchCostModel`): the cost model's mesh is
``(pieces, *tp)``, its axis 0 the virtual micro-batch axis. Strategies are chosen on the ``tp``
axes and costed extended by each tensor's fixed placement on axis 0 (those that then do not
divide evenly are dropped); costs are per micro-batch on one replica (constants, nodes that read
no input and no parameter, included: a stage's program computes them for every micro-batch), and
every edge keeps its cost split into forward, backward and per-step seconds
(:attr:`CostEdge.phases`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
from torch.utils import _pytree as pytree

from autopar.core.ir import OpSpec, Strategy, TensorMeta, differentiable, gradient_inputs, gradient_values, view_root
from autopar.core.placement import Replicate, Shard, fits
from autopar.passes.rules.registry import strategies
from autopar.planner.graph_walk import GraphWalk, leaf_dependency, op_call, value_meta

LEAF_KINDS = ("parameter", "buffer", "user_input")
R = Replicate()


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

    def with_memory(self, memory: np.ndarray) -> CostNode:
        """This node with per-strategy ``memory`` (a memory saver's view)."""
        return copied(self, memory=memory)


@dataclass
class CostEdge:
    """A tensor from output ``out_index`` of ``src`` to tensor input ``in_index`` of ``dst``."""

    src: int
    dst: int
    out_index: int
    in_index: int
    meta: TensorMeta
    cost: np.ndarray  # [src strategy, dst strategy] seconds
    # micro-batch mode only: the cost split into forward, backward and per-step seconds
    phases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    regather: bool = False  # from a parameter or a view of one: gathered again in backward
    grad: bool = False  # a gradient flows back along it (a floating value its consumer's backward hands one)


@dataclass
class CostGraph:
    """Nodes, edges, node index by name; ``unary`` adds per-strategy costs to some nodes."""

    nodes: list[CostNode]
    edges: list[CostEdge]
    index: dict[str, int]
    unary: dict[int, np.ndarray] = field(default_factory=dict)  # extra per-strategy costs (outputs)
    flops_per_step: float = 0.0
    # what solving derives from it and may reuse (its simplified form); a replace() starts afresh
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)


def copied(item, **changes):
    """A shallow copy of the dataclass instance ``item`` with ``changes``, made from its fields
    directly: ``dataclasses.replace`` runs ``__init__`` and takes seven times as long, which the
    planner's memory views and restrictions pay for every node and edge."""
    out = object.__new__(type(item))
    out.__dict__.update(item.__dict__)
    out.__dict__.update(changes)
    return out


def with_memory(graph: CostGraph, nodes: list[CostNode]) -> CostGraph:
    """``graph`` with ``nodes``, which differ from its own in their memory only (a memory saver's
    view): solving it re-sums the simplified form of the graph whose costs it shares
    (:meth:`~autopar.planner.simplify.Reduced.with_memory`) instead of simplifying it again."""
    out = dataclasses.replace(graph, nodes=nodes)
    out.memo["costs of"] = graph.memo.get("costs of", graph)
    return out


@dataclass(frozen=True)
class PlannedGraph:
    """The FX graph a cost graph is built from, and what the builder must know about it."""

    graph: torch.fx.Graph
    inputs: Mapping[str, object]  # placeholder name -> its GraphInput (kind, name)
    layers: Mapping[str, str]  # node name -> repeat label (simplify ties equal-looking labels)
    replicated: tuple[str, ...]  # values that must end replicated: the loss, buffer updates

    @classmethod
    def of(cls, captured) -> PlannedGraph:
        """The whole captured graph, labelled with capture's repeat labels (repeated blocks, loop
        iterations: :mod:`autopar.passes.capture.repeats`)."""
        graph = captured.graph_module.graph
        out = next(n for n in graph.nodes if n.op == "output")
        replicated = tuple(arg.name for spec, arg in zip(captured.outputs, pytree.tree_leaves(out.args))
                           if isinstance(arg, torch.fx.Node) and spec.kind in ("loss", "buffer_mutation"))
        layers = {n.name: n.meta["autopar_repeat"] for n in graph.nodes if n.meta.get("autopar_repeat") is not None}
        return cls(graph, {inp.node: inp for inp in captured.inputs}, layers, replicated)


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


def build_cost_graph(planned: PlannedGraph, cost_model, *, microbatch=None,
                     allowed: Mapping[str, set] | None = None) -> CostGraph:
    """The cost graph of ``planned`` on ``cost_model``'s mesh (module docstring); ``microbatch``
    turns on the micro-batch mode, and ``allowed[node]`` limits a node's strategies (a leaf
    keeps its first one, an op the all-replicated one, when none is left)."""
    mesh = tuple(cost_model.mesh_shape)
    axes = mesh[1:] if microbatch is not None else mesh  # the mesh strategies are chosen on
    walk = GraphWalk(planned.graph)
    nodes: list[CostNode] = []
    costed: list[list[Strategy]] = []  # per node: its strategies as costed (extended in micro-batch mode)
    edges: list[CostEdge] = []
    index: dict[str, int] = {}
    cache: dict = {}  # identical leaves and calls (repeated layers, a loop's steps) share strategies and costs
    flops = 0.0
    reached = gradient_values(planned.graph, {name for name, inp in planned.inputs.items()
                                              if inp.kind == "parameter" and not inp.frozen})
    for node in walk.nodes():
        name, meta = node.name, value_meta(node)
        if microbatch is not None and name not in microbatch.mb_out:
            continue  # the micro-batch analysis found no placement: not planned
        only = frozenset(allowed[name]) if allowed is not None and name in allowed else None
        if node.op == "placeholder":
            inp = planned.inputs.get(name)
            if not isinstance(meta, TensorMeta) or inp is None:
                continue
            kind = inp.kind if inp.kind in LEAF_KINDS else "buffer"
            frozen = kind == "parameter" and inp.frozen
            key = (meta, kind, frozen, None if microbatch is None else microbatch.mb_out[name], only)
            if key not in cache:
                cache[key] = _leaf_costs(meta, kind, name, cost_model, axes, microbatch, only, frozen=frozen)
            strats, ext, memory = cache[key]
            zeros = np.zeros(len(strats))
            index[name] = len(nodes)
            nodes.append(CostNode(name, kind, strats, zeros, zeros.copy(), memory,
                                  "parameters" if kind == "parameter" else "activations",
                                  layer=planned.layers.get(name), op="placeholder", target=inp.name,
                                  requires_grad=kind == "parameter" and not frozen and differentiable(meta.dtype)))
            costed.append(ext)
            walk.accept(node, leaf_dependency(kind, frozen=frozen))
            continue
        if meta is None:
            continue
        spec, call, in_nodes = op_call(node)
        if not spec.outputs:
            continue
        kept = node.meta.get("autopar_saved", ())  # a node capture did not see keeps nothing
        # what it keeps, less which storage (a loop's steps keep storages of their own at equal costs)
        parts = tuple((p.where, p.index, p.elements, p.dtype, p.share) for p in kept)
        tensor_inputs = [a for a in in_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        grads = gradient_inputs(node, reached, tensor_inputs)  # which inputs its backward hands a gradient
        key = (call, parts, grads, None if microbatch is None else (microbatch.mb_in[name], microbatch.mb_out[name]),
               only)
        if key not in cache:
            cache[key] = _op_costs(spec, kept, grads, name, cost_model, axes, microbatch, only)
        strats, ext, compute, forward, saved, op_flops = cache[key]
        deps = walk.dependencies(in_nodes)
        flops += op_flops
        requires_grad = ("param" in deps and any(differentiable(o.dtype) for o in spec.outputs)
                         and node.meta.get("autopar_grad_out", True))  # as autograd saw it at capture
        idx = index[name] = len(nodes)
        nodes.append(CostNode(name, "op", strats, compute, np.zeros(len(strats)),
                              saved if requires_grad else np.zeros(len(strats)), "activations",
                              layer=planned.layers.get(name), op=str(node.target), requires_grad=requires_grad,
                              fixed=not deps, batch_dependent="input" in deps, spec=spec, forward=forward,
                              flops=op_flops))
        costed.append(ext)
        walk.accept(node, deps)
        for in_index, a in enumerate(tensor_inputs):
            if a.name not in walk.producer:
                continue
            base, out_index = walk.producer[a.name]
            src = index[base]
            in_meta = spec.inputs[in_index]
            root = index.get(view_root(a).name)  # a view of a parameter is gathered again as the parameter is
            regather = nodes[src].kind == "parameter" or (root is not None and nodes[root].kind == "parameter")
            grad = grads[in_index]  # type_as hands its second input no gradient, nor a call none reaches its inputs
            cost, phases = _edge_cost(cost_model, microbatch, in_meta, costed[src], out_index, ext, in_index,
                                      grad=grad, regather=regather)
            edges.append(CostEdge(src, idx, out_index, in_index, in_meta, cost, phases, regather, grad))
    graph = CostGraph(nodes, edges, index, flops_per_step=flops)
    _add_output_costs(graph, planned, walk, costed, cost_model, kept=len(mesh) - len(axes))
    return graph


def _extended(microbatch, name: str, strategies: list[Strategy]) -> list[Strategy]:
    """The strategies as costed: with the micro-batch placement in front in micro-batch mode."""
    return strategies if microbatch is None else [microbatch.extend(name, s) for s in strategies]


def _leaf_costs(meta: TensorMeta, kind: str, name: str, cost_model, axes, microbatch, only, *, frozen: bool):
    """(storage strategies, as costed, bytes per device) of one graph input (``frozen``: a
    parameter without gradient or optimizer state)."""
    allow = cost_model.options.shard_parameters if kind == "parameter" else kind == "user_input"
    strats = [Strategy((), (s,)) for s in storage_shardings(meta, axes, allow_shard=allow)]
    if microbatch is not None:
        strats = [s for s, e in zip(strats, _extended(microbatch, name, strats))
                  if fits(meta.shape, e.outputs[0], cost_model.mesh_shape)]
    if only is not None:
        strats = [s for s in strats if s in only] or strats[:1]
    ext = _extended(microbatch, name, strats)
    return strats, ext, np.array([cost_model.leaf_memory(meta, e.outputs[0], kind, frozen=frozen) for e in ext])


def _op_costs(spec: OpSpec, kept: tuple, grads: tuple[bool, ...], name: str, cost_model, axes, microbatch, only):
    """(strategies, as costed, compute seconds, of which forward, saved bytes, FLOPs) of one call
    whose backward keeps ``kept`` and hands its inputs the gradients ``grads`` says."""
    strats = [s for s in strategies(spec, axes, warn=microbatch is None) if only is None or s in only]
    if microbatch is not None:  # only those that still divide evenly with the micro-batch axis
        mesh = cost_model.mesh_shape
        strats = [s for s, e in zip(strats, _extended(microbatch, name, strats))
                  if all(fits(t.shape, sh, mesh) for t, sh in zip(spec.inputs, e.inputs))
                  and all(fits(t.shape, sh, mesh) for t, sh in zip(spec.outputs, e.outputs))]
    if not strats:
        strats = [Strategy(tuple((R,) * len(axes) for _ in spec.inputs), tuple((R,) * len(axes) for _ in spec.outputs))]
    ext = _extended(microbatch, name, strats)
    times = np.array([cost_model.op_times(spec, e, grads) for e in ext]).reshape(len(ext), 2)
    saved = np.array([cost_model.parts_memory(spec, e, kept) for e in ext])
    return strats, ext, times.sum(axis=1), times[:, 0].copy(), saved, cost_model.op_flops(spec, grads)


def _edge_cost(cost_model, microbatch, meta, src, out_index, dst, in_index, *, grad: bool, regather: bool):
    """(resharding seconds per strategy pair, their (forward, backward, per-step) split or None)."""
    if microbatch is None:
        return cost_model.edge_matrix(meta, src, out_index, dst, in_index, grad=grad, regather=regather), None
    phases = cost_model.edge_phases(meta, src, out_index, dst, in_index, grad=grad, regather=regather)
    return phases[0] + phases[1] + cost_model.step_weight * phases[2], phases


def _replicated(sharding, kept: int) -> tuple:
    """``sharding`` with every placement after the first ``kept`` replaced by ``Replicate``."""
    return tuple(sharding[:kept]) + (R,) * (len(sharding) - kept)


def _add_output_costs(graph: CostGraph, planned: PlannedGraph, walk: GraphWalk, costed, cost_model, *,
                      kept: int) -> None:
    """The loss and buffer updates must end replicated on the planned axes (all but the first
    ``kept``: the micro-batch axis keeps its placement): their producers pay for getting there."""
    by_name = {n.name: n for n in planned.graph.nodes}
    for name in planned.replicated:
        meta = value_meta(by_name[name])
        if name not in walk.producer or not isinstance(meta, TensorMeta):
            continue
        base, k = walk.producer[name]
        src = graph.index[base]
        extra = np.array([cost_model.reshard_time(meta, s.outputs[k], _replicated(s.outputs[k], kept), grad=False)
                          for s in costed[src]])
        graph.unary[src] = graph.unary.get(src, 0) + extra


__all__ = ["CostEdge", "CostGraph", "CostNode", "LEAF_KINDS", "PlannedGraph", "build_cost_graph", "copied",
           "storage_shardings"]
