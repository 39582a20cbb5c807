"""The collectives a one-program plan's program issues per step, read from the analysis code
generation runs on the graph (:func:`~autopar.plan.annotate.annotate_pass`, then
:func:`~autopar.plan.gradients.gradient_pass`: every edge's steps and their chosen backward),
priced by the one resharding planner (:func:`autopar.core.reshard.step_collectives`).

What a lone edge cannot show, the whole graph does, as the program runs it:

- consumers that need the same resharding of a value share one call (a tied or re-read
  parameter is gathered once, its gradient reduced once);
- a value whose gradient contributions mix whole and pending sums gets Megatron's *f* on each
  pending edge; a replicated trainable parameter left with a pending sum gets one all-reduce;
- steps whose output no gradient reaches run no adjoint;
- a sharded parameter (or a view of one) is gathered again in backward only when a consumer
  saves the gathered tensor for its backward (:mod:`autopar.comm.regather`): a linear's bias or an embedding's
  table is not saved, and a consumer that recomputes its forward saves what its rerun gathers;
- the loss's own sums (the count of its terms, its mean over data-parallel ranks) are edges too.

    records = program_collectives(captured, assignment, precision=precision, zero=0)
    # [(phase, kind, mesh axis, bytes per rank, consumer node name), ...]
"""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree

from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.ir import aliases_input, copy_graph_module, is_tensor_node, view_root
from autopar.core.placement import Shard
from autopar.core.recompute import program_nodes, regions, rerun
from autopar.core.reshard import ADJOINTS, regathered, step_collectives
from autopar.plan.annotate import annotate_pass
from autopar.plan.gradients import gradient_pass
from autopar.plan.zero import zero_step_collectives


def saved_inputs(node: torch.fx.Node) -> frozenset[int]:
    """The indices of ``node``'s tensor inputs its backward keeps (or a view of), as capture saw
    autograd save them (``meta["autopar_saved_inputs"]``,
    :mod:`autopar.passes.capture.saved`); all of them where capture could not tell."""
    known = node.meta.get("autopar_saved_inputs")
    if known is not None:
        return known
    return frozenset(range(sum(1 for a in pytree.tree_leaves((node.args, node.kwargs)) if is_tensor_node(a))))


def trainable_parameters(captured) -> frozenset[str]:
    """Placeholder names of the captured graph's floating parameters that are not frozen (a plan
    trains them all)."""
    return frozenset(i.node for i in captured.inputs
                     if i.kind == "parameter" and not i.frozen and i.meta.dtype.is_floating_point)


class ParameterCount(NamedTuple):
    """One parameter as the floors before any cost graph count it."""

    numel: int
    dtype: torch.dtype
    trainable: bool  # floating and not frozen: a plan trains it


def parameter_counts(captured) -> tuple[ParameterCount, ...]:
    """The :class:`ParameterCount` of each of the captured graph's parameters."""
    trainable = trainable_parameters(captured)
    return tuple(ParameterCount(math.prod(i.meta.shape), i.meta.dtype, i.node in trainable)
                 for i in captured.inputs if i.kind == "parameter")


def module_parameter_counts(module: torch.nn.Module) -> tuple[ParameterCount, ...]:
    """:func:`parameter_counts` of ``module`` before any capture: the graph lists its parameters,
    tied ones once, as ``module.parameters()`` does."""
    return tuple(ParameterCount(p.numel(), p.dtype, p.requires_grad and p.dtype.is_floating_point)
                 for p in module.parameters())


def frozen_parameters(captured) -> frozenset[str]:
    """Placeholder names of the captured graph's frozen parameters."""
    return frozenset(i.node for i in captured.inputs if i.kind == "parameter" and i.frozen)


def program_collectives(captured, assignment, *, precision, zero: int = 0, recompute: bool | str = False
                        ) -> list[tuple[str, str, int, float, str]]:
    """``(phase, kind, mesh axis, bytes per rank, node)`` of every collective one step of the
    program of ``assignment`` issues (see the module docstring) in ``precision`` (a
    :class:`~autopar.core.precision.Precision`) at ZeRO stage ``zero`` (:mod:`autopar.plan.zero`).
    Every parameter but the frozen ones is trained. With ``recompute`` the forward collectives inside a
    layer region that the recomputation reaches run again in backward
    (:mod:`autopar.core.recompute`)."""
    trainable = trainable_parameters(captured)
    sums, calls = graph_collectives(_analysed(captured, assignment), tuple(assignment.mesh_shape),
                                    held(captured, precision), {name: zero for name in trainable},
                                    frozen=frozen_parameters(captured), recompute=recompute)
    return sums + calls


def graph_collectives(gm: torch.fx.GraphModule, mesh: tuple[int, ...], itemsize, zero_of: dict[str, int], *,
                      frozen=frozenset(), recompute: bool | str = False) -> tuple[list, list]:
    """``(sums, calls)``: the collectives of one forward and backward of ``gm`` (after code
    generation's analysis) on ``mesh``, with values held in ``itemsize(value)`` bytes per element.
    ``sums`` are the gradient sums of the trainable parameters ``zero_of`` names, with the ZeRO
    stage of each (:func:`~autopar.plan.zero.zero_step_collectives`): a pipeline runs them once
    per step, on the gradient summed over the micro-batches. ``calls`` are the others. ``frozen``
    names the frozen parameters' placeholders (gathered again in backward, never summed)."""
    uses: dict = {}  # edge key -> ([edges], [(consumer, tensor input index)]): one call in the program
    for node in gm.graph.nodes:
        for i, edge in enumerate(node.meta.get("autopar_edges") or ()):
            edges, consumers = uses.setdefault(edge.key(), ([], []))
            edges.append(edge)
            consumers.append((node, i))
    again = _run_again(gm.graph, selective=recompute == "selective") if recompute else set()
    sums, calls = [], []
    for node in gm.graph.nodes:  # gradient-only collectives on values (a data-parallel gradient)
        axes = _grad_sum_axes(node)
        if axes:  # on a trainable parameter itself these are the sums ZeRO-1/2 shard over
            param = node.op == "placeholder" and node.name in zero_of
            (sums if param else calls).extend(zero_step_collectives(
                node.name, round(_bytes(node, lambda _: 1, mesh)), itemsize(node), axes, mesh,
                zero_of[node.name] if param else 0))
    for edges, consumers in uses.values():
        edge = edges[0]
        src = edge.producer
        backward = [_adjoint(s, b) for s, b in zip(edge.steps, edge.backward)] if any(e.grad for e in edges) else None
        root = view_root(src)  # a view of a parameter is gathered again as the parameter is
        regather = (root.op == "placeholder" and (root.name in zero_of or root.name in frozen)
                    and bool(regathered(edge.steps))  # a recomputed consumer saves what its rerun gathers
                    and any(_keeps(c, i, again) for c, i in consumers))
        first = consumers[0][0]
        name = src.name if first.op == "output" else first.name  # a plan names no output node
        for axis in sorted(edge.grad_all_reduce):
            calls.append(("backward", "all_reduce", axis, _bytes(src, itemsize, mesh), name))
        for phase, kind, axis, pieces in step_collectives(edge.steps, src.meta["autopar_sharding"], mesh,
                                                           backward=backward, regather=regather):
            if kind in COLLECTIVE_KINDS:
                calls.append((phase, kind, axis, _bytes(src, itemsize) / pieces, name))
                if phase == "forward" and first.name in again:
                    calls.append(("backward", kind, axis, _bytes(src, itemsize) / pieces, name))
    return sums, calls


def _keeps(consumer: torch.fx.Node, index: int, again: set[str]) -> bool:
    """Whether ``consumer``'s backward keeps its tensor input ``index`` (a view of it included: a
    view op's consumers that keep the view, reached through edges that move nothing or cut dim-0
    blocks, which are views too); a recomputed consumer keeps what its rerun makes, and one whose
    output no gradient reaches runs no backward to unpack it."""
    if consumer.op == "output" or consumer.name in again or not consumer.meta.get("autopar_requires_grad", True):
        return False
    if index in saved_inputs(consumer):
        return True
    if index != 0 or not aliases_input(consumer.target):
        return False
    return any(edge.producer is consumer and all(s.kind == "chunk" and s.dim == 0 for s in edge.steps)
               and _keeps(user, j, again)
               for user in consumer.users for j, edge in enumerate(user.meta.get("autopar_edges") or ()))


def _run_again(graph, *, selective: bool = False) -> set[str]:
    """Nodes whose forward collectives (inserted in front of them, inside their region) a
    recomputation runs again: those it reaches, but a region's first (its collectives come
    before the region)."""
    out = set()
    for region in regions(program_nodes(graph), selective=selective):
        out.update(n.name for n in rerun(region)[0][1:])
    return out


_SCRATCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # captured graph -> (scratch copy, inputs memo)


def _analysed(captured, assignment, *, scratch: bool = False) -> torch.fx.GraphModule:
    """A copy of the captured graph after code generation's analysis of ``assignment`` (every
    parameter trainable). ``scratch``: the one copy kept per captured graph, analysed again (the
    passes set every meta key they write on every node they write it to), for a caller that reads
    it before the next analysis: copying a 10,000-node graph takes seconds."""
    leaves = [x for x in pytree.tree_leaves(captured.graph_module.graph.output_node().args) if is_tensor_node(x)]
    losses = {o.node for o in captured.outputs if o.kind == "loss"}
    loss = next((i for i, x in enumerate(leaves) if x.name in losses), None)
    ctx = SimpleNamespace(assignment=assignment, trainable=trainable_parameters(captured),
                          loss_outputs=() if loss is None else (loss,))
    if not scratch:
        return gradient_pass(annotate_pass(copy_graph_module(captured.graph_module), ctx), ctx)
    hit = _SCRATCH.get(captured.graph_module)
    if hit is None:  # the copy, and its nodes' tensor inputs (the passes change no node's arguments)
        hit = _SCRATCH[captured.graph_module] = copy_graph_module(captured.graph_module), {}
    gm, ctx.inputs_memo = hit
    return gradient_pass(annotate_pass(gm, ctx), ctx)


def zero_parameters(captured, assignment, *, precision) -> dict[str, tuple[str, int, int, tuple[int, ...]]]:
    """Parameter FQN -> (its placeholder, the elements of a rank's piece, the bytes per element
    the program holds it in, the mesh axes its gradient is summed over as data parallelism
    does): the parameters ZeRO-1/2 shard over those axes (:mod:`autopar.plan.zero`)."""
    mesh = tuple(assignment.mesh_shape)
    itemsize = held(captured, precision)
    fqn = {i.node: i.name for i in captured.inputs if i.kind == "parameter"}
    trainable = trainable_parameters(captured)
    out = {}
    for node in _analysed(captured, assignment, scratch=True).graph.nodes:
        axes = _grad_sum_axes(node)
        if axes and node.op == "placeholder" and node.name in trainable:
            out[fqn[node.name]] = (node.name, round(_bytes(node, lambda _: 1, mesh)), itemsize(node), axes)
    return out


def _grad_sum_axes(node: torch.fx.Node) -> tuple[int, ...]:
    """The mesh axes code generation all-reduces ``node``'s own gradient over."""
    return tuple(axis for kind, axis in node.meta.get("autopar_value_grad") or () if kind == "grad_all_reduce")


def held(captured, precision):
    """``itemsize(value)``: bytes per element the program holds a graph value in. Inputs and
    stored tensors are fed in the precision's dtype, and so is what is computed from them; a value
    of another floating dtype than the parameters' was cast explicitly (a loss upcast to fp32 in
    a bf16 model) and keeps it."""
    params = {m.dtype for m in captured.parameters.values() if m.dtype.is_floating_point}

    def itemsize(value: torch.fx.Node) -> int:
        dtype = value.meta["val"].dtype
        if value.op != "placeholder" and dtype.is_floating_point and params and dtype not in params:
            return dtype.itemsize
        return precision.itemsize(dtype)

    return itemsize


def _adjoint(step, chosen: str | None) -> str | None:
    """The backward of ``step``: the one chosen, or the only one it has (an edge records a choice
    only for the steps that have one)."""
    if chosen is None and len(ADJOINTS[step.kind]) == 1:
        return next(iter(ADJOINTS[step.kind].values()))[0]
    return chosen


def _bytes(value: torch.fx.Node, itemsize, mesh=None) -> float:
    """Bytes of ``value`` whole or, given the ``mesh``, of one rank's piece of it."""
    val = value.meta["val"]
    pieces = 1 if mesh is None else math.prod(
        n for n, p in zip(mesh, value.meta["autopar_sharding"]) if isinstance(p, Shard))
    return float(math.prod(val.shape) * itemsize(value) / pieces)


__all__ = ["frozen_parameters", "graph_collectives", "held", "program_collectives", "saved_inputs",
           "trainable_parameters", "zero_parameters"]
