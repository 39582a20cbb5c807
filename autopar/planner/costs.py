"""The planner's view of the cost models: per-strategy seconds and bytes, per-edge matrices.

An edge costs the collectives :mod:`autopar.core.reshard` lists for it, the steps code
generation emits: the forward steps, each step's adjoint, and one all-reduce of a gradient that
reaches the source as a pending sum (Megatron's *f*, a data-parallel gradient), on the
convention that a consumer whose outputs are all ``R`` on a mesh axis hands back whole
gradients there and one whose work is split hands back pending sums on its replicated inputs.
Parameters stored sharded (ZeRO-3/FSDP) are gathered on use; where the consumer reads the
gathered tensor itself the runtime does not keep it for backward but gathers it again there
(priced), so their memory stays sharded. Where a cut follows the gathers autograd keeps the cut
instead, and nothing is gathered again (for a cut of dim 0, a view that holds the whole gathered
buffer: memory the memory model does not count).

An edge is priced alone; code generation decides gradient kinds over the whole graph, and they
differ where an edge cannot see it:

- a replicated consumer's outputs may get pending sums (it feeds a split consumer): codegen
  then hands a pending sum back into it too and sums it further up, where kinds mix; the price
  puts that all-reduce on the edge into the split consumer, where the pending sum starts (the
  tensor summed may differ in size). An all-gather on an edge into such a replicated consumer
  reduce-scatters in codegen but is priced as a free slice (under-count);
- a source with several consumers: a pending sum is priced on each edge that leaves it
  pending, codegen sums it once when every consumer leaves it pending (over-count); a chunk or
  R -> P step is priced handing back the whole gradient (a chunk's backward all-gather), codegen
  lets it hand back a pending sum for free when the other consumers do (over-count);
- the re-gather assumes the consumer saves the gathered parameter for its backward; one that
  does not (an add, an embedding's table, a matmul whose other input needs no gradient)
  re-gathers nothing (over-count by the forward all-gathers).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from autopar.core.collective_kinds import BUFFERS, Collective
from autopar.core.ir import OpSpec, Strategy, TensorMeta, TensorPart
from autopar.core.placement import Replicate, local_shape
from autopar.core.precision import Precision, precision_of
from autopar.core.reshard import edge_collectives, input_kind
from autopar.cost_models.compute import compute_time, localize, node_flops, op_class
from autopar.cost_models.devices import COMPUTE_CLASSES


def _numel(meta: TensorMeta) -> int:
    return math.prod(meta.shape)


class CostModel:
    """Costs of strategies and reshardings for one cluster (logical mesh) and options."""

    def __init__(self, cluster, options, *, precision: Precision | None = None,
                 captured_dtype: torch.dtype | None = None):
        self.cluster = cluster
        self.mesh_shape = tuple(cluster.mesh_shape)
        self.device = cluster.device_spec
        self.options = options
        # what the program computes in (default: an fp32 model's precision under the options)
        self.precision = precision or precision_of((), mixed_precision=options.mixed_precision)
        self.dtype = self.precision.compute
        self.state_bytes = self.precision.state_bytes(options.optimizer)
        # the floating parameters' dtype in the captured graph: where it is the compute dtype (a
        # mixed-precision capture), a value of another floating dtype was cast on purpose (an
        # RMSNorm's fp32 upcast) and the program holds it so
        self.captured_dtype = captured_dtype
        self._edge_cache: dict = {}
        self._reshard_cache: dict = {}
        self._pattern_cache: dict = {}
        self._time_cache: dict = {}
        self._backward_cache: dict = {}
        self._parts_cache: dict = {}
        self._flops_cache: dict = {}
        self.memo: dict = {}  # what the planner derives once per search (planner.intra._graph_facts)

    # --- nodes ----------------------------------------------------------------------------
    def local_numel(self, meta: TensorMeta, sharding) -> int:
        return math.prod(local_shape(meta.shape, sharding, self.mesh_shape))

    def leaf_memory(self, meta: TensorMeta, sharding, kind: str, *, frozen: bool = False) -> float:
        """Bytes per device a parameter (with gradient and optimizer state, unless ``frozen``),
        buffer or input keeps."""
        if kind == "parameter":
            return float(sum(self.parameter_split(meta, sharding, frozen=frozen)))
        return float(self.local_numel(meta, sharding) * meta.dtype.itemsize)

    def parameter_split(self, meta: TensorMeta, sharding, *, frozen: bool = False) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes per device of one parameter (a ``frozen`` one
        has neither gradient nor optimizer state)."""
        n = self.local_numel(meta, sharding)
        p, g, o = self.state_bytes
        return float(n * p), 0.0 if frozen else float(n * g), 0.0 if frozen else float(n * o)

    def op_times(self, spec: OpSpec, strategy: Strategy, grads: tuple[bool, ...] | None = None) -> tuple[float, float]:
        """(forward, backward) compute seconds of one strategy on one device (``grads``: which
        tensor inputs its backward hands a gradient, see :func:`compute_time`)."""
        return compute_time(spec, strategy, self.mesh_shape, self.device, dtype=self.dtype, grads=grads)

    def op_flops(self, spec: OpSpec, grads: tuple[bool, ...] | None = None) -> float:
        """Forward + backward FLOPs of the whole op (``grads``: see :func:`node_flops`)."""
        fwd, bwd = node_flops(spec, grads)
        return float(fwd + bwd)

    def local_flops(self, spec: OpSpec, strategy: Strategy, grads: tuple[bool, ...] | None = None, *,
                    forward_again: bool = False) -> float:
        """Forward + backward FLOPs one device executes for ``spec`` under ``strategy``, counted
        as torch's FlopCounterMode counts them: matmuls, convolutions and attention only
        (``grads``: which tensor inputs need a gradient, see :func:`node_flops`; ``forward_again``:
        recomputation runs its forward twice)."""
        key = (id(spec), id(strategy), grads, forward_again)  # both kept with the answer: their ids stay theirs
        hit = self._flops_cache.get(key)
        if hit is not None and hit[0] is spec and hit[1] is strategy:
            return hit[2]
        flops = executed_flops(spec, strategy, self.mesh_shape, grads, forward_again=forward_again)
        self._flops_cache[key] = (spec, strategy, flops)
        return flops

    def parts_memory(self, spec: OpSpec, strategy: Strategy, parts: tuple[TensorPart, ...]) -> float:
        """Bytes per device of ``parts`` of a node (its ``meta["autopar_saved"]``: what autograd
        saves for its backward, or ``meta["autopar_backward"]``: what its backward holds; see
        :mod:`autopar.passes.capture.saved`), each at the sharding this strategy gives the input
        or output it is measured against (a replicated input a split matmul saves is counted
        whole)."""
        key = (id(spec), strategy, parts)  # the spec kept with its answer: its id stays its own
        hit = self._parts_cache.get(key)
        if hit is not None and hit[0] is spec:
            return hit[1]
        inputs = spec.inputs if any(p.where == "input" for p in parts) else ()
        nbytes = sum(self.part_bytes(spec, strategy, p, inputs)[1] * p.share for p in parts)
        self._parts_cache[key] = (spec, nbytes)
        return nbytes

    def part_bytes(self, spec: OpSpec, strategy: Strategy, part: TensorPart, inputs=None) -> tuple[tuple, float]:
        """(the sharding, the bytes per device) of one part of a node, whole (its ``share`` not
        taken: see :meth:`parts_memory`); ``inputs``: ``spec.inputs`` if the caller has them."""
        if part.where == "input":
            meta, sharding = (spec.inputs if inputs is None else inputs)[part.index], strategy.inputs[part.index]
        else:
            meta, sharding = spec.outputs[part.index], strategy.outputs[part.index]
        return tuple(sharding), self.held_bytes(meta, sharding, part.dtype) * part.elements

    def held_bytes(self, meta: TensorMeta, sharding, dtype: torch.dtype | None = None) -> float:
        """Bytes per device the program holds ``meta`` (as a ``dtype`` tensor, default its own) in:
        the compute dtype under mixed precision (but for a value a mixed-precision capture shows
        cast to another floating dtype on purpose), else the captured dtype (a bf16 model's fp32
        upcast of its logits stays fp32)."""
        return float(self.local_numel(meta, sharding) * self.itemsize(dtype or meta.dtype))

    def itemsize(self, dtype: torch.dtype) -> int:
        """Bytes per element the program holds a value of captured ``dtype`` in (:meth:`held_bytes`)."""
        cast = dtype.is_floating_point and self.captured_dtype == self.dtype and dtype != self.dtype
        return self.precision.itemsize(dtype) if self.precision.master and not cast else dtype.itemsize

    # --- edges ----------------------------------------------------------------------------
    def collectives(self, meta: TensorMeta, src, dst, consumer: Strategy | None, *, grad: bool,
                    regather: bool = False) -> tuple[Collective, ...]:
        """The collectives of turning ``src`` into ``dst`` for ``consumer`` (None: one whose
        outputs are replicated), forward and, with ``grad``, backward; ``regather``: the source
        is a sharded parameter, gathered again in backward."""
        return self._steps(meta, tuple(src), tuple(dst), self._flags(consumer), grad, regather)

    def _steps(self, meta: TensorMeta, src: tuple, dst: tuple, flags, grad: bool, regather: bool) -> tuple:
        """:meth:`collectives` with the consumer given by its replicated outputs (``flags``)."""
        nbytes = float(_numel(meta) * self.itemsize(meta.dtype))
        return tuple(Collective(phase, kind, axis, nbytes / pieces)
                     for phase, kind, axis, pieces in self._pattern(src, dst, flags, grad, regather, meta.ndim))

    def _pattern(self, src: tuple, dst: tuple, flags, grad: bool, regather: bool, ndim: int) -> tuple:
        """:func:`~autopar.core.reshard.edge_collectives` of the edge: ``(phase, kind, axis,
        pieces)`` for any tensor, computed once per (shardings, consumer flags)."""
        key = (src, dst, flags if grad else None, grad, regather)
        hit = self._pattern_cache.get(key)
        if hit is None:
            kinds = None
            if grad:
                flags = flags or (True,) * len(self.mesh_shape)
                kinds = tuple(input_kind(p, "R" if whole else "P") for p, whole in zip(dst, flags))
            hit = self._pattern_cache[key] = edge_collectives(src, dst, self.mesh_shape, ndim=ndim, kinds=kinds,
                                                              regather=regather)
        return hit

    def backward_reshard(self, meta: TensorMeta, src, dst, consumer: Strategy) -> tuple[float, float] | None:
        """For a value made at ``src`` and read at ``dst`` by ``consumer``: (bytes of its gradient
        and of the copy resharded to ``src``, bytes of the largest backward collective's own
        buffers, :data:`~autopar.core.collective_kinds.BUFFERS`); None where its backward has no
        collective. Kept per (tensor, shardings, what of the consumer the collectives depend on)."""
        src, dst, flags = tuple(src), tuple(dst), self._flags(consumer)
        key = (meta, src, dst, flags)
        if key not in self._backward_cache:
            steps = [c for c in self._steps(meta, src, dst, flags, True, False) if c.phase == "backward"]
            self._backward_cache[key] = (self.held_bytes(meta, dst) + self.held_bytes(meta, src),
                                         max(BUFFERS.get(c.kind, 0.0) * c.nbytes for c in steps)) if steps else None
        return self._backward_cache[key]

    def _flags(self, consumer: Strategy | None) -> tuple[bool, ...] | None:
        """What of a consumer the cost of an edge into it depends on: per mesh axis, whether all
        its outputs are replicated (its replicated inputs then get whole gradients)."""
        if consumer is None:
            return None
        return tuple(all(isinstance(s[a], Replicate) for s in consumer.outputs) for a in range(len(self.mesh_shape)))

    def collective_time(self, kind: str, nbytes: float, axis) -> float:
        """The cluster's seconds for one collective, remembered."""
        key = (kind, nbytes, axis)
        t = self._time_cache.get(key)
        if t is None:
            t = self._time_cache[key] = self.cluster.collective_time(kind, nbytes, axis)
        return t

    def reshard_time(self, meta: TensorMeta, src, dst, *, grad: bool, consumer: Strategy | None = None,
                     regather: bool = False) -> float:
        return self._pair_time(meta, tuple(src), tuple(dst), self._flags(consumer), grad, regather)

    def _pair_time(self, meta: TensorMeta, src: tuple, dst: tuple, flags, grad: bool, regather: bool) -> float:
        key = (meta, src, dst, flags, grad, regather)
        t = self._reshard_cache.get(key)
        if t is None:
            steps = self._steps(meta, src, dst, flags, grad, regather)
            t = self._reshard_cache[key] = sum(self.collective_time(c.kind, c.nbytes, c.axis) for c in steps)
        return t

    def edge_matrix(self, meta, src_strategies, out_index, dst_strategies, in_index, *,
                    grad: bool, regather: bool = False) -> np.ndarray:
        """Seconds of resharding per (producer strategy, consumer strategy). Strategies that
        produce the same sharding (rows), or need the same one with outputs replicated on the
        same axes (columns), share one entry: only the distinct pairs are costed."""
        key = (meta, id(src_strategies), out_index, id(dst_strategies), in_index, grad, regather)
        cached = self._edge_cache.get(key)
        if cached is not None:
            return cached[0]
        row_of: dict = {}
        rows = np.array([row_of.setdefault(tuple(s.outputs[out_index]), len(row_of)) for s in src_strategies])
        col_of: dict = {}
        cols = np.array([col_of.setdefault((tuple(t.inputs[in_index]), self._flags(t)), len(col_of))
                         for t in dst_strategies])
        unique = np.array([[self._pair_time(meta, src, dst, flags, grad, regather) for dst, flags in col_of]
                           for src in row_of])
        m = unique[np.ix_(rows, cols)]
        m.setflags(write=False)
        # keep the strategy lists alive so their ids stay unique while cached
        self._edge_cache[key] = (m, src_strategies, dst_strategies)
        return m


def executed_flops(spec: OpSpec, strategy: Strategy, mesh_shape, grads: tuple[bool, ...] | None = None, *,
                   forward_again: bool = False) -> float:
    """:meth:`CostModel.local_flops` on ``mesh_shape``; ``forward_again``: its forward runs twice
    (activation recomputation)."""
    if op_class(spec.op) not in COMPUTE_CLASSES:
        return 0.0
    fwd, bwd = node_flops(localize(spec, strategy, tuple(mesh_shape)), grads, executed=True)
    return float((2 if forward_again else 1) * fwd + bwd)


def captured_dtype(captured) -> torch.dtype | None:
    """The dtype of ``captured``'s floating parameters (the first one's; None without any)."""
    return next((m.dtype for m in captured.parameters.values() if m.dtype.is_floating_point), None)


def model_precision(captured, options) -> Precision:
    """The precision a plan of ``captured`` under ``options`` computes in (read from its
    parameters' dtypes: :func:`~autopar.core.precision.precision_of`)."""
    return precision_of((m.dtype for m in captured.parameters.values()), mixed_precision=options.mixed_precision)


__all__ = ["CostModel", "captured_dtype", "executed_flops", "model_precision"]
