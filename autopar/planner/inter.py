"""Inter-operator planning: pipeline stages on sub-meshes, micro-batches, schedule (Alpa-style).

``plan_inter`` cuts the captured graph into pipeline units (:mod:`autopar.planner.layers`:
groups of repeated layers, the pre part joining the first and the post part the last, or
FLOP-balanced groups of nodes), then searches

    stages (contiguous unit ranges) × sub-mesh per stage × logical mesh (dp, tp) of that
    sub-mesh × intra-op plan on tp × ZeRO stage on dp × recomputation × micro-batches B

minimising the 1F1B/GPipe step latency ``(B − 1)·max stage + Σ stages`` under each stage's
memory with its micro-batches in flight (:mod:`autopar.solver.stages`, exact for the table
it is given). Stage costs come from the intra-op ILP, solved once per ``tp`` (at the smallest
micro-batch) on a small window graph whose identical layers share one decision, and evaluated
exactly at every micro-batch size (:mod:`autopar.planner.microbatch`,
:mod:`autopar.planner.candidates`, :mod:`autopar.planner.stage_costs`,
:mod:`autopar.planner.stage_table`). Within a stage the ILP decides the ``tp`` axis (any op
dimension: Megatron's splits, sequence splits, sharded parameters...); the ``dp`` axis is data
parallelism with a ZeRO stage, a restriction of Alpa's search, which lets the ILP decide both
axes of every logical mesh.

Sub-meshes are Alpa's shapes: ``(1, 2^k)`` inside a node and ``(n, devices per node)`` for
whole nodes (every ``n`` up to 16 nodes, else the divisors and powers of two of the node
count), kept when they are multiples of the smallest evenly split stage (``devices / pp`` for
the deepest ``pp`` dividing both the units and the devices): that keeps every grid point and
makes the DP's device dimension at most ``units + 1`` wide. Logical meshes put
``tp`` (a power of two up to a node) inside nodes and ``dp`` across. Micro-batch sizes per
replica are the divisors of the batch up to :data:`MAX_MICROBATCH`.

By default (``Options(stage_meshes="equal")``, what the runtime executes) every stage shares one
sub-mesh size and ``tp``: the search runs once per (sub-mesh, tp) and keeps the fastest.
``stage_meshes="any"`` searches Alpa's full space in one pass.

Every evenly split Megatron configuration that :func:`grid_search` tries (tp, pp dividing the
units and the devices, dp, B, ZeRO 0/1/3, recomputation) is a point of this search space with
the same costs (the Megatron-style tp plan is one of the candidates), so autopar's predicted
step time is never above the grid's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.planner.candidates import Candidate, candidates
from autopar.planner.costgraph import build_cost_graph
from autopar.planner.costs import CostModel
from autopar.planner.layers import balanced_groups, layer_units, split_layers, window
from autopar.planner.microbatch import MicroBatchCostModel, microbatch_placements
from autopar.planner.pipeline_plan import build_pipeline_plan
from autopar.planner.restrictions import megatron_tp_rule
from autopar.planner.stage_costs import evaluate
from autopar.planner.stage_table import (
    ZERO_STAGES,
    Config,
    DataParallelCosts,
    RangeCosts,
    StageArrays,
    fill,
    in_flight,
    new_table,
    range_costs,
    stage_arrays,
)
from autopar.solver import solve_stages

MAX_UNITS = 32  # pipeline units the stage DP works on (groups of layers)
MAX_MICROBATCH = 32  # samples per replica per micro-batch


def uses_pipeline(captured, cluster, options) -> bool:
    """Whether ``compile`` runs the inter-op search: ``options.pipeline``, where "auto" means a
    cluster of several nodes and a model with repeated layers."""
    if options.pipeline == "auto":
        return cluster.num_nodes > 1 and len(captured.layers) >= 2
    return bool(options.pipeline)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def submesh_sizes(cluster, units: int) -> list[int]:
    """Device counts of the sub-meshes a stage may take (module docstring)."""
    n = cluster.num_devices
    per_node = min(cluster.devices_per_node or n, n)
    nodes = n // per_node
    sizes = {1 << k for k in range(per_node.bit_length()) if (1 << k) <= per_node and per_node % (1 << k) == 0}
    counts = range(1, nodes + 1) if nodes <= 16 else sorted(set(_divisors(nodes)) | {
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

    def tps(self, devices: int) -> list[int]:
        per_node = min(self.cluster.devices_per_node or devices, self.cluster.num_devices)
        found = [t for t in _divisors(math.gcd(devices, per_node)) if t & (t - 1) == 0]
        return [t for t in found if t == self.only_tp] if self.only_tp else found

    def tp_cluster(self, tp: int):
        return dataclasses.replace(self.cluster, mesh_shape=(tp,))

    def ensure_candidates(self, tp: int) -> list[Candidate]:
        if tp not in self.candidates:
            start = time.perf_counter()
            b = self.microbatch_sizes[0]
            pieces = self.batch // b
            cm = MicroBatchCostModel(self.tp_cluster(tp), self.options, pieces=pieces, step_weight=1.0 / pieces)
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
            for k, pc in enumerate(evaluate(self.info, self.tp_cluster(tp), self.options, found, b=b)):
                self._ranges[(tp, b, k)] = None if pc is None else range_costs(
                    pc, units=self.units, layers_per_unit=self.layers_per_unit, layered=self.layered)
            self.timings["stage costs"] = self.timings.get("stage costs", 0.0) + time.perf_counter() - start
        return self._ranges[key]

    def arrays(self, cfg: Config, b: int, batches: int) -> StageArrays | None:
        rc = self.range_costs(cfg.tp, b, cfg.candidate)
        if rc is None:
            return None
        key = (cfg.tp, cfg.candidate, cfg.dp, cfg.zero)
        if key not in self._dp:
            self._dp[key] = self.dpc.ranges(rc, dp=cfg.dp, tp=cfg.tp, zero=cfg.zero)
        return stage_arrays(rc, self._dp[key], cfg, batches=batches, link=self.link)

    def microbatch(self, dp: int, batches: int) -> int | None:
        """Samples per replica per micro-batch, or None when they are not a searched size."""
        if self.batch % (dp * batches):
            return None
        b = self.batch // (dp * batches)
        return b if b in self.microbatch_sizes else None

    def zero_stages(self, dp: int) -> tuple[int, ...]:
        return ZERO_STAGES if dp > 1 and self.options.shard_parameters else (0,)

    def recompute_choices(self) -> tuple[bool, ...]:
        return {True: (True,), False: (False,)}.get(self.options.recompute, (False, True))


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
    sizes = [b for b in _divisors(batch) if b <= MAX_MICROBATCH or any_microbatch] if info.splittable else [batch]
    link = cluster.link("inter") if cluster.num_nodes > 1 else cluster.link("intra")
    states = CostModel(cluster, options).state_bytes
    model = PipelineModel(captured, cluster, options, info, segments, units, per_unit,
                          submesh_sizes(cluster, units), sizes, [], link,
                          cluster.memory_per_device * options.memory_fraction, DataParallelCosts(cluster, states))
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


# ----------------------------------------------------------------------------- the search


@dataclass
class Choice:
    """A pipeline: stages ``(first unit, last unit, sub-mesh devices, config)`` and their costs."""

    stages: list[tuple[int, int, int, Config]]
    batches: int
    latency: float
    stage_times: list[float]
    bubble_fraction: float
    method: str


def _bubble(times, devices, batches, latency, total) -> float:
    busy = batches * sum(t * d for t, d in zip(times, devices))
    return float(min(max(1.0 - busy / (latency * total), 0.0), 1.0)) if latency > 0 else 0.0


def _lower_bound(arrays: StageArrays, devices: int, units: int, total: int, batches: int) -> float:
    """A bound below every latency using this configuration: a stage of ``k`` units on ``d``
    devices takes at least ``k·ρ/d`` (ρ: its least device-time per unit), so the slowest of a
    plan's stages takes at least ``U·ρ/N`` and the latency at least ``B·U·ρ/N``."""
    lengths = np.arange(units)[None, :] - np.arange(units)[:, None] + 1
    with np.errstate(invalid="ignore"):
        per_unit = np.where(lengths > 0, arrays.time * devices / np.maximum(lengths, 1), np.inf)
    return float(batches * units * per_unit.min() / total)


def search(model: PipelineModel) -> Choice:
    """The least-latency pipeline over every batch count (module docstring); with
    ``Options(stage_meshes="equal")`` the best over each (sub-mesh, tp) that every stage shares."""
    if model.options.stage_meshes == "any":
        return _search(model)
    start = time.perf_counter()
    best = None
    for d in model.submeshes:
        if model.cluster.num_devices % d:
            continue
        for tp in model.tps(d):
            try:
                found = _search(dataclasses.replace(model, submeshes=[d], only_tp=tp))
            except InfeasibleError:
                continue
            if best is None or found.latency < best.latency:
                best = found
    model.timings["search"] = time.perf_counter() - start
    if best is None:
        raise InfeasibleError(_infeasible_message(model))
    return best


def _search(model: PipelineModel) -> Choice:
    start = time.perf_counter()
    U, subs, n = model.units, model.submeshes, model.cluster.num_devices
    S = min(U, n // min(subs))

    def configs(batches):
        for m, d in enumerate(subs):
            for tp in model.tps(d):
                dp = d // tp
                b = model.microbatch(dp, batches)
                if b is None:
                    continue
                for ci in range(len(model.ensure_candidates(tp))):
                    for zero in model.zero_stages(dp):
                        for rc in model.recompute_choices():
                            cfg = Config(dp, tp, ci, zero, rc)
                            arrays = model.arrays(cfg, b, batches)
                            if arrays is not None:
                                yield m, cfg, arrays

    bounds = []
    for batches in model.batch_counts:
        bound = min((_lower_bound(a, subs[m], U, n, batches) for m, _, a in configs(batches)), default=math.inf)
        if math.isfinite(bound):
            bounds.append((bound, batches))
    best: Choice | None = None
    for bound, batches in sorted(bounds):
        if best is not None and bound >= best.latency:
            break
        table = new_table(S, U, len(subs))
        skip = set()
        for m, cfg, arrays in configs(batches):
            if (m, cfg.dp, cfg.tp, cfg.candidate, cfg.zero) in skip:
                continue
            table.configs.append(cfg)
            if fill(table, m, arrays, len(table.configs) - 1, limit=model.limit, batches=batches,
                    schedule=model.options.schedule) and not cfg.recompute:
                skip.add((m, cfg.dp, cfg.tp, cfg.candidate, cfg.zero))  # recomputing would only be slower
        if not np.isfinite(table.times).any():
            continue
        dp_start = time.perf_counter()
        try:
            sol = solve_stages(stage_times=table.dp_times(), submesh_devices=subs, total_devices=n,
                               num_microbatches=batches, cutoff=best.latency if best else math.inf)
        except InfeasibleError:
            continue
        finally:
            model.timings["stage DP"] = model.timings.get("stage DP", 0.0) + time.perf_counter() - dp_start
        if sol is not None and (best is None or sol.latency < best.latency):
            count = len(sol.stages)
            stages = [(i, j, subs[m], table.configs[table.config[m, count - k - 1, i, j]])
                      for k, (i, j, m) in enumerate(sol.stages)]
            best = Choice(stages, batches, sol.latency, list(sol.stage_times), sol.bubble_fraction, "autopar")
    model.timings["search"] = time.perf_counter() - start
    if best is None:
        raise InfeasibleError(_infeasible_message(model))
    return best


def _infeasible_message(model) -> str:
    return (f"no pipeline of {model.units} units on {model.cluster.num_devices} devices fits in"
            f" {model.limit / 2**30:.1f} GiB per device with any micro-batch count, ZeRO stage or"
            " recomputation: add devices, raise Options(memory_fraction=...), or use a smaller batch")


def evaluate_uniform(model: PipelineModel, *, tp: int, pp: int, batches: int, zero: int, recompute: bool,
                     candidate: str = "megatron") -> Choice | None:
    """A Megatron-style pipeline: ``pp`` equal stages of ``devices/pp`` devices, each on
    ``(dp, tp)`` with the same configuration; None when it does not exist or fit."""
    n = model.cluster.num_devices
    U = model.units
    if U % pp or n % pp or (n // pp) % tp or (n // pp) not in model.submeshes or tp not in model.tps(n // pp):
        return None
    dp = n // pp // tp
    b = model.microbatch(dp, batches)
    if b is None or (zero and dp == 1) or zero not in model.zero_stages(dp):
        return None
    index = model.candidate_names.get(tp, {}).get(candidate) if tp in model.candidates else None
    if index is None:
        model.ensure_candidates(tp)
        index = model.candidate_names[tp][candidate]
    cfg = Config(dp, tp, index, zero, recompute)
    arrays = model.arrays(cfg, b, batches)
    if arrays is None:
        return None
    size = U // pp
    stages, times = [], []
    for k in range(pp):
        i, j = k * size, (k + 1) * size - 1
        flight = int(in_flight(pp - k, batches=batches, schedule=model.options.schedule))
        if arrays.fixed_memory[i, j] + flight * arrays.per_microbatch_memory[i, j] > model.limit:
            return None
        stages.append((i, j, n // pp, cfg))
        times.append(float(arrays.time[i, j]))
    latency = (batches - 1) * max(times) + sum(times)
    return Choice(stages, batches, latency, times, _bubble(times, [n // pp] * pp, batches, latency, n),
                  f"megatron(tp={tp},pp={pp},dp={dp},B={batches},zero={zero},recompute={recompute})")


def grid_search(model: PipelineModel) -> Choice:
    """The fastest evenly split Megatron configuration: tp, pp, B, ZeRO 0/1/3, recomputation."""
    start = time.perf_counter()
    n = model.cluster.num_devices
    best = None
    for pp in [p for p in _divisors(model.units) if n % p == 0]:
        for tp in model.tps(n // pp) if (n // pp) in model.submeshes else []:
            for batches in model.batch_counts:
                for zero in model.zero_stages((n // pp) // tp):
                    for rc in model.recompute_choices():
                        choice = evaluate_uniform(model, tp=tp, pp=pp, batches=batches, zero=zero, recompute=rc)
                        if choice is not None and (best is None or choice.latency < best.latency):
                            best = choice
    model.timings["grid"] = time.perf_counter() - start
    if best is None:
        raise InfeasibleError("no Megatron configuration fits: " + _infeasible_message(model))
    return best


def plan_inter(captured, cluster, options, *, name: str = "autopar"):
    """Plan ``captured`` on ``cluster`` with pipeline stages (module docstring)."""
    start = time.perf_counter()
    model = build_model(captured, cluster, options)
    choice = search(model)
    return build_pipeline_plan(model, choice, name=name, solve_time=time.perf_counter() - start)


__all__ = ["Choice", "PipelineModel", "build_model", "evaluate_uniform", "grid_search", "plan_inter",
           "search", "submesh_sizes", "uses_pipeline"]
