"""The predicted peak memory of one training step of a one-program plan, phase by phase.

The ILP constrains a linear sum (model states plus every saved activation, a storage several
nodes keep shared among them); the program never holds all of that at once, and holds what the
sum leaves out (a backward's gradients and scratch, a second copy of a saved tensor). This peak
is the one a plan reports, and the one it must fit in: where it is above the sum,
:func:`~autopar.planner.intra.plan_intra` solves again with the sum bounded by the limit less the
excess. Its peak is the larger of two moments (what ``verify`` measures):

- **backward**, walked node by node in reverse (:func:`backward_walk`): parameters, optimizer
  state, the inputs and the outputs the program returns besides the loss (e.g. the logits, held
  to the end), what autograd saved (``meta["autopar_saved"]``) until the backward of the first
  node that saved it has run (one copy per sharding a storage is saved at: a tensor resharded
  for a consumer that saves it is held twice, the producer's and the consumer's), the
  parameter gradients made so far (each appears at its last consumer's backward), the
  activations' gradients waiting (each made by its value's last consumer's backward and held
  until its producer's has run: a residual stream's across its branch) and the
  backward of the node in flight (``meta["autopar_backward"]``: its gradients and scratch, e.g.
  the loss's gradients of the logits, and the sharded parameters gathered for it, ZeRO-3, and
  the whole gradients of parameters gathered once for several consumers, summed until the first
  one's backward); after a node's backward, the collective that takes an input's gradient back
  to its producer's sharding holds the gradient, its resharded copy and its own buffers;
- **the optimizer step**: parameters, gradients, optimizer state, the inputs and the outputs the
  program returns besides the loss (e.g. the logits), and the optimizer's scratch (the foreach
  Adam step's square root of the second moment: one tensor of each parameter's size). Under mixed
  precision the gradients then are the fp32 masters' (the program's were moved into them) and the
  scratch is of the masters' size; offloaded, the optimizer's state and scratch are the host's.

Under recomputation (one-program plans' ``recompute``) a repeated layer's region keeps only its
inputs through the forward; its saved tensors are made again when the backward reaches its last
saving node and count as the backward's temporaries, as ``verify`` sees them
(:mod:`autopar.core.recompute`).

A pipeline stage's peak is composed from walks over parts of its layers
(:mod:`autopar.planner.stage_peak`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from autopar.core.placement import Replicate, Shard
from autopar.core.precision import MOMENTS, stepped_copy_share
from autopar.core.recompute import regions as cut_regions
from autopar.plan import MemoryBreakdown
from autopar.planner.costgraph import with_memory


@dataclass(frozen=True)
class Walk:
    """One backward pass over some nodes: ``saved``, what they save (all freed by the end);
    ``made``, the parameter gradients it makes; ``peak``, ``(saved still held, gradients made so
    far, in flight)`` at its highest moment, of which ``communication`` is collective buffers."""

    saved: float
    made: float
    peak: tuple[float, float, float]
    communication: float = 0.0
    checkpoints: float = 0.0  # bytes of checkpoints on the host (offloaded)


def backward_walk(graph, choice, fx_graph, cost_model, nodes, grad_bytes, extend=None, regions=(),
                  rerun: set[str] | None = None, fetched: dict | None = None, offloaded: bool = False,
                  memo: dict | None = None) -> Walk:
    """The :class:`Walk` of the op nodes ``nodes`` (indices into the cost graph ``graph``, in
    graph order) under ``choice``; ``fx_graph`` holds their ``meta["autopar_saved"]`` and
    ``meta["autopar_backward"]``, ``grad_bytes(i)`` is the gradient bytes of parameter node
    ``i``; ``extend(name, strategy)`` gives the strategy the cost model prices (a micro-batch cost
    graph's, with its micro-batch placement:
    :meth:`~autopar.planner.microbatch.WindowInfo.extend`); ``regions``: the recomputed regions'
    nodes (:func:`_recomputed`); ``rerun``: without ``regions``, the names of nodes whose
    parameters a recomputation of all of ``nodes`` gathers again (:func:`_regathered`; a
    recomputing pipeline stage's part, whose activations its stage model holds itself);
    ``fetched``: node -> bytes on the device while its backward runs besides (parameters fetched
    from the host, :mod:`autopar.planner.fetched`); ``offloaded``: the regions' checkpoints wait on
    the host (:func:`_recomputed`); ``memo``: where walks of the same ``graph``, ``choice``,
    ``nodes`` and ``extend`` keep what does not depend on the rest (a solve's ``derived``)."""
    fx = graph.memo.get(("fx nodes", fx_graph))
    if fx is None:
        fx = graph.memo["fx nodes", fx_graph] = {n.name: n for n in fx_graph.nodes}
    fetched = fetched or {}

    chosen: dict[int, object] = {}

    def strategy(i: int):
        s = chosen.get(i)
        if s is None:
            s = graph.nodes[i].strategies[choice[i]]
            s = chosen[i] = s if extend is None else extend(graph.nodes[i].name, s)
        return s

    ops = [i for i in nodes if graph.nodes[i].kind == "op"]
    inside = set(ops)
    uses = None if memo is None else memo.get("backward uses")
    if uses is None:
        uses = (*_parameter_uses(graph, strategy, cost_model, inside),
                _backward_collectives(graph, choice, strategy, cost_model, inside),
                _pending_gradients(graph, strategy, cost_model, inside))
        if memo is not None:
            memo["backward uses"] = uses
    last_use, gathered, summing, resharded, pending = uses
    gathered = dict(gathered)  # the regions' re-gathers move some to their recomputation
    appears: dict[int, float] = {}
    for src, dst in last_use.items():
        if dst in inside:
            appears[dst] = appears.get(dst, 0.0) + grad_bytes(src)
    region_of = {i: r for r, members in enumerate(regions) for i in members}
    key = ("saved copies", tuple(map(tuple, regions)))
    copies = None if memo is None else memo.get(key)
    if copies is None:
        copies = _saved_copies(graph, strategy, cost_model, fx, ops, regions, region_of)
        if memo is not None:
            memo[key] = copies
    in_flight = None if memo is None else memo.get("in flight")
    if in_flight is None:  # each node's backward: its gradients and scratch
        known = graph.memo.setdefault("in flight", {})  # (node, strategy index) -> bytes
        in_flight = {}
        for i in ops:
            if graph.nodes[i].requires_grad:
                nbytes = known.get((i, choice[i]))
                if nbytes is None:
                    nbytes = known[i, choice[i]] = cost_model.parts_memory(
                        graph.nodes[i].spec, strategy(i), fx[graph.nodes[i].name].meta.get("autopar_backward", ()))
                in_flight[i] = nbytes
        if memo is not None:
            memo["in flight"] = in_flight
    saved: dict[int, float] = {}  # node -> bytes freed when its backward has run
    saving = {r for r, members in enumerate(regions) if any(fx[graph.nodes[i].name].meta.get("autopar_saved")
                                                             for i in members)}
    again, start = _recomputed(graph, strategy, cost_model, regions, region_of, copies, saved, saving, offloaded)
    if rerun is not None and not regions:
        _regathered([[i for i in ops if graph.nodes[i].name in rerun]], gathered, again, start)
    else:
        _regathered(regions, gathered, again, start)
    remaining = total = sum(saved.values())
    recomputed = 0.0  # the saved tensors a recomputation made, not yet freed
    made = 0.0
    peak, communication = (0.0, 0.0, 0.0), 0.0
    for i in reversed(ops):
        node = graph.nodes[i]
        recomputed += start.get(i, 0.0)
        if not node.requires_grad:
            continue
        running = fetched.get(i, 0.0) + gathered.get(i, 0.0) + summing.get(i, 0.0) + pending.get(i, 0.0) \
            + in_flight[i]
        if sum((remaining, made, running + recomputed)) > sum(peak):
            peak, communication = (remaining, made, running + recomputed), 0.0
        remaining -= saved.get(i, 0.0)
        recomputed -= again.get(i, 0.0)
        made += appears.get(i, 0.0)  # its backward made these (counted in ``running`` meanwhile)
        if i in resharded:  # then its input's gradient goes back through a collective
            grad, buffers = resharded[i]
            running = fetched.get(i, 0.0) + pending.get(i, 0.0) + grad + buffers
            if sum((remaining, made, running + recomputed)) > sum(peak):
                peak, communication = (remaining, made, running + recomputed), buffers
    return Walk(total, made, peak, communication, checkpoints=sum(checkpoint_bytes(
        graph, strategy, cost_model, regions, region_of, saving, grad=True).values()) if offloaded else 0.0)


def _saved_copies(graph, strategy, cost_model, fx: dict, ops: list, regions, region_of: dict) -> dict:
    """What the forward of ``ops`` saves, one copy per (storage, layer, sharding) -> [bytes, its
    first holder]; a recomputed region's inputs are left to its checkpoint (:func:`_recomputed`);
    an input kept itself (not a tensor made of it) that the program cuts as a view of its
    producer's contiguous tensor keeps all of that (:func:`_viewed_from`)."""
    copies: dict[tuple, list] = {}
    for i in ops:
        meta = fx[graph.nodes[i].name].meta
        layer = meta.get("autopar_layer")  # stamped layers repeat their template's numbers
        for part in meta.get("autopar_saved", ()):
            edge = next((e for e in edges_into(graph, (i,)) if e.in_index == part.index), None) \
                if part.where == "input" else None
            if i in region_of and edge is not None and region_of.get(edge.src) != region_of[i]:
                continue  # a region's input: its checkpoint keeps it (_recomputed)
            sharding, nbytes = cost_model.part_bytes(graph.nodes[i].spec, strategy(i), part)
            whole = None if edge is None or part.index not in meta.get("autopar_saved_inputs", ()) \
                or not _contiguous(fx.get(graph.nodes[edge.src].name), edge.out_index) else \
                _viewed_from(strategy(edge.src).outputs[edge.out_index], sharding, edge.meta.shape)
            if whole is not None:
                sharding, nbytes = whole, cost_model.held_bytes(edge.meta, whole, part.dtype) * part.elements
            copy = copies.setdefault((part.storage, layer, sharding), [nbytes, i])
            copy[1] = min(copy[1], i)
    return copies


def _contiguous(node, index: int) -> bool:
    """Whether output ``index`` of fx node ``node`` was contiguous at capture (a block of its rows
    is then a view; :func:`autopar.comm.plain.chunk` copies the block of a transposed value)."""
    val = None if node is None else node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = [v for v in val if isinstance(v, torch.Tensor)][index] if index < len(val) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _viewed_from(made, taken, shape) -> tuple | None:
    """``made``, where a value made at sharding ``made`` reaches its consumer at ``taken`` as a
    block the program cuts as a view (:func:`autopar.comm.plain.chunk`: a block of leading rows;
    the view keeps the whole block ``made`` alive, a per-layer mask cut for a rank's rows); else
    None."""
    made = tuple(made)
    if made == taken:
        return None
    for have, want in zip(made, taken):
        if have == want:
            continue
        if not (isinstance(have, Replicate) and isinstance(want, Shard)
                and all(n == 1 for n in shape[:want.dim])):
            return None
    return made


def _recomputed(graph, strategy, cost_model, regions, region_of: dict, copies: dict, saved: dict,
                saving: set, offloaded: bool = False) -> tuple[dict, dict]:
    """Split the saved copies (``(storage, layer, sharding) -> [bytes, first holder]``) into what
    the forward keeps (added to ``saved``: node -> bytes freed when its backward has run) and what
    recomputation makes again. A recomputed region (torch's checkpoint) keeps only its inputs made
    outside it, until the backward of the first region reading them has run (a region that saves
    nothing, of ``saving``'s complement, keeps nothing: its checkpoint is never unpacked); in backward its
    saved tensors are made again when the walk reaches the last node first saving one, and each is
    freed as without recomputation. ``offloaded``: the checkpoints wait on the host instead and come
    back with their region's recomputation, until its backward has run. Returns (node -> recomputed
    bytes freed after its backward, node -> recomputed bytes made before its backward)."""
    again: dict[int, float] = {}
    for nbytes, first in copies.values():
        into = again if first in region_of else saved
        into[first] = into.get(first, 0.0) + nbytes
    start: dict[int, float] = {}
    for members in regions:
        inside = [i for i in members if i in again]
        if inside:
            start[max(inside)] = sum(again[i] for i in inside)
    if offloaded:
        for r, nbytes in checkpoint_bytes(graph, strategy, cost_model, regions, region_of, saving,
                                          per_region=True, grad=True).items():
            trigger = max((i for i in regions[r] if i in start), default=None)
            if trigger is not None:
                start[trigger] += nbytes
                again[regions[r][0]] = again.get(regions[r][0], 0.0) + nbytes
    kept = checkpoint_bytes(graph, strategy, cost_model, regions, region_of, saving, grad=False if offloaded else None)
    for first, nbytes in kept.items():
        saved[first] = saved.get(first, 0.0) + nbytes
    return again, start


def checkpoint_bytes(graph, strategy, cost_model, regions, region_of: dict, saving: set, *,
                     per_region: bool = False, grad: bool | None = None) -> dict[int, float]:
    """The recomputed regions' inputs made by op nodes outside them, what their checkpoints keep:
    bytes by the first node of the first region reading each (``per_region``: by region, each
    region's own inputs); ``grad``: only those a gradient reaches (True: what offloaded checkpoints
    move to the host) or only the others (False)."""
    out: dict[int, float] = {}
    for (src, index, *r), (meta, first) in checkpointed(graph, regions, region_of, saving, per_region=per_region,
                                                         grad=grad).items():
        where = r[0] if per_region else first
        out[where] = out.get(where, 0.0) + cost_model.held_bytes(meta, strategy(src).outputs[index])
    return out


def checkpointed(graph, regions, region_of: dict, saving: set, *, per_region: bool = False,
                 grad: bool | None = None) -> dict[tuple, tuple]:
    """The outputs :func:`checkpoint_bytes` counts: ``(producer, output[, region]) -> (its tensor,
    the first node of the first region reading it)``."""
    inputs: dict[tuple, tuple] = {}
    for e in edges_into(graph, region_of):
        r = region_of[e.dst]
        if (r not in saving or region_of.get(e.src) == r or graph.nodes[e.src].kind != "op"
                or grad not in (None, graph.nodes[e.src].requires_grad)):
            continue
        key = (e.src, e.out_index) + ((r,) if per_region else ())
        held = inputs.get(key)
        if held is None or regions[r][0] < held[1]:
            inputs[key] = (e.meta, regions[r][0])
    return inputs


def _regathered(regions, gathered: dict, again: dict, start: dict) -> None:
    """Move the sharded parameters gathered for the recomputed nodes of ``regions`` (ZeRO-3) from
    their own backward (``gathered``) into the recomputation: the region's forward run again
    gathers them all and its ops save them, so they are made with its other saved tensors
    (``start``) and each is freed after its node's backward (``again``)."""
    for members in regions:
        trigger = max((i for i in members if i in start), default=None)
        held = [i for i in members if gathered.get(i) and (trigger is None or i <= trigger)]
        if not held:
            continue
        trigger = max(held) if trigger is None else trigger
        start[trigger] = start.get(trigger, 0.0) + sum(gathered[i] for i in held)
        for i in held:
            again[i] = again.get(i, 0.0) + gathered.pop(i)


def step_walk(graph, choice, captured, cost_model, param_memory: dict, *, recompute: bool | str = False,
              offload: bool = False, copies=frozenset(), fetched: dict | None = None,
              offload_checkpoints: bool = False, memo: dict | None = None,
              step: bool = True) -> tuple[MemoryBreakdown, Walk]:
    """The peak of the step (module docstring) of the cost graph ``graph`` under ``choice``, and
    its backward's :class:`Walk`
    (``param_memory``: parameter FQN -> its (parameter, gradient, optimizer) bytes per device;
    the model's buffers and constants count as parameters, as ``verify`` measures them;
    ``recompute``: its repeated layers recompute their forward in backward; ``offload``: the
    optimizer steps on the host, its scratch is there; ``copies``: the parameters whose optimizer
    steps a copy of their elements, ZeRO's shards, as under mixed precision every one's; ``fetched``:
    node -> parameter bytes fetched from the host while its backward runs, :mod:`autopar.planner.fetched`;
    ``offload_checkpoints``: the recomputed regions' checkpoints wait on the host; ``memo``: a
    dict kept with ``choice``, for walks of it under other parameter bytes, :func:`backward_walk`;
    ``step``: False, the backward's peak alone, leaving out the optimizer step's)."""
    params, optimizer = (sum(m[k] for m in param_memory.values()) for k in (0, 2))
    returned = {o.node for o in captured.outputs if o.kind == "user_output"}
    inputs = held = 0.0
    for node, c in zip(graph.nodes, choice):
        if node.kind == "user_input":
            inputs += float(node.memory[c])
        elif node.kind == "buffer":  # buffers and constants are model state beside the parameters
            params += float(node.memory[c])
        elif node.kind == "op" and node.name in returned:
            held += sum(cost_model.held_bytes(m, s) for m, s in zip(node.spec.outputs, node.strategies[c].outputs))
    regions = recomputed_regions(graph, captured, selective=recompute == "selective")[0] if recompute else []
    walk = backward_walk(graph, choice, captured.graph_module.graph, cost_model, range(len(graph.nodes)),
                         lambda i: param_memory[graph.nodes[i].target][1], regions=regions,
                         fetched=fetched, offloaded=offload_checkpoints, memo=memo)
    remaining, made, running = walk.peak
    backward = MemoryBreakdown(parameters=params, gradients=made, optimizer=optimizer,
                               activations=inputs + held + remaining, temporaries=running - walk.communication,
                               communication=walk.communication)
    if not step:
        return backward, walk
    stepped = MemoryBreakdown(parameters=params, activations=inputs + held, optimizer=optimizer,
                              **_stepped(param_memory, cost_model, offload, copies))
    return max(backward, stepped, key=lambda m: m.total), walk


def _stepped(param_memory: dict, cost_model, offload: bool, copies) -> dict:
    """The gradients and the foreach step's scratch on the device at the optimizer step (the
    arguments as :func:`step_walk` takes them): a copy the optimizer steps (an fp32 master, a ZeRO
    shard) holds ``1 + moments`` of the optimizer bytes, its gradient and the scratch one each; a
    parameter stepped itself has its own gradient and scratch; offloaded, the step's are the host's."""
    moments = MOMENTS[cost_model.options.optimizer]
    share = stepped_copy_share(cost_model.options.optimizer)
    grads = scratch = 0.0
    for fqn, (p, g, o) in param_memory.items():
        if not g and not o:
            continue  # frozen: not stepped
        if offload:
            grads += g  # each moved to the host in turn
        elif cost_model.precision.master or fqn in copies:
            grads += o * share
            scratch += o * share if moments else 0.0
        else:
            grads += g
            scratch += p if moments else 0.0
    return {"gradients": grads, "temporaries": scratch}


def _pending_gradients(graph, strategy, cost_model, inside: set) -> dict[int, float]:
    """Node -> bytes of the gradients waiting while its backward runs: a value's gradient is made
    by its last consumer's backward and held until its producer's has run (both in ``inside``)."""
    last: dict[tuple, list] = {}  # (producer, output) -> [its tensor, its last consumer taking a gradient]
    for e in edges_into(graph, inside):
        if e.src in inside and graph.nodes[e.dst].requires_grad and e.grad:
            value = last.setdefault((e.src, e.out_index), [e.meta, e.dst])
            value[1] = max(value[1], e.dst)
    change: dict[int, float] = {}
    for (src, out), (meta, dst) in last.items():
        if dst > src + 1:
            nbytes = cost_model.held_bytes(meta, strategy(src).outputs[out])
            change[src + 1] = change.get(src + 1, 0.0) + nbytes
            change[dst] = change.get(dst, 0.0) - nbytes
    return _running(change, sorted(inside))


def _backward_collectives(graph, choice, strategy, cost_model, inside: set) -> dict[int, tuple[float, float]]:
    """Node in ``inside`` -> (bytes of a gradient and its resharded copy, bytes of the
    collective's own buffers, :data:`~autopar.core.collective_kinds.BUFFERS`) of the largest
    collective that takes one of its inputs' gradients back to the producer's sharding after its
    backward. Kept per (edge costs, strategy indices) in the graph's memo: edges of repeated layers
    share their cost matrix, which stands for their tensor, strategy lists and indices."""
    out: dict[int, tuple[float, float]] = {}
    known = graph.memo.setdefault("backward reshard", {})
    for e in edges_into(graph, inside):
        if graph.nodes[e.src].kind != "op" or not e.grad:
            continue
        key = (id(e.cost), choice[e.src], choice[e.dst])
        held = known.get(key, False)
        if held is False:
            t = strategy(e.dst)
            held = known[key] = cost_model.backward_reshard(e.meta, strategy(e.src).outputs[e.out_index],
                                                            t.inputs[e.in_index], t)
        if held is None:
            continue
        grad, buffers = held
        if sum(out.get(e.dst, (0.0, 0.0))) < grad + buffers:
            out[e.dst] = (grad, buffers)
    return out


def _parameter_uses(graph, strategy, cost_model, inside: set) -> tuple[dict, dict, dict]:
    """(parameter node -> its last consumer, node in ``inside`` -> bytes of the sharded parameters
    gathered for it, node in ``inside`` -> bytes of whole gradients summed while its backward
    runs). A parameter gathered once for several consumers (a tied embedding and output
    projection) sums their gradients at the gathered size, from its last consumer's backward to
    its first's, before it is reduced."""
    last_use = graph.memo.get("parameters' last consumers")
    if last_use is None:
        last_use = graph.memo["parameters' last consumers"] = {}
        for e in graph.edges:
            if graph.nodes[e.src].kind == "parameter":
                last_use[e.src] = max(last_use.get(e.src, -1), e.dst)
    gathered: dict[int, float] = {}
    uses: dict[tuple, list] = {}  # (parameter, sharding used) -> [bytes, first consumer, last consumer]
    for e in edges_into(graph, inside):
        if graph.nodes[e.src].kind != "parameter":
            continue
        stored, used = tuple(strategy(e.src).outputs[0]), tuple(strategy(e.dst).inputs[e.in_index])
        if stored != used:
            nbytes = cost_model.held_bytes(e.meta, used)
            gathered[e.dst] = gathered.get(e.dst, 0.0) + nbytes
            if not graph.nodes[e.src].requires_grad:
                continue  # frozen: no gradient to sum
            use = uses.setdefault((e.src, used), [nbytes, e.dst, e.dst])
            use[1], use[2] = min(use[1], e.dst), max(use[2], e.dst)
    change: dict[int, float] = {}  # the running sum steps up at a first consumer, down at the last
    for nbytes, first, last in uses.values():
        if first < last:
            change[first] = change.get(first, 0.0) + nbytes
            change[last] = change.get(last, 0.0) - nbytes
    return last_use, gathered, _running(change, sorted(inside))


def _running(change: dict[int, float], nodes) -> dict[int, float]:
    """Node of ``nodes`` (ascending) -> the running sum of ``change`` (node -> step) up to it,
    where it is not zero."""
    out: dict[int, float] = {}
    if change:
        steps, running, k = sorted(change), 0.0, 0
        for i in nodes:
            while k < len(steps) and steps[k] <= i:
                running += change[steps[k]]
                k += 1
            if running:
                out[i] = running
            elif k == len(steps):
                break
    return out


def edges_into(graph, nodes):
    """The edges of ``graph`` into ``nodes`` (node indices), by consumer: kept in the graph's memo."""
    by_consumer = graph.memo.get("edges by consumer")
    if by_consumer is None:
        by_consumer = graph.memo["edges by consumer"] = {}
        for e in graph.edges:
            by_consumer.setdefault(e.dst, []).append(e)
    return [e for i in nodes for e in by_consumer.get(i, ())]


def recomputing_graph(graph, captured, cost_model, *, selective: bool = False, offloaded: bool = False):
    """``graph`` with the saved bytes of the nodes in recomputed regions (``selective``: the
    selective ones) taken out and what the regions' checkpoints keep instead (their inputs made
    outside them; ``offloaded``: only those no gradient reaches, the others wait on the host)
    charged to the nodes that make them, at each strategy's output sharding: the sum the ILP
    bounds for a recomputing plan (the step peak's excess over it the re-solve bounds)."""
    regions, region_of, saving = recomputed_regions(graph, captured, selective=selective)
    memory = {i: np.zeros_like(graph.nodes[i].memory) for i in region_of if graph.nodes[i].kind == "op"}
    for (src, index), (meta, _) in checkpointed(graph, regions, region_of, saving,
                                                grad=False if offloaded else None).items():
        node = graph.nodes[src]
        kept = np.array([cost_model.held_bytes(meta, s.outputs[index]) for s in node.strategies])
        memory[src] = memory.get(src, node.memory) + kept
    nodes = [n.with_memory(memory[i]) if i in memory else n for i, n in enumerate(graph.nodes)]
    return with_memory(graph, nodes)


def recomputed_regions(graph, captured, *, selective: bool = False) -> tuple[list, dict, set]:
    """(the recomputed regions as cost-graph node indices, node -> its region, the regions that
    save something: only their checkpoints are kept)."""
    fx_nodes = list(captured.graph_module.graph.nodes)
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    saves = {n.name for n in fx_nodes if n.meta.get("autopar_saved")}
    regions = [r for r in ([index[n.name] for n in region if n.name in index]
                           for region in cut_regions(fx_nodes, selective=selective)) if r]
    region_of = {i: r for r, members in enumerate(regions) for i in members}
    saving = {r for r, members in enumerate(regions) if any(graph.nodes[i].name in saves for i in members)}
    return regions, region_of, saving


__all__ = ["Walk", "backward_walk", "checkpoint_bytes", "checkpointed", "recomputed_regions", "recomputing_graph",
           "step_walk"]
