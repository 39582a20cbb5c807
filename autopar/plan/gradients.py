"""gradient_pass: plan every edge's collectives and choose their backward so autograd is exact.

Each rank runs plain autograd on its local program. That is exact when, on every mesh axis, the
gradient arriving at each local tensor has a known *kind*:

- a tensor ``S(d)`` on the axis gets the matching block of the true gradient;
- a tensor ``P`` gets the whole true gradient (``d sum_r x_r / d x_r`` is the identity);
- a tensor ``R`` gets either the whole true gradient (kind ``R``) or a piece of it whose sum over
  the axis is the true gradient (kind ``P``, a pending sum).

Contributions to a replicated input of an op are kind ``P`` when the op's option on the axis is
split (some output is not ``R``): each rank differentiated only its share of the work. Through an
op whose outputs are all ``R`` the kind is that of the output gradients (a backward is linear in
them). Walking the graph backwards, a replicated value whose contributions are all ``P`` stays a
pending sum (and its producer sees that), one with mixed contributions gets an all-reduce on each
``P`` edge (Megatron's *f*), and a trainable replicated parameter left with ``P`` gets one
all-reduce (data parallelism). Collectives pick their adjoint from the kind by the convention of
:mod:`autopar.core.reshard` (the one the cost model prices): an all-gather feeding ``P`` gradients
reduce-scatters them (ZeRO-3/FSDP), one feeding ``R`` gradients just slices; a ``P -> R``
all-reduce is the identity backward (Megatron's *g*) unless its gradient is still a pending sum.
A ``R -> S`` chunk or ``R -> P`` conversion can hand back either kind for free and follows the
others. This pass adds what one edge cannot see: the graph-wide kind of each value.

Results go to ``meta["autopar_edges"]`` on every consumer (one :class:`EdgePlan` per tensor input,
and per output on the output node) and ``meta["autopar_value_grad"]`` (gradient-only ops on a
value: ``("grad_all_reduce" | "grad_to_partial", axis)``).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from autopar.core.errors import CodegenError
from autopar.core.ir import output_leaves, remembered_inputs
from autopar.core.placement import Partial, Replicate, Shard
from autopar.core.reshard import DEFAULT_BACKWARD, FLEXIBLE, Step, input_kind, plan_steps, walk_back


@dataclass
class EdgePlan:
    """The collectives on one producer -> consumer edge, with the backward each one uses."""

    producer: torch.fx.Node
    steps: list[Step]
    backward: list[str | None]
    grad_all_reduce: set[int] = field(default_factory=set)  # axes: Megatron f on this edge
    grad: bool = False  # a gradient flows back through it (its steps' adjoints run)

    def key(self) -> tuple:
        return (self.producer, tuple(sorted(self.grad_all_reduce)), tuple(zip(self.steps, self.backward)))


def _edge(producer: torch.fx.Node, dst, mesh_shape) -> EdgePlan:
    src = producer.meta["autopar_sharding"]
    ndim = len(producer.meta["autopar_shape"])
    steps = plan_steps(src, dst, ndim=ndim, mesh_shape=mesh_shape)
    return EdgePlan(producer, steps, [DEFAULT_BACKWARD.get(s.kind) for s in steps])


def _outputs_of(node: torch.fx.Node) -> list:
    """The value nodes holding ``node``'s tensor outputs, in tensor order (None: unused)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [node]
    n_tensors = sum(1 for v in val if isinstance(v, torch.Tensor)) if isinstance(val, (tuple, list)) else 0
    outs: list = [None] * n_tensors
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            k = user.args[1]
            idx = sum(1 for v in val[:k] if isinstance(v, torch.Tensor))
            outs[idx] = user
    return outs


class _AxisAnalysis:
    """The gradient-kind analysis on one mesh axis (see the module docstring)."""

    def __init__(self, axis: int, loss_outputs):
        self.axis = axis
        self.loss_outputs = set(loss_outputs)
        self.contrib: dict = defaultdict(list)  # value -> [(edge, kind, index of a flexible step)]

    def walk(self, edge: EdgePlan, kind: str | None) -> None:
        """Carry a consumer's contribution back along ``edge`` to its producer."""
        if kind is None or not edge.producer.meta.get("autopar_requires_grad"):
            return
        edge.grad = True
        adjoints, kind, flex = walk_back(edge.steps, self.axis, kind)
        for idx, adjoint in adjoints.items():
            # only a step with a choice records it: an edge that carries gradients and one that
            # does not stay one call when their steps have no choice to make
            if edge.steps[idx].kind in DEFAULT_BACKWARD:
                edge.backward[idx] = adjoint
        self.contrib[edge.producer].append((edge, kind, flex))

    def resolve(self, value: torch.fx.Node | None) -> str | None:
        """The kind of gradient ``value`` receives; adds f on edges where contributions mix."""
        if value is None or not value.meta.get("autopar_requires_grad"):
            return None
        place = value.meta["autopar_sharding"][self.axis]
        items = self.contrib.get(value, [])
        if isinstance(place, Shard):
            return "S" if items else None
        if isinstance(place, Partial):
            bad = [k for _, k, _ in items if k not in ("R", None)]
            if bad:
                raise CodegenError(f"{value.name} is Partial on mesh axis {self.axis} but a consumer"
                                   f" hands back a {bad[0]} gradient")
            return "R" if items else None
        fixed = {k for _, k, _ in items if k in ("R", "P")}
        if not items:
            return None
        kind = "P" if fixed == {"P"} else "R"
        for edge, k, flex in items:
            if k == "F":
                edge.backward[flex] = FLEXIBLE[edge.steps[flex].kind][kind]
            elif k == "P" and kind == "R":
                edge.grad_all_reduce.add(self.axis)
        return kind

    def compute_node(self, node: torch.fx.Node, edges: list[EdgePlan]) -> None:
        a = self.axis
        strat = node.meta["autopar_strategy"]
        outs = _outputs_of(node)
        kinds = [self.resolve(o) for o in outs]
        places = [s[a] for s in strat.outputs]
        if all(isinstance(p, Replicate) for p in places):
            present = {k for k in kinds if k is not None}
            if present == {"R", "P"}:  # make the replicated-gradient outputs pending sums too
                for o, k in zip(outs, kinds):
                    if k == "R":
                        _add_value_grad(o, "grad_to_partial", a)
                present = {"P"}
            r_kind = present.pop() if present else None
        else:
            for o, k, p in zip(outs, kinds, places):
                if isinstance(p, Replicate) and k == "R":
                    _add_value_grad(o, "grad_to_partial", a)
            r_kind = "P" if any(k is not None for k in kinds) else None
        if r_kind is not None:
            given = node.meta.get("autopar_grad_in")  # None: every input, as far as capture knows
            for i, edge in enumerate(edges):
                if given is None or i in given:  # type_as hands its second input no gradient
                    self.walk(edge, input_kind(strat.inputs[i][a], r_kind))

    def placeholder(self, node: torch.fx.Node) -> None:
        if self.resolve(node) == "P":
            _add_value_grad(node, "grad_all_reduce", self.axis)


def _add_value_grad(node: torch.fx.Node, kind: str, axis: int) -> None:
    node.meta.setdefault("autopar_value_grad", []).append((kind, axis))


def gradient_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    a = ctx.assignment
    mesh = a.mesh_shape
    graph = gm.graph
    nodes = list(graph.nodes)
    edges: dict = {}
    for node in nodes:
        node.meta.pop("autopar_value_grad", None)
        if node.op == "call_function" and "autopar_strategy" in node.meta:
            strat = node.meta["autopar_strategy"]
            ins = remembered_inputs(node, getattr(ctx, "inputs_memo", None))
            edges[node] = [_edge(p, strat.inputs[i], mesh) for i, p in enumerate(ins)]
        elif node.op == "output":
            edges[node] = [_edge(p, a.output_shardings[i], mesh) for i, p in enumerate(output_leaves(graph))]
    for axis, n in enumerate(mesh):
        if n == 1:
            continue
        analysis = _AxisAnalysis(axis, ctx.loss_outputs)
        for node in reversed(nodes):
            if node.op == "output":
                for i, edge in enumerate(edges[node]):
                    analysis.walk(edge, "R" if i in analysis.loss_outputs else None)
            elif node.op == "placeholder":
                analysis.placeholder(node)
            elif node in edges:
                analysis.compute_node(node, edges[node])
    for node, plans in edges.items():
        node.meta["autopar_edges"] = plans
    return gm


__all__ = ["EdgePlan", "gradient_pass"]
