"""Exact per-part costs of a window's candidate plans at one ``(tp, b)``: the totals stage costs
are sums of (:mod:`autopar.planner.stage_table`).

:func:`evaluate` builds the window's cost graph in micro-batch mode
(:func:`autopar.planner.costgraph.build_cost_graph`, mesh ``(pieces, tp)`` with ``b`` samples per
replica) holding only the candidates' strategies, and sums each candidate's forward, backward and
per-step seconds, activations, recomputation checkpoints, parameters and FLOPs per window part
(:class:`PartCosts`), what a recomputing stage runs again per part (what torch's checkpoint
reruns: :func:`autopar.core.recompute.rerun`) and keeps, whole layers or selectively
(:class:`Rerun`), with each part's backward walk
(:func:`autopar.planner.peak.backward_walk`),
its parameters' gradient bytes and the bytes of the values that cross a stage boundary after it,
from which :mod:`autopar.planner.stage_peak` composes a stage's peak memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autopar.core.ir import Strategy
from autopar.core.placement import Replicate, local_shape
from autopar.core.recompute import regions, rerun
from autopar.plan.records import saved_inputs
from autopar.planner.candidates import Candidate
from autopar.planner.costgraph import CostGraph, build_cost_graph
from autopar.planner.graph_walk import value_meta
from autopar.planner.layers import FIRST, LAYER
from autopar.planner.microbatch import MicroBatchCostModel, WindowInfo
from autopar.planner.peak import Walk, backward_walk

R = Replicate()


@dataclass
class Rerun:
    """What one recomputation policy (True: whole layers; ``"selective"``: the cheap runs between
    their matmuls) does per window part: the forward it runs again in backward (compute and
    collectives, and compute alone), the bytes a micro-batch keeps through the forward, and the
    part's backward walk under it."""

    again: np.ndarray
    again_compute: np.ndarray
    held: np.ndarray
    walks: list[Walk]


@dataclass
class PartCosts:
    """Totals per window part for one candidate at one ``(tp, b)``; arrays are indexed like
    ``parts``. Seconds are per micro-batch on one replica unless named ``step``."""

    parts: tuple[str, ...]
    fwd: np.ndarray  # forward compute + forward collectives
    bwd: np.ndarray  # backward compute + backward collectives
    compute: np.ndarray  # forward + backward compute
    step: np.ndarray  # per-step collectives on the tp axis (parameter gradients)
    activations: np.ndarray  # bytes kept for backward per micro-batch
    params: list[list[tuple[str, float, int, bool]]]  # per part: (parameter, local numel, itemsize, trained)
    flops: np.ndarray  # useful FLOPs at the full batch (forward + backward)
    boundary: float  # bytes per replica of the layer output sent to the next stage, per micro-batch
    walks: list[Walk] = field(default_factory=list)  # per part: its backward walk at one micro-batch
    reruns: dict = field(default_factory=dict)  # recomputation policy (True, "selective") -> Rerun
    grads: np.ndarray | None = None  # per part: gradient bytes of the parameters whose gradients it makes
    crossing: np.ndarray | None = None  # per part: bytes of the values made up to it and read after (_crossing_bytes)
    sent: np.ndarray | None = None  # per part: what a stage ending there holds because it sent it (_sent)
    buffers: np.ndarray | None = None  # per part: bytes of the model's buffers and constants it holds
    choice: dict[str, Strategy] = field(default_factory=dict)
    node_costs: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (compute, comm)


def evaluate(info: WindowInfo, tp_cluster, options, chosen: list[Candidate], *, b: int, precision=None,
             captured_dtype=None) -> list[PartCosts | None]:
    """Exact per-part costs of each candidate with ``b`` samples per replica (one cost graph
    holding all their strategies); ``None`` for a candidate one of whose strategies does not
    divide evenly at that size."""
    if info.batch % b or (not info.splittable and b != info.batch):
        return [None] * len(chosen)
    cm = MicroBatchCostModel(tp_cluster, options, pieces=info.batch // b, precision=precision,
                             captured_dtype=captured_dtype)
    picks = [c.strategy_of() for c in chosen]
    allowed: dict[str, set] = {}
    for pick in picks:
        for k, v in pick.items():
            allowed.setdefault(k, set()).add(v)
    g = build_cost_graph(info.planned(), cm, microbatch=info, allowed=allowed)
    boundary = _boundary_bytes(info, g, cm)
    crossing = _crossing_bytes(info, g, cm)
    run_again = {policy: _run_again(info.window.graph, selective=policy == "selective") for policy in POLICIES}
    metas = {x.name: value_meta(x) for x in info.window.graph.nodes if x.op == "placeholder"}
    out = []
    for pick in picks:
        sel = []
        for node in g.nodes:
            want = pick.get(node.name)
            sel.append(node.strategies.index(want) if want in node.strategies else -1)
        out.append(None if min(sel, default=0) < 0 else _totals(info, g, cm, sel, boundary, metas, crossing, run_again))
    return out


def _output_bytes(info: WindowInfo, cm, node, strategy) -> float:
    """Local bytes of an op node's first output under ``strategy`` (what recomputation keeps)."""
    out0 = node.spec.outputs[0]
    return float(cm.local_numel(out0, info.extend(node.name, strategy).outputs[0]) * cm.itemsize(out0.dtype))


POLICIES = (True, "selective")  # the recomputations a stage may run


def _run_again(graph, *, selective: bool = False) -> tuple[set[str], set[str], list]:
    """(nodes a recomputation reaches, nodes whose kernels it runs again, its regions) of a
    window's graph (``selective``: the runs between a layer's matmuls)."""
    reached, kernels = set(), set()
    cut = regions(list(graph.nodes), selective=selective)
    for region in cut:
        r, k = rerun(region)
        reached.update(n.name for n in r)
        kernels.update(n.name for n in k)
    return reached, kernels, cut


def _totals(info, g: CostGraph, cm, sel: list[int], boundary: float, metas, crossing, run_again) -> PartCosts:
    crossing, made_here = crossing
    parts = info.window.parts
    part_of = [info.window.part.get(node.name) for node in g.nodes]
    pos = {p: k for k, p in enumerate(parts)}
    n = len(parts)
    fwd, bwd, step, comp = (np.zeros(n) for _ in range(4))
    again = {policy: (np.zeros(n), np.zeros(n)) for policy in POLICIES}  # (with collectives, compute)
    act, ckpt, flops = np.zeros(n), np.zeros(n), np.zeros(n)
    params: list[list] = [[] for _ in parts]
    node_costs = {}
    consumers: dict[int, set] = {}
    for i, (node, part) in enumerate(zip(g.nodes, part_of)):
        if node.kind == "op" and part in pos:
            k, c = pos[part], sel[i]
            fwd[k] += node.forward[c]
            for policy, (_, kernels, _) in run_again.items():
                if node.name in kernels:
                    again[policy][0][k] += node.forward[c]
                    again[policy][1][k] += node.forward[c]
            comp[k] += node.compute[c]
            bwd[k] += node.compute[c] - node.forward[c]
            if node.requires_grad:
                act[k] += node.memory[c]
            flops[k] += node.flops
            node_costs[node.name] = [float(node.compute[c]), 0.0]
    for i, extra in g.unary.items():
        if part_of[i] in pos:
            bwd[pos[part_of[i]]] += float(extra[sel[i]])
    seen = set()
    for e in g.edges:
        f, b, st = e.phases
        part = part_of[e.dst]
        if part not in pos:
            continue
        k, a, c = pos[part], sel[e.src], sel[e.dst]
        fwd[k] += f[a, c]
        for policy, (reached, _, _) in run_again.items():
            again[policy][0][k] += f[a, c] if g.nodes[e.dst].name in reached else 0.0
        bwd[k] += b[a, c]
        step[k] += st[a, c]
        src = g.nodes[e.src]
        if g.nodes[e.dst].name in node_costs:
            node_costs[g.nodes[e.dst].name][1] += float(f[a, c] + b[a, c] + st[a, c])
        if src.kind in ("parameter", "buffer"):
            consumers.setdefault(e.src, set()).add(k)
        elif (e.src, k) in seen:
            continue
        elif src.kind == "op" and part_of[e.src] != part and src.requires_grad:
            seen.add((e.src, k))
            ckpt[k] += _output_bytes(info, cm, src, src.strategies[a])
        elif src.kind == "user_input":
            seen.add((e.src, k))
            act[k] += src.memory[a]
    grad_bytes: dict[int, float] = {}
    buffers = np.zeros(n)
    for i, ks in consumers.items():
        node = g.nodes[i]
        own = part_of[i]
        if node.kind == "buffer":  # held whole by every stage that reads it, as the program stores it
            for k in ({pos[own]} if own in pos else ks):
                buffers[k] += float(node.memory[sel[i]])
            continue
        meta = metas[node.name]
        numel = float(cm.local_numel(meta, (R,) + tuple(node.strategies[sel[i]].outputs[0])))
        grad_bytes[i] = numel * cm.state_bytes[1] if node.requires_grad else 0.0
        for k in ({pos[own]} if own in pos else ks):
            params[k].append((node.target, numel, meta.dtype.itemsize, node.requires_grad))
    members = [[i for i, p in enumerate(part_of) if p == part] for part in parts]
    memos = [{} for _ in members]  # a part's three walks share what does not depend on recomputation

    def walks_of(**kw):
        return [backward_walk(g, sel, info.window.graph, cm, m, grad_bytes.__getitem__, info.extend, memo=memo, **kw)
                for m, memo in zip(members, memos)]

    walks = walks_of()
    # whole layers: each part keeps its inputs from other parts, and its backward finds every saved
    # tensor made again; selective: the walk drops what each cut run of the part saves and keeps
    # the run's inputs
    index = {node.name: i for i, node in enumerate(g.nodes)}
    cut = [[index[x.name] for x in region if x.name in index] for region in run_again["selective"][2]]
    selective = [backward_walk(g, sel, info.window.graph, cm, m, grad_bytes.__getitem__, info.extend, memo=memo,
                               regions=[r for r in cut if r and set(r) <= set(m)]) for m, memo in zip(members, memos)]
    dropped = np.array([w.saved - v.saved for w, v in zip(walks, selective)])
    reruns = {True: Rerun(*again[True], ckpt, walks_of(rerun=run_again[True][0])),
              "selective": Rerun(*again["selective"], act - dropped, selective)}
    made = np.array([w.made for w in walks])
    return PartCosts(parts, fwd, bwd, comp, step, act, params, flops, boundary, walks, reruns, made, crossing,
                     _sent(made_here, g, sel, n), buffers, {node.name: node.strategies[c] for node, c in zip(g.nodes, sel)},
                     {k: (v[0], v[1]) for k, v in node_costs.items()})


def _boundary_bytes(info: WindowInfo, g: CostGraph, cm) -> float:
    """Bytes per replica of what the ``first`` part hands to the ``layer`` part (one layer's
    output, the activation a pipeline stage sends to the next), at one micro-batch."""
    part = info.window.part
    fx = {x.name: x for x in info.window.graph.nodes}
    total, seen = 0.0, set()
    for e in g.edges:
        src = g.nodes[e.src]
        if src.kind not in ("op", "user_input"):  # a parameter tied across layers (Zamba2's shared block) is not sent
            continue
        if part.get(g.nodes[e.dst].name) == LAYER and part.get(src.name) == FIRST and e.src not in seen:
            seen.add(e.src)
            total += _sent_bytes(info, fx, src, e.out_index, cm)[0]
    return total


def _sent_bytes(info: WindowInfo, fx: dict, node, index: int, cm) -> tuple[float, bool]:
    """Bytes per replica, at one micro-batch, of ``node``'s output ``index`` (an op's, from its
    spec; a user input's, from the window graph), and whether it is as long as the batch without
    being split by it (an attention mask: made at the whole micro-batch on every replica)."""
    meta = info.specs[node.name].outputs[index] if node.kind == "op" else value_meta(fx[node.name])
    mb = info.mb_out[node.name][index]
    nbytes = math.prod(local_shape(meta.shape, (mb,), (cm.mesh_shape[0],))) * cm.itemsize(meta.dtype)
    return nbytes, mb == R and len(meta.shape) > 0 and meta.shape[0] == info.batch  # a 0-dim value: False


def _crossing_bytes(info: WindowInfo, g: CostGraph, cm) -> tuple[np.ndarray, list]:
    """Per window part ``(n, 2)``: bytes, at one micro-batch, of the values made in it or an
    earlier part and read by a later one (what a stage ending there sends to the next): per
    replica, and per data-parallel replica of the micro-batch (a value not split by the batch
    but as long as it, an attention mask, is made at the whole micro-batch on every replica).
    And those an op made in the part itself: ``(node, output, part, (bytes, column), kept)``
    (``kept``: an op of the part keeps it), for :func:`_sent`."""
    order = {p: k for k, p in enumerate(info.window.parts)}
    part_of = [order.get(info.window.part.get(node.name), -1) for node in g.nodes]
    fx = {x.name: x for x in info.window.graph.nodes}
    last_read: dict[tuple[int, int], int] = {}
    kept: set[tuple[int, int]] = set()
    for e in g.edges:
        if g.nodes[e.src].kind in ("op", "user_input") and part_of[e.dst] >= 0:
            key = (e.src, e.out_index)
            last_read[key] = max(last_read.get(key, -1), part_of[e.dst])
            if part_of[e.dst] == part_of[e.src] and e.in_index in saved_inputs(fx[g.nodes[e.dst].name]):
                kept.add(key)
    out, made_here = np.zeros((len(order), 2)), []
    pieces = cm.mesh_shape[0]
    for (src, index), reader in last_read.items():
        node, made = g.nodes[src], max(part_of[src], 0)
        if reader <= made:
            continue
        nbytes, whole_batch = _sent_bytes(info, fx, node, index, cm)
        nbytes = nbytes / pieces if whole_batch else nbytes
        out[made:reader, int(whole_batch)] += nbytes
        if node.kind == "op" and part_of[src] >= 0:
            made_here.append((src, index, made, (nbytes, int(whole_batch)), (src, index) in kept))
    return out, made_here


def _sent(made_here: list, g: CostGraph, sel: list[int], parts: int) -> np.ndarray:
    """Per part ``(n, 2)``, as ``crossing``: bytes of the values an op of the part made that a
    stage ending there holds only because it sent them, until their backward (autograd starts
    from them): those no op of the part keeps, and those split over the stage's tensor-parallel
    ranks, which it gathers whole to send (a copy no op keeps)."""
    out = np.zeros((parts, 2))
    for src, index, part, (nbytes, column), kept in made_here:
        split = any(not isinstance(p, Replicate) for p in g.nodes[src].strategies[sel[src]].outputs[index])
        if split or not kept:
            out[part, column] += nbytes
    return out


__all__ = ["POLICIES", "PartCosts", "Rerun", "evaluate"]
