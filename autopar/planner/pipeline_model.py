"""The pipeline model: a captured graph cut into pipeline units, with everything the stage search
and the grid share for one model on one cluster (:class:`PipelineModel`, built by
:func:`build_model`).

Units are groups of repeated layers, the pre part joining the first and the post part the last,
or FLOP-balanced groups of nodes (:mod:`autopar.planner.layers`); at most :data:`MAX_UNITS`.
Sub-meshes are Alpa's shapes: ``(1, 2^k)`` inside a node and ``(n, devices per node)`` for
whole nodes (every ``n`` up to 16 nodes, else the divisors and powers of two of the node
count), kept when they are multiples of the smallest evenly split stage (``devices / pp`` for
the deepest ``pp`` dividing both the units and the devices): that keeps every grid point and
makes the DP's device dimension at most ``units + 1`` wide (:func:`submesh_sizes`). Logical
meshes put ``tp`` (a power of two up to a node) inside nodes and ``dp`` across. Micro-batch
sizes per replica are the divisors of the batch up to :data:`MAX_MICROBATCH`.

The model computes lazily and caches: the intra-op candidates per ``tp``
(:mod:`autopar.planner.candidates`), their per-part costs at every micro-batch size
(:mod:`autopar.planner.stage_costs`) summed over unit ranges, and the ZeRO costs over ``dp``
(:mod:`autopar.planner.stage_table`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field

from autopar.core.errors import InfeasibleError
from autopar.core.precision import Precision
from autopar.planner.candidates import Candidate, candidates
from autopar.planner.costgraph import build_cost_graph
from autopar.planner.costs import captured_dtype, model_precision
from autopar.planner.layers import balanced_groups, layer_units, split_layers, window
from autopar.planner.microbatch import MicroBatchCostModel, microbatch_placements
from autopar.planner.restrictions import megatron_tp_rule
from autopar.planner.stage_costs import evaluate
from autopar.planner.stage_table import (
    ZERO_STAGES,
    Config,
    DataParallelCosts,
    RangeCosts,
    StageArrays,
    range_costs,
    stage_arrays,
)

MAX_UNITS = 32  # pipeline units the stage DP works on (groups of layers)
MAX_MICROBATCH = 32  # samples per replica per micro-batch


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def submesh_sizes(cluster, units: int) -> list[int]:
    """Device counts of the sub-meshes a stage may take (module docstring)."""
    n = cluster.num_devices
    per_node = min(cluster.devices_per_node or n, n)
    nodes = n // per_node
    sizes = {1 << k for k in range(per_node.bit_length()) if (1 << k) <= per_node and per_node % (1 << k) == 0}
    counts = range(1, nodes + 1) if nodes <= 16 else sorted(set(divisors(nodes)) | {
        1 << k for k in range(nodes.bit_length()) if (1 << k) <= nodes})
    sizes |= {c * per_node for c in counts}
    smallest = n // math.gcd(units, n)  # the smallest evenly split stage of the grid
    return sorted(s for s in sizes if s <= n and s % smallest == 0)


@dataclass
class PipelineModel:
    """Everything the stage search and the grid share for one model on one cluster."""

    captured: object
    cluster: object
    options: object
    info: object
    segments: object
    units: int
    layers_per_unit: int
    submeshes: list[int]
    microbatch_sizes: list[int]
    batch_counts: list[int]
    link: object
    limit: float
    dpc: DataParallelCosts
    precision: Precision
    only_tp: int | None = None  # restricts tps() (equal stage meshes)
    candidates: dict[int, list[Candidate]] = field(default_factory=dict)
    candidate_names: dict[int, dict[str, int]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    _ranges: dict = field(default_factory=dict)
    _dp: dict = field(default_factory=dict)

    @property
    def layered(self) -> bool:
        return self.segments is not None

    @property
    def batch(self) -> int:
        return self.info.batch

    @functools.cached_property
    def unread_state(self) -> float:
        """Bytes of the model's buffers, constants and parameters (their weights: no gradient
        reaches them) no op reads: the first stage stores them (:func:`autopar.plan.split.split_stages`)."""
        read = {n.name for n in self.captured.graph_module.graph.nodes if n.op == "placeholder" and n.users}
        weight = self.dpc.state_bytes[0]  # a parameter's bytes per element, as a frozen one is held
        return float(sum(math.prod(i.meta.shape) * (weight if i.kind == "parameter" else i.meta.dtype.itemsize)
                         for i in self.captured.inputs
                         if i.kind in ("buffer", "constant", "parameter") and i.node not in read))

    def tps(self, devices: int) -> list[int]:
        per_node = min(self.cluster.devices_per_node or devices, self.cluster.num_devices)
        found = [t for t in divisors(math.gcd(devices, per_node)) if t & (t - 1) == 0]
        return [t for t in found if t == self.only_tp] if self.only_tp else found

    def tp_cluster(self, tp: int):
        return dataclasses.replace(self.cluster, mesh_shape=(tp,))

    def ensure_candidates(self, tp: int) -> list[Candidate]:
        if tp not in self.candidates:
            start = time.perf_counter()
            b = self.microbatch_sizes[0]
            pieces = self.batch // b
            cm = MicroBatchCostModel(self.tp_cluster(tp), self.options, pieces=pieces, step_weight=1.0 / pieces,
                                     precision=self.precision, captured_dtype=captured_dtype(self.captured))
            graph = build_cost_graph(self.info.planned(), cm, microbatch=self.info)
            weight = (self.segments.num_layers - 1) if self.layered else 1.0
            found, names = candidates(graph, self.options, tp=tp, layer_weight=weight,
                                      megatron_allow=megatron_tp_rule())
            self.candidates[tp], self.candidate_names[tp] = found, names
            self.timings["intra-op ILPs"] = self.timings.get("intra-op ILPs", 0.0) + time.perf_counter() - start
        return self.candidates[tp]

    def range_costs(self, tp: int, b: int, index: int) -> RangeCosts | None:
        key = (tp, b, index)
        if key not in self._ranges:
            start = time.perf_counter()
            found = self.ensure_candidates(tp)
            for k, pc in enumerate(evaluate(self.info, self.tp_cluster(tp), self.options, found, b=b,
                                            precision=self.precision, captured_dtype=captured_dtype(self.captured))):
                self._ranges[(tp, b, k)] = None if pc is None else range_costs(
                    pc, units=self.units, layers_per_unit=self.layers_per_unit, layered=self.layered,
                    unread=self.unread_state)
            self.timings["stage costs"] = self.timings.get("stage costs", 0.0) + time.perf_counter() - start
        return self._ranges[key]

    def arrays(self, cfg: Config, b: int, batches: int) -> StageArrays | None:
        rc = self.range_costs(cfg.tp, b, cfg.candidate)
        if rc is None:
            return None
        key = (cfg.tp, cfg.candidate, cfg.dp, cfg.zero)
        if key not in self._dp:
            self._dp[key] = self.dpc.ranges(rc, dp=cfg.dp, tp=cfg.tp, zero=cfg.zero)
        return stage_arrays(rc, self._dp[key], cfg, batches=batches, link=self.link,
                            optimizer=self.options.optimizer, master=self.precision.master)

    def microbatch(self, dp: int, batches: int) -> int | None:
        """Samples per replica per micro-batch, or None when they are not a searched size."""
        if self.batch % (dp * batches):
            return None
        b = self.batch // (dp * batches)
        return b if b in self.microbatch_sizes else None

    def zero_stages(self, dp: int) -> tuple[int, ...]:
        return ZERO_STAGES if dp > 1 and self.options.shard_parameters else (0,)

    def recompute_choices(self) -> tuple[bool | str, ...]:
        """How stages may recompute: as the options say (False, True: whole layers, or
        "selective"), each of them for "auto"."""
        return {True: (True,), False: (False,), "selective": ("selective",)}.get(self.options.recompute,
                                                                                  (False, "selective", True))


def build_model(captured, cluster, options, *, units: int | None = None, any_microbatch: bool = False
                ) -> PipelineModel:
    """Cut the graph into units, find micro-batch placements, list sub-meshes and batch counts.

    ``units`` overrides the number of pipeline units of a layered model (a divisor of its
    layers); ``any_microbatch`` allows every divisor of the batch as micro-batch size.
    """
    start = time.perf_counter()
    n = cluster.num_devices
    segments = split_layers(captured)
    if segments is not None:
        win = window(captured, segments)
        if units is None or segments.num_layers % units:
            units = layer_units(segments.num_layers, num_devices=n, max_units=MAX_UNITS)
        per_unit = segments.num_layers // units
    else:
        compute = sum(1 for node in captured.graph_module.graph.nodes if node.op == "call_function")
        win = balanced_groups(captured, groups=max(1, min(MAX_UNITS, compute)))
        units, per_unit = len(win.parts), 1
    info = microbatch_placements(win)
    batch = info.batch
    sizes = [b for b in divisors(batch) if b <= MAX_MICROBATCH or any_microbatch] if info.splittable else [batch]
    link = cluster.stage_link()
    precision = model_precision(captured, options)
    states = precision.state_bytes(options.optimizer)
    model = PipelineModel(captured, cluster, options, info, segments, units, per_unit,
                          submesh_sizes(cluster, units), sizes, [], link,
                          cluster.memory_per_device * options.memory_fraction, DataParallelCosts(cluster, states, copy=not precision.master),
                          precision)
    counts = {batch // (d // tp * b) for d in model.submeshes for tp in model.tps(d) for b in sizes
              if batch % (d // tp * b) == 0}
    if options.micro_batches is not None:
        counts &= {options.micro_batches}
        if not counts:
            raise InfeasibleError(
                f"micro_batches={options.micro_batches} gives no whole micro-batch of at most"
                f" {MAX_MICROBATCH} samples per replica on any stage mesh for batch {batch}: pick a"
                " divisor of the batch, or micro_batches=None to search")
    model.batch_counts = sorted(counts)
    model.timings["layers and placements"] = time.perf_counter() - start
    return model


__all__ = ["MAX_MICROBATCH", "MAX_UNITS", "PipelineModel", "build_model", "divisors", "submesh_sizes"]
