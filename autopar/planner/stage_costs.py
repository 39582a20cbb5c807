"""Per-micro-batch costs of a window graph on a tensor-parallel group, and its ILP candidates.

A stage of the pipeline runs on a logical mesh ``(dp, tp)``: ``dp`` replicas each take
``b = batch / (B · dp)`` samples of every micro-batch, and inside a replica the intra-op ILP
chooses every node's strategy on the ``tp`` axis. The captured graph is at the full batch; the
micro-batch and data-parallel split is a virtual mesh axis of ``pieces = batch / b`` in front of
the ``tp`` axis (:class:`MicroBatchCostModel`): every tensor carries a fixed placement on it,
found once by :func:`microbatch_placements` (``Shard(d)`` where it holds the batch on dim ``d``,
``Replicate`` where it does not, ``Partial`` for per-sample sums such as the loss). Costing a
strategy extended by that placement on the mesh ``(pieces, tp)`` with the ordinary cost model
gives its time and memory for one micro-batch on one replica; collectives on the virtual axis
are free (they are gradient accumulation and the global loss sum).

Collectives split into per micro-batch forward, per micro-batch backward, and per step: the
backward all-reduce of a parameter's gradient runs once per step on the accumulated gradient.
Constants (nodes reading no input and no parameter, such as attention masks) are computed once
outside the step and cost nothing per micro-batch.

:func:`candidates` solves the window's ILP (layers tied, the layer weighted as all ``L − 1``
repeated layers) for the fastest plan, the fastest Megatron-style plan (no split of dim 0 on
the ``tp`` axis) and the plan of least memory; :func:`evaluate` costs any of them exactly at any
``(tp, b)`` and returns per-part totals (:class:`PartCosts`) that stage costs are sums of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from autopar.core.errors import InfeasibleError
from autopar.core.ir import Strategy, TensorMeta
from autopar.core.placement import Partial, Replicate, Shard, fits, local_shape
from autopar.cost_models.compute import compute_time, node_flops
from autopar.passes.rules.registry import axis_options, strategies
from autopar.planner.costgraph import (
    CostEdge,
    CostGraph,
    CostNode,
    GraphWalk,
    leaf_dependency,
    op_call,
    storage_shardings,
)
from autopar.planner.costs import CostModel
from autopar.planner.intra import restrict, solve_graph
from autopar.planner.layers import LAYER, Window

R = Replicate()


# ----------------------------------------------------------------------------- micro-batch axis


@dataclass
class WindowInfo:
    """Per window node: op spec, tensor inputs, micro-batch placements (computed once)."""

    window: Window
    batch: int
    specs: dict[str, object]
    tensor_inputs: dict[str, list[tuple[str, int]]]  # node -> [(producer node, output index)]
    mb_in: dict[str, tuple]  # node -> placement per tensor input
    mb_out: dict[str, tuple]  # node -> placement per output (placeholders: one)
    kind: dict[str, str]  # placeholder -> kind
    deps: dict[str, set]
    splittable: bool
    strategy_cache: dict = field(default_factory=dict)
    inputs: dict[str, list] = field(default_factory=dict)  # node -> its tensor inputs' metas
    mb_local: dict[str, str] = field(default_factory=dict)  # node -> local op its batch split needs
    flops: dict[str, float] = field(default_factory=dict)  # node -> forward + backward FLOPs


def _val_meta(node) -> TensorMeta | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in val.shape), val.dtype)
    return None


def batch_size(window: Window) -> int:
    """Dim 0 of the first user input with one: the batch the graph was captured at."""
    for name, inp in window.inputs.items():
        if inp.kind == "user_input":
            meta = _val_meta(next(n for n in window.graph.nodes if n.name == name))
            if meta is not None and meta.ndim >= 1:
                return meta.shape[0]
    return 1


def microbatch_placements(window: Window) -> WindowInfo:
    """Where every tensor of the window holds the batch (module docstring)."""
    batch = batch_size(window)
    info = WindowInfo(window, batch, {}, {}, {}, {}, {}, {}, True)
    walk = GraphWalk(window.graph, depends=info.deps)
    for node in walk.nodes():
        if node.op == "placeholder":
            inp = window.inputs.get(node.name)
            meta = _val_meta(node)
            if inp is None or meta is None:
                continue
            info.kind[node.name] = inp.kind
            batched = inp.kind == "user_input" and meta.ndim >= 1 and meta.shape[0] == batch and batch > 1
            info.mb_out[node.name] = (Shard(0) if batched else R,)
            walk.accept(node, leaf_dependency(inp.kind))
            continue
        if node.meta.get("val") is None:
            continue
        spec, _, in_nodes = op_call(node)
        if not spec.outputs:
            continue
        tensors = [a for a in in_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(tensors) != len(spec.inputs) or any(a.name not in walk.producer for a in tensors):
            continue
        info.specs[node.name] = spec
        info.inputs[node.name] = list(spec.inputs)
        info.flops[node.name] = float(sum(node_flops(spec)))
        info.tensor_inputs[node.name] = [walk.producer[a.name] for a in tensors]
        walk.accept(node, walk.dependencies(in_nodes))
        arriving = [info.mb_out[p][k] for p, k in info.tensor_inputs[node.name]]
        option = _matching_option(spec, arriving)
        if option is None:
            info.splittable = False
            option = ((R,) * len(spec.inputs), (R,) * len(spec.outputs), None)
        info.mb_in[node.name], info.mb_out[node.name], local = option
        if local is not None:
            info.mb_local[node.name] = local
    if not info.splittable:  # some op cannot take a batch split: no micro-batches, no dp
        for name in info.mb_out:
            info.mb_out[name] = (R,) * len(info.mb_out[name])
        for name in info.mb_in:
            info.mb_in[name] = (R,) * len(info.mb_in[name])
    return info


def _matching_option(spec, arriving) -> tuple | None:
    """The rule's one-axis option that keeps the batch where it arrives: a ``Shard`` input must
    be taken as is (an integer one, such as position ids, may be gathered), a ``Replicate`` one
    may be sliced, a ``Partial`` one taken as is or summed."""
    if all(isinstance(p, Replicate) for p in arriving):
        return (R,) * len(spec.inputs), (R,) * len(spec.outputs), None
    best, best_key = None, None
    for opt in axis_options(spec, warn=False):
        ok, exact, gathers = True, 0, 0
        for meta, have, want in zip(spec.inputs, arriving, opt.inputs):
            if have == want:
                exact += 1
            elif isinstance(have, Shard) and isinstance(want, Replicate) and not meta.dtype.is_floating_point:
                gathers += 1
            elif isinstance(have, Shard) or isinstance(want, Partial) or (
                    isinstance(have, Partial) and not isinstance(want, Replicate)):
                ok = False
                break
        if not ok:
            continue
        key = (-gathers, sum(isinstance(o, Shard) for o in opt.outputs), exact,
               -sum(isinstance(o, Partial) for o in opt.outputs))
        if best_key is None or key > best_key:
            best, best_key = (tuple(opt.inputs), tuple(opt.outputs), opt.local), key
    if best is not None and not any(isinstance(o, (Shard, Partial)) for o in best[1]):
        return None  # the batch would be gathered: not a per-sample op
    return best


# ----------------------------------------------------------------------------- cost model


class MicroBatchCostModel(CostModel):
    """The cost model on mesh ``(pieces, *tp_mesh)``: axis 0 is the virtual micro-batch axis."""

    def __init__(self, tp_cluster, options, *, pieces: int, step_weight: float = 1.0):
        super().__init__(tp_cluster, options)
        self.mesh_shape = (int(pieces),) + tuple(tp_cluster.mesh_shape)
        self.step_weight = float(step_weight)
        self._split: dict = {}

    def split(self, meta, src, dst, consumer, *, grad: bool, regather: bool) -> tuple[float, float, float]:
        """(forward, backward, per-step) seconds of turning ``src`` into ``dst``."""
        flags = None if consumer is None else tuple(consumer.replicated_on(a) for a in range(len(self.mesh_shape)))
        key = (meta, src, dst, flags, grad, regather)
        hit = self._split.get(key)
        if hit is not None:
            return hit
        fwd = bwd = step = 0.0
        for phase, kind, axis, nbytes in self.collectives(meta, src, dst, consumer, grad=grad, regather=regather):
            axes = tuple(a - 1 for a in ((axis,) if isinstance(axis, int) else axis) if a != 0)
            if not axes:
                continue  # the micro-batch axis: accumulation, no communication
            t = self.cluster.collective_time(kind, nbytes, axes[0] if len(axes) == 1 else axes)
            if phase == "forward":
                fwd += t
            elif regather and kind == "all_reduce":
                step += t  # a parameter's gradient, reduced once per step
            else:
                bwd += t
        self._split[key] = (fwd, bwd, step)
        return fwd, bwd, step

    def reshard_time(self, meta, src, dst, *, grad, consumer=None, regather=False) -> float:
        fwd, bwd, step = self.split(meta, tuple(src), tuple(dst), consumer, grad=grad, regather=regather)
        return fwd + bwd + self.step_weight * step


def _extend(mb: tuple, strategy: Strategy, n_in: int) -> Strategy:
    return Strategy(tuple((mb[0][i],) + tuple(strategy.inputs[i]) for i in range(n_in)),
                    tuple((mb[1][k],) + tuple(strategy.outputs[k]) for k in range(len(strategy.outputs))),
                    strategy.local)


# ----------------------------------------------------------------------------- window cost graph


@dataclass
class WindowGraph:
    """A window's cost graph on ``(pieces, tp)`` plus what stage costing needs per node/edge."""

    graph: CostGraph  # strategies are the tp-axis (1-D) ones
    fwd: list[np.ndarray]  # forward seconds per strategy (compute)
    edge_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # (fwd, bwd, step) matrices
    out_bytes: list[np.ndarray]  # local bytes of output 0 per strategy (recompute checkpoints)
    part: list[str | None]
    pieces: int
    tp: int


def _tp_strategies(info: WindowInfo, name: str, tp_mesh):
    key = (name, tp_mesh)
    hit = info.strategy_cache.get(key)
    if hit is None:
        hit = info.strategy_cache[key] = strategies(info.specs[name], tp_mesh, warn=False)
    return hit


def build_window_graph(info: WindowInfo, cm: MicroBatchCostModel, *, allowed: dict | None = None
                       ) -> WindowGraph:
    """The window's cost graph at ``cm``'s mesh; ``allowed[node]`` limits a node's strategies."""
    mesh = cm.mesh_shape
    tp_mesh = mesh[1:]
    pieces = mesh[0]
    win = info.window
    nodes: list[CostNode] = []
    fwd_list, outb, parts = [], [], []
    index: dict[str, int] = {}
    edges: list[CostEdge] = []
    edge_parts = []
    flops = 0.0
    for node in win.graph.nodes:
        name = node.name
        if node.op == "placeholder":
            if name not in info.kind:
                continue
            meta = _val_meta(node)
            kind = info.kind[name]
            kind = kind if kind in ("parameter", "buffer", "user_input") else "buffer"
            allow = cm.options.shard_parameters if kind == "parameter" else kind == "user_input"
            mb = info.mb_out[name][0]
            strats = [Strategy((), (s,)) for s in storage_shardings(meta, tp_mesh, allow_shard=allow)
                      if fits(meta.shape, (mb,) + tuple(s), mesh)]
            if allowed is not None and name in allowed:
                strats = [s for s in strats if s in allowed[name]] or strats[:1]
            mem = np.array([cm.leaf_memory(meta, (mb,) + tuple(s.outputs[0]), kind) for s in strats])
            zeros = np.zeros(len(strats))
            index[name] = len(nodes)
            nodes.append(CostNode(name, kind, strats, zeros, zeros.copy(), mem,
                                  "parameters" if kind == "parameter" else "activations",
                                  layer=win.part.get(name) if win.part.get(name) in ("first", "layer") else None,
                                  op="placeholder", target=win.inputs[name].name,
                                  requires_grad=kind == "parameter" and meta.dtype.is_floating_point))
            fwd_list.append(zeros.copy())
            outb.append(np.array([cm.local_numel(meta, (mb,) + tuple(s.outputs[0])) * meta.dtype.itemsize
                                  for s in strats], dtype=float))
            parts.append(win.part.get(name))
            continue
        spec = info.specs.get(name)
        if spec is None:
            continue
        mb = (info.mb_in[name], info.mb_out[name])
        ins = info.inputs[name]
        n_in = len(ins)
        pairs = []
        for s in _tp_strategies(info, name, tp_mesh):
            if allowed is not None and name in allowed and s not in allowed[name]:
                continue
            ext = _extend(mb, s, n_in)
            if all(fits(t.shape, sh, mesh) for t, sh in zip(ins, ext.inputs)) and \
                    all(fits(t.shape, sh, mesh) for t, sh in zip(spec.outputs, ext.outputs)):
                pairs.append((s, ext))
        if not pairs:
            s = Strategy(tuple((R,) * len(tp_mesh) for _ in ins),
                         tuple((R,) * len(tp_mesh) for _ in spec.outputs))
            pairs = [(s, _extend(mb, s, n_in))]
        deps = info.deps.get(name, set())
        # Constants (no input, no parameter, e.g. masks) are computed once, outside the step.
        times = [compute_time(spec, ext, mesh, cm.device, dtype=cm.dtype) if deps else (0.0, 0.0)
                 for _, ext in pairs]
        compute = np.array([f + b for f, b in times])
        fwd = np.array([f for f, _ in times])
        flops += info.flops[name]
        requires_grad = "param" in deps and any(o.dtype.is_floating_point for o in spec.outputs)
        mem = (np.array([cm.activation_memory(spec, ext) for _, ext in pairs]) if requires_grad
               else np.zeros(len(pairs)))
        out0 = spec.outputs[0]
        item = 2 if (cm.dtype is not None and out0.dtype.is_floating_point) else out0.dtype.itemsize
        outb.append(np.array([cm.local_numel(out0, ext.outputs[0]) * item for _, ext in pairs], dtype=float))
        idx = len(nodes)
        index[name] = idx
        nodes.append(CostNode(name, "op", [s for s, _ in pairs], compute, np.zeros(len(pairs)), mem,
                              "activations", layer=win.part.get(name) if win.part.get(name) in ("first", "layer") else None,
                              op=str(node.target), requires_grad=requires_grad, fixed=not deps))
        fwd_list.append(fwd)
        parts.append(win.part.get(name))
        exts = [ext for _, ext in pairs]
        for in_index, (src_name, out_index) in enumerate(info.tensor_inputs[name]):
            if src_name not in index:
                continue
            src = index[src_name]
            src_node = nodes[src]
            in_meta = ins[in_index]
            grad = src_node.requires_grad and in_meta.dtype.is_floating_point
            regather = src_node.kind == "parameter"
            src_mb = info.mb_out[src_name][out_index] if src_node.kind == "op" else info.mb_out[src_name][0]
            shape = (len(src_node.strategies), len(exts))
            f, b, st = np.zeros(shape), np.zeros(shape), np.zeros(shape)
            for a, ss in enumerate(src_node.strategies):
                src_sh = (src_mb,) + tuple(ss.outputs[out_index])
                for c, ext in enumerate(exts):
                    f[a, c], b[a, c], st[a, c] = cm.split(in_meta, src_sh, tuple(ext.inputs[in_index]), ext,
                                                          grad=grad, regather=regather)
            edges.append(CostEdge(src, idx, out_index, in_index, in_meta, f + b + cm.step_weight * st))
            edge_parts.append((f, b, st))
    graph = CostGraph(nodes, edges, index, flops_per_step=flops)
    for loss in win.losses:  # the loss ends replicated on the tp axis
        if loss in index:
            i = index[loss]
            node = nodes[i]
            meta = info.specs[loss].outputs[0]
            graph.unary[i] = np.array([cm.reshard_time(meta, (info.mb_out[loss][0],) + tuple(s.outputs[0]),
                                                       (info.mb_out[loss][0],) + (R,) * len(tp_mesh), grad=False)
                                       for s in node.strategies])
    return WindowGraph(graph, fwd_list, edge_parts, outb, parts, pieces, math.prod(tp_mesh))


# ----------------------------------------------------------------------------- candidates


def weighted(wg: WindowGraph, weight: float) -> CostGraph:
    """The window's cost graph with the ``layer`` part (its nodes, parameters and the edges into
    them) counted ``weight`` times: the window then stands for a model of ``weight + 1`` layers."""
    g = wg.graph
    scale = np.array([weight if p == LAYER else 1.0 for p in wg.part])
    nodes = [CostNode(n.name, n.kind, n.strategies, n.compute * scale[i], n.communication * scale[i],
                      n.memory * scale[i], n.memory_kind, n.layer, n.op, n.target, n.requires_grad, n.fixed)
             for i, n in enumerate(g.nodes)]
    edges = [CostEdge(e.src, e.dst, e.out_index, e.in_index, e.meta, e.cost * scale[e.dst]) for e in g.edges]
    unary = {i: v * scale[i] for i, v in g.unary.items()}
    return CostGraph(nodes, edges, g.index, unary, g.flops_per_step)


@dataclass(frozen=True)
class Candidate:
    """One intra-op plan of the window on the tp axis: a strategy per node (by name)."""

    name: str
    tp: int
    choice: tuple[tuple[str, Strategy], ...]

    def strategy_of(self) -> dict[str, Strategy]:
        return dict(self.choice)


def _solve(graph: CostGraph, options, limit, method) -> np.ndarray:
    return solve_graph(graph, options, limit, method=method).choice


def candidates(wg: WindowGraph, options, *, layer_weight: float, megatron_allow=None
               ) -> tuple[list[Candidate], dict[str, int]]:
    """The fastest, the fastest Megatron-style and the least-memory plans of the window (equal
    plans once), and the index of each by name."""
    graph = weighted(wg, layer_weight)
    if wg.tp == 1:
        only = _candidate("replicated", wg.graph, np.zeros(len(graph.nodes), dtype=int), wg.tp)
        return [only], {"fastest": 0, "megatron": 0, "lean": 0}
    out: list[tuple[str, CostGraph, np.ndarray]] = []
    out.append(("fastest", graph, _solve(graph, options, None, "stage: fastest")))
    if megatron_allow is not None:
        mgraph = restrict(graph, megatron_allow)
        out.append(("megatron", mgraph, _solve(mgraph, options, None, "stage: megatron")))
    try:
        _solve(graph, options, 1.0, "stage: least memory")
    except InfeasibleError as exc:
        if exc.smallest_peak is not None and math.isfinite(exc.smallest_peak):
            try:
                out.append(("lean", graph, _solve(graph, options, exc.smallest_peak * (1 + 1e-6) + 1,
                                                  "stage: least memory")))
            except InfeasibleError:
                pass
    result: list[Candidate] = []
    names: dict[str, int] = {}
    for name, g, choice in out:
        cand = _candidate(name, g, choice, wg.tp)
        for k, other in enumerate(result):
            if other.choice == cand.choice:
                names[name] = k
                break
        else:
            names[name] = len(result)
            result.append(cand)
    return result, names


def _candidate(name, graph: CostGraph, choice, tp) -> Candidate:
    return Candidate(name, tp, tuple((n.name, n.strategies[int(c)]) for n, c in zip(graph.nodes, choice)))


# ----------------------------------------------------------------------------- evaluation


@dataclass
class PartCosts:
    """Totals per window part for one candidate at one ``(tp, b)``; arrays are indexed like
    ``parts``. Seconds are per micro-batch on one replica unless named ``step``."""

    parts: tuple[str, ...]
    fwd: np.ndarray  # forward compute + forward collectives
    bwd: np.ndarray  # backward compute + backward collectives
    fwd_compute: np.ndarray
    compute: np.ndarray  # forward + backward compute
    step: np.ndarray  # per-step collectives on the tp axis (parameter gradients)
    activations: np.ndarray  # bytes kept for backward per micro-batch
    checkpoint: np.ndarray  # bytes of the part's inputs from other parts (kept under recompute)
    params: list[list[tuple[str, float, int]]]  # per part: (parameter, local numel, itemsize)
    flops: np.ndarray  # useful FLOPs at the full batch (forward + backward)
    boundary: float  # bytes per replica of the layer output sent to the next stage, per micro-batch
    choice: dict[str, Strategy] = field(default_factory=dict)
    node_costs: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (compute, comm)


def evaluate(info: WindowInfo, tp_cluster, options, chosen: list[Candidate], *, b: int
             ) -> list[PartCosts | None]:
    """Exact per-part costs of each candidate with ``b`` samples per replica (one cost graph
    holding all their strategies); ``None`` for a candidate one of whose strategies does not
    divide evenly at that size."""
    if info.batch % b or (not info.splittable and b != info.batch):
        return [None] * len(chosen)
    cm = MicroBatchCostModel(tp_cluster, options, pieces=info.batch // b)
    picks = [c.strategy_of() for c in chosen]
    allowed: dict[str, set] = {}
    for pick in picks:
        for k, v in pick.items():
            allowed.setdefault(k, set()).add(v)
    wg = build_window_graph(info, cm, allowed=allowed)
    boundary = _boundary_bytes(info, wg, cm)
    metas = {x.name: _val_meta(x) for x in info.window.graph.nodes if x.op == "placeholder"}
    out = []
    for pick in picks:
        sel = []
        for node in wg.graph.nodes:
            want = pick.get(node.name)
            sel.append(node.strategies.index(want) if want in node.strategies else -1)
        out.append(None if min(sel, default=0) < 0 else _totals(info, wg, cm, sel, boundary, metas))
    return out


def _totals(info, wg: WindowGraph, cm, sel: list[int], boundary: float, metas) -> PartCosts:
    g = wg.graph
    parts = info.window.parts
    pos = {p: k for k, p in enumerate(parts)}
    n = len(parts)
    fwd, bwd, fcomp, step, comp = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    act, ckpt, flops = np.zeros(n), np.zeros(n), np.zeros(n)
    params: list[list] = [[] for _ in parts]
    node_costs = {}
    consumers: dict[int, set] = {}
    for i, (node, part, fw) in enumerate(zip(g.nodes, wg.part, wg.fwd)):
        if node.kind == "op" and part in pos:
            k, c = pos[part], sel[i]
            fwd[k] += fw[c]
            fcomp[k] += fw[c]
            comp[k] += node.compute[c]
            bwd[k] += node.compute[c] - fw[c]
            if node.requires_grad:
                act[k] += node.memory[c]
            flops[k] += info.flops[node.name]
            node_costs[node.name] = [float(node.compute[c]), 0.0]
    for i, extra in g.unary.items():
        if wg.part[i] in pos:
            bwd[pos[wg.part[i]]] += float(extra[sel[i]])
    seen = set()
    for e, (f, b, st) in zip(g.edges, wg.edge_parts):
        part = wg.part[e.dst]
        if part not in pos:
            continue
        k, a, c = pos[part], sel[e.src], sel[e.dst]
        fwd[k] += f[a, c]
        bwd[k] += b[a, c]
        step[k] += st[a, c]
        src = g.nodes[e.src]
        if g.nodes[e.dst].name in node_costs:
            node_costs[g.nodes[e.dst].name][1] += float(f[a, c] + b[a, c] + st[a, c])
        if src.kind == "parameter":
            consumers.setdefault(e.src, set()).add(k)
        elif (e.src, k) in seen:
            continue
        elif src.kind == "op" and wg.part[e.src] != part and src.requires_grad:
            seen.add((e.src, k))
            ckpt[k] += wg.out_bytes[e.src][a]
        elif src.kind == "user_input":
            seen.add((e.src, k))
            act[k] += src.memory[a]
    for i, ks in consumers.items():
        node = g.nodes[i]
        own = wg.part[i]
        meta = metas[node.name]
        numel = float(cm.local_numel(meta, (R,) + tuple(node.strategies[sel[i]].outputs[0])))
        for k in ({pos[own]} if own in pos else ks):
            params[k].append((node.target, numel, meta.dtype.itemsize))
    return PartCosts(parts, fwd, bwd, fcomp, comp, step, act, ckpt, params, flops, boundary,
                     {node.name: node.strategies[c] for node, c in zip(g.nodes, sel)},
                     {k: (v[0], v[1]) for k, v in node_costs.items()})


def _boundary_bytes(info: WindowInfo, wg: WindowGraph, cm) -> float:
    """Bytes per replica of what the ``first`` part hands to the ``layer`` part (one layer's
    output, the activation a pipeline stage sends to the next), at one micro-batch."""
    g = wg.graph
    total, seen = 0.0, set()
    for e in g.edges:
        if wg.part[e.dst] == LAYER and wg.part[e.src] == "first" and e.src not in seen:
            seen.add(e.src)
            src = g.nodes[e.src]
            meta = info.specs[src.name].outputs[e.out_index]
            mb = info.mb_out[src.name][e.out_index]
            item = 2 if (cm.dtype is not None and meta.dtype.is_floating_point) else meta.dtype.itemsize
            total += math.prod(local_shape(meta.shape, (mb,), (cm.mesh_shape[0],))) * item
    return total


__all__ = ["Candidate", "MicroBatchCostModel", "PartCosts", "WindowGraph", "WindowInfo", "batch_size",
           "build_window_graph", "candidates", "evaluate", "microbatch_placements", "weighted"]
