"""The micro-batch axis: where every tensor of a window holds the batch, and the cost model on
``(pieces, *tp)`` that prices one micro-batch on one replica.

A stage of the pipeline runs on a logical mesh ``(dp, tp)``: ``dp`` replicas each take
``b = batch / (B · dp)`` samples of every micro-batch, and inside a replica the intra-op ILP
chooses every node's strategy on the ``tp`` axis. The captured graph is at the full batch; the
micro-batch and data-parallel split is a virtual mesh axis of ``pieces = batch / b`` in front of
the ``tp`` axis (:class:`MicroBatchCostModel`): every tensor carries a fixed placement on it,
found once by :func:`microbatch_placements` (``Shard(d)`` where it holds the batch on dim ``d``,
``Replicate`` where it does not, ``Partial`` for per-sample sums such as the loss). The casts
that close the loss (a bf16 model's fp32 ``sum / count`` cast back to bf16) take it whole: no
rule passes a ``Partial`` through a narrowing cast, but the pipeline runtime adds the losses of
the micro-batches itself (:class:`~autopar.plan.split.LossSplit`), so on the stage
mesh only the ``dp`` replicas sum theirs, before the cast. Costing a
strategy extended by that placement on the mesh ``(pieces, tp)`` with the ordinary cost model
gives its time and memory for one micro-batch on one replica; collectives on the virtual axis
are free (they are gradient accumulation and the global loss sum). The window's cost graph is
:func:`autopar.planner.costgraph.build_cost_graph` in its micro-batch mode.

Collectives split into per micro-batch forward, per micro-batch backward, and per step: the
backward all-reduce of a parameter's gradient runs once per step on the accumulated gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from autopar.core.ir import Strategy, TensorMeta
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import axis_options
from autopar.planner.costgraph import PlannedGraph
from autopar.planner.costs import CostModel
from autopar.planner.graph_walk import GraphWalk, leaf_dependency, op_call, value_meta
from autopar.planner.layers import FIRST, LAYER, Window, window_label

R = Replicate()


@dataclass
class WindowInfo:
    """Per window node: op spec and micro-batch placements (computed once)."""

    window: Window
    batch: int
    specs: dict[str, object]  # op node -> its OpSpec
    mb_in: dict[str, tuple]  # node -> placement per tensor input
    mb_out: dict[str, tuple]  # node -> placement per output (placeholders: one)
    kind: dict[str, str]  # placeholder -> kind
    splittable: bool
    mb_local: dict[str, str] = field(default_factory=dict)  # node -> local op its batch split needs

    def extend(self, name: str, strategy: Strategy) -> Strategy:
        """``strategy`` of node ``name`` with its micro-batch placement in front of every sharding."""
        ins = self.mb_in.get(name, ())
        return Strategy(tuple((p,) + tuple(s) for p, s in zip(ins, strategy.inputs)),
                        tuple((p,) + tuple(s) for p, s in zip(self.mb_out[name], strategy.outputs)),
                        strategy.local)

    def planned(self) -> PlannedGraph:
        """The window as the cost graph's builder takes it: its two layers tied (and a loop's steps
        inside them: :func:`~autopar.planner.layers.window_label`), other nodes labelled as capture
        labelled them (a balanced window's repeated blocks and loop steps tie as in one stage), the
        loss replicated."""
        win = self.window
        layers = {n.name: n.meta["autopar_repeat"] for n in win.graph.nodes if n.meta.get("autopar_repeat")}
        layers.update({name: window_label(part, layers.get(name)) for name, part in win.part.items()
                       if part in (FIRST, LAYER)})
        return PlannedGraph(win.graph, win.inputs, layers, win.losses)


def batch_size(window: Window) -> int:
    """Dim 0 of the first user input with one: the batch the graph was captured at."""
    for name, inp in window.inputs.items():
        if inp.kind == "user_input":
            meta = value_meta(next(n for n in window.graph.nodes if n.name == name))
            if isinstance(meta, TensorMeta) and meta.ndim >= 1:
                return meta.shape[0]
    return 1


def microbatch_placements(window: Window) -> WindowInfo:
    """Where every tensor of the window holds the batch (module docstring)."""
    batch = batch_size(window)
    info = WindowInfo(window, batch, {}, {}, {}, {}, True)
    closing = loss_casts(window)
    walk = GraphWalk(window.graph)
    for node in walk.nodes():
        if node.op == "placeholder":
            inp = window.inputs.get(node.name)
            meta = value_meta(node)
            if inp is None or not isinstance(meta, TensorMeta):
                continue
            info.kind[node.name] = inp.kind
            batched = inp.kind == "user_input" and meta.ndim >= 1 and meta.shape[0] == batch and batch > 1
            info.mb_out[node.name] = (Shard(0) if batched else R,)
            walk.accept(node, leaf_dependency(inp.kind, frozen=inp.frozen))
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
        walk.accept(node, walk.dependencies(in_nodes))
        arriving = [info.mb_out[p][k] for p, k in (walk.producer[a.name] for a in tensors)]
        option = _matching_option(spec, arriving)
        if option is None:
            info.splittable = info.splittable and node.name in closing
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


def loss_casts(window: Window) -> set[str]:
    """The ``_to_copy`` nodes that close a loss: the loss output and the chain of casts under
    it, each read by nothing but the next."""
    nodes = {n.name: n for n in window.graph.nodes}
    out = set()
    for name in window.losses:
        node = nodes[name]
        while node.op == "call_function" and node.target is torch.ops.aten._to_copy.default:
            out.add(node.name)
            node = node.args[0]
            if len(node.users) != 1:
                break
    return out


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

    def __init__(self, tp_cluster, options, *, pieces: int, step_weight: float = 1.0, precision=None,
                 captured_dtype=None):
        super().__init__(tp_cluster, options, precision=precision, captured_dtype=captured_dtype)
        self.mesh_shape = (int(pieces),) + tuple(tp_cluster.mesh_shape)
        self.step_weight = float(step_weight)
        self._split: dict = {}
        self._phases: dict = {}

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

    def edge_phases(self, meta, src_strategies, out_index, dst_strategies, in_index, *, grad: bool,
                    regather: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`split` for every (producer strategy, consumer strategy) of an edge: three matrices,
        computed once per (tensor, strategy lists, indices): the edges of repeated layers and of a
        loop's steps share their strategy lists (:func:`~autopar.planner.costgraph.build_cost_graph`)."""
        key = (meta, id(src_strategies), out_index, id(dst_strategies), in_index, grad, regather)
        cached = self._phases.get(key)
        if cached is not None:
            return cached[0]
        shape = (len(src_strategies), len(dst_strategies))
        fwd, bwd, step = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        for a, s in enumerate(src_strategies):
            for c, t in enumerate(dst_strategies):
                fwd[a, c], bwd[a, c], step[a, c] = self.split(meta, tuple(s.outputs[out_index]),
                                                              tuple(t.inputs[in_index]), t, grad=grad,
                                                              regather=regather)
        for m in (fwd, bwd, step):
            m.setflags(write=False)
        # the strategy lists kept alive so that their ids stay unique while cached
        self._phases[key] = ((fwd, bwd, step), src_strategies, dst_strategies)
        return fwd, bwd, step


__all__ = ["MicroBatchCostModel", "WindowInfo", "batch_size", "loss_casts", "microbatch_placements"]
