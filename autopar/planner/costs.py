"""The planner's view of the cost models: per-strategy seconds and bytes, per-edge matrices.

Parameters stored sharded (ZeRO-3/FSDP) are gathered on use and gathered again in backward
(the gathered copy is not kept), so their memory stays sharded and the forward all-gather is
paid twice.

Gradient convention (matches codegen): the gradient of a tensor consumed ``Replicate`` on mesh
axis ``a`` by a strategy that is not all-replicated on ``a`` is a partial sum over ``a``. It is
all-reduced in backward (Megatron's *f*), except after a forward all-gather, whose backward
reduce-scatter sums it directly (ZeRO-3). Under an all-replicated consumer the gradient is
already whole, and a forward all-gather's backward is a local slice (free).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from autopar.core.ir import OpSpec, Strategy, TensorMeta
from autopar.core.placement import Replicate, local_shape
from autopar.cost_models.communication import resharding_steps
from autopar.cost_models.compute import compute_time, node_flops, op_class
from autopar.cost_models.memory import bytes_per_parameter


def _numel(meta: TensorMeta) -> int:
    return math.prod(meta.shape)


class CostModel:
    """Costs of strategies and reshardings for one cluster (logical mesh) and options."""

    def __init__(self, cluster, options):
        self.cluster = cluster
        self.mesh_shape = tuple(cluster.mesh_shape)
        self.device = cluster.device_spec
        self.options = options
        self.precision = "mixed" if options.mixed_precision else "fp32"
        self.dtype = torch.bfloat16 if options.mixed_precision else None
        self.state_bytes = bytes_per_parameter(precision=self.precision, optimizer=options.optimizer)
        self._edge_cache: dict = {}
        self._reshard_cache: dict = {}
        self._pattern_cache: dict = {}
        self._time_cache: dict = {}

    # --- nodes ----------------------------------------------------------------------------
    def local_numel(self, meta: TensorMeta, sharding) -> int:
        return math.prod(local_shape(meta.shape, sharding, self.mesh_shape))

    def leaf_memory(self, meta: TensorMeta, sharding, kind: str) -> float:
        """Bytes per device a parameter (with gradient and optimizer state), buffer or input keeps."""
        n = self.local_numel(meta, sharding)
        if kind == "parameter":
            return float(n * sum(self.state_bytes))
        return float(n * meta.dtype.itemsize)

    def parameter_split(self, meta: TensorMeta, sharding) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes per device of one parameter."""
        n = self.local_numel(meta, sharding)
        p, g, o = self.state_bytes
        return float(n * p), float(n * g), float(n * o)

    def op_times(self, spec: OpSpec, strategy: Strategy) -> tuple[float, float]:
        """(forward, backward) compute seconds of one strategy on one device."""
        return compute_time(spec, strategy, self.mesh_shape, self.device, dtype=self.dtype)

    def op_time(self, spec: OpSpec, strategy: Strategy) -> float:
        fwd, bwd = self.op_times(spec, strategy)
        return fwd + bwd

    def op_flops(self, spec: OpSpec) -> float:
        fwd, bwd = node_flops(spec)
        return float(fwd + bwd)

    def activation_memory(self, spec: OpSpec, strategy: Strategy) -> float:
        """Bytes of the node's outputs one device keeps for backward (views keep nothing new)."""
        if op_class(spec.op) == "view":
            return 0.0
        total = 0.0
        for meta, sh in zip(spec.outputs, strategy.outputs):
            itemsize = 2 if (self.dtype is not None and meta.dtype.is_floating_point) else meta.dtype.itemsize
            total += self.local_numel(meta, sh) * itemsize
        return total

    # --- edges ----------------------------------------------------------------------------
    def collectives(self, meta: TensorMeta, src, dst, consumer: Strategy | None, *, grad: bool,
                    regather: bool = False) -> tuple:
        """(phase, kind, axis, bytes) of turning ``src`` into ``dst`` for ``consumer``;
        ``regather``: forward all-gathers are repeated in backward (sharded parameters)."""
        return self._steps(meta, tuple(src), tuple(dst), self._flags(consumer), grad, regather)

    def _steps(self, meta: TensorMeta, src: tuple, dst: tuple, flags, grad: bool, regather: bool) -> tuple:
        """:meth:`collectives` with the consumer given by its replicated axes (``flags``)."""
        nbytes = float(_numel(meta) * meta.dtype.itemsize)
        out = []
        for phase, kind, axis, divisor in self._pattern(src, dst, flags, grad, regather):
            if divisor is None:  # a partial gradient of the consumed (local) tensor
                out.append((phase, kind, axis, float(self.local_numel(meta, dst) * meta.dtype.itemsize)))
            else:
                out.append((phase, kind, axis, nbytes / divisor))
        return tuple(out)

    def _pattern(self, src: tuple, dst: tuple, flags, grad: bool, regather: bool) -> tuple:
        """The collectives of a resharding for any tensor: (phase, kind, axis, divisor) with
        bytes = the tensor's bytes / divisor (None: the consumer's local bytes). Costed once per
        (shardings, replicated axes) on the tensor of ``prod(mesh)`` bytes, on which every
        divisor (a product of distinct mesh axis sizes) comes out exact."""
        key = (src, dst, flags if grad else None, grad, regather)
        hit = self._pattern_cache.get(key)
        if hit is not None:
            return hit
        total = float(math.prod(self.mesh_shape))
        steps = resharding_steps(total, src, dst, self.mesh_shape)
        out = []
        partial_grad = set()
        if flags is not None and grad:
            partial_grad = {
                a for a, n in enumerate(self.mesh_shape)
                if n > 1 and isinstance(dst[a], Replicate) and not flags[a]
            }
        gathered = set()
        for c in steps:
            divisor = total / c.nbytes
            if c.phase == "fwd":
                out.append(("forward", c.kind, c.axis, divisor))
                if c.kind == "all_gather":
                    gathered.add(c.axis)
                    if regather and grad:
                        out.append(("backward", c.kind, c.axis, divisor))
            elif grad:
                if c.kind == "reduce_scatter" and c.axis not in partial_grad:
                    continue  # the gradient is whole: the all-gather's backward is a slice
                out.append(("backward", c.kind, c.axis, divisor))
        for a in sorted(partial_grad - gathered):
            out.append(("backward", "all_reduce", a, None))
        hit = self._pattern_cache[key] = tuple(out)
        return hit

    def _flags(self, consumer: Strategy | None) -> tuple[bool, ...] | None:
        """What of a consumer the cost of an edge into it depends on: replicated per mesh axis."""
        if consumer is None:
            return None
        return tuple(consumer.replicated_on(a) for a in range(len(self.mesh_shape)))

    def _collective_time(self, kind: str, nbytes: float, axis) -> float:
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
            t = self._reshard_cache[key] = sum(self._collective_time(kind, nb, axis) for _, kind, axis, nb in steps)
        return t

    def edge_matrix(self, meta, src_strategies, out_index, dst_strategies, in_index, *,
                    grad: bool, regather: bool = False) -> np.ndarray:
        """Seconds of resharding per (producer strategy, consumer strategy). Strategies that
        produce the same sharding (rows), or need the same one with the same replicated axes
        (columns), share one entry: only the distinct pairs are costed."""
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


__all__ = ["CostModel"]
