"""Inter-operator planning: pipeline stages on sub-meshes, micro-batches, schedule (Alpa-style).

``plan_inter`` cuts the captured graph into pipeline units and lists the sub-meshes, logical
meshes and micro-batch sizes worth trying (:mod:`autopar.planner.pipeline_model`), then searches

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

With ``Options(stage_meshes="equal")`` every stage shares one sub-mesh size and ``tp``: the
search runs once per (sub-mesh, tp) and keeps the fastest. By default (``stage_meshes="any"``)
it also searches Alpa's full space in one pass, whose DP prices a send to a stage on another mesh at the
sender's ``dp`` (:mod:`autopar.planner.stage_table`): its choice is priced again as its plan
prices the send and kept where it still beats the equal meshes. The runtime executes both.

Every evenly split Megatron configuration that :func:`grid_search` tries (tp, pp dividing the
units and the devices, dp, B, ZeRO 0/1/3, recomputation) is a point of this search space with
the same costs (the Megatron-style tp plan is one of the candidates), so autopar's predicted
step time is never above the grid's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.planner.collector import without_full_collections
from autopar.planner.pipeline_model import PipelineModel, build_model, divisors
from autopar.planner.pipeline_plan import bubble_fraction, build_pipeline_plan, repriced
from autopar.planner.stage_table import Config, StageArrays, fill, in_flight, new_table
from autopar.solver import solve_stages


def uses_pipeline(captured, cluster, options) -> bool:
    """Whether ``compile`` runs the inter-op search: ``options.pipeline``, where "auto" means
    several devices and a model with repeated layers that updates no buffer in forward (the
    pipeline runtime cannot run BatchNorm's running statistics)."""
    if options.pipeline == "auto":
        return (cluster.num_devices > 1 and len(captured.layers) >= 2
                and not any(o.kind == "buffer_mutation" for o in captured.outputs))
    return bool(options.pipeline)


@dataclass
class Choice:
    """A pipeline: stages ``(first unit, last unit, sub-mesh devices, config)`` and their costs."""

    stages: list[tuple[int, int, int, Config]]
    batches: int
    latency: float
    stage_times: list[float]
    bubble_fraction: float
    method: str


def _lower_bound(arrays: StageArrays, devices: int, units: int, total: int, batches: int) -> float:
    """A bound below every latency using this configuration: a stage of ``k`` units on ``d``
    devices takes at least ``k·ρ/d`` (ρ: its least device-time per unit), so the slowest of a
    plan's stages takes at least ``U·ρ/N`` and the latency at least ``B·U·ρ/N``."""
    lengths = np.arange(units)[None, :] - np.arange(units)[:, None] + 1
    with np.errstate(invalid="ignore"):
        per_unit = np.where(lengths > 0, arrays.time * devices / np.maximum(lengths, 1), np.inf)
    return float(batches * units * per_unit.min() / total)


def search(model: PipelineModel) -> Choice:
    """The least-latency pipeline over every batch count (module docstring): the best over each
    (sub-mesh, tp) that every stage shares and, with ``Options(stage_meshes="any")``, Alpa's full
    space if its choice, priced as its plan prices it (:func:`~autopar.planner.pipeline_plan.repriced`),
    is faster."""
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
    if model.options.stage_meshes == "any":
        try:
            free = repriced(model, _search(model))
        except InfeasibleError:
            free = None
        if free is not None and (best is None or free.latency < best.latency):
            best = free
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


def evaluate_uniform(model: PipelineModel, *, tp: int, pp: int, batches: int, zero: int, recompute: bool | str,
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
        if arrays.memory.peak(flight, batches)[i, j] > model.limit:
            return None
        stages.append((i, j, n // pp, cfg))
        times.append(float(arrays.time[i, j]))
    latency = (batches - 1) * max(times) + sum(times)
    return Choice(stages, batches, latency, times, bubble_fraction(times, [n // pp] * pp, batches, latency, n),
                  f"megatron(tp={tp},pp={pp},dp={dp},B={batches},zero={zero},recompute={recompute})")


def grid_search(model: PipelineModel) -> Choice:
    """The fastest evenly split Megatron configuration: tp, pp, B, ZeRO 0/1/3, recomputation."""
    start = time.perf_counter()
    n = model.cluster.num_devices
    best = None
    for pp in [p for p in divisors(model.units) if n % p == 0]:
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


@without_full_collections
def plan_inter(captured, cluster, options, *, name: str = "autopar"):
    """Plan ``captured`` on ``cluster`` with pipeline stages (module docstring)."""
    start = time.perf_counter()
    model = build_model(captured, cluster, options)
    choice = search(model)
    return build_pipeline_plan(model, choice, name=name, solve_time=time.perf_counter() - start)


__all__ = ["Choice", "evaluate_uniform", "grid_search", "plan_inter", "search", "uses_pipeline"]
