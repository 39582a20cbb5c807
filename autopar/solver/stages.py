"""Inter-op planning: split layers into pipeline stages on sub-meshes (Alpa's training DP), numpy only.

Input: ``stage_cost[i, j, m]``, the time per micro-batch of layers ``i..j`` (inclusive) on
sub-mesh ``m`` (``np.inf`` where it does not fit), the device count of every sub-mesh, the
total device count ``D`` and the number of micro-batches ``B``. A stage that ends after layer
``j < L−1`` also pays ``boundary_cost[j]``, the time to send its output to the next stage, so
its time is ``t = stage_cost[i, j, m] + boundary_cost[j]``. Stages are contiguous, cover every
layer, and their sub-meshes use exactly ``D`` devices. The latency of one step is the
GPipe/1F1B formula::

    latency = (B − 1) · max_s t_s + Σ_s t_s

For a bound ``t_max`` on the slowest stage, ``Σ*(t_max)``, the least total over plans whose
stages are all ``≤ t_max``, is a DP over (first layer, devices left) — :func:`_min_total`.
The optimum is ``min over t_max of (B − 1)·t_max + Σ*(t_max)`` over the distinct stage times.
Rather than one DP per distinct time, :func:`_search` bisects the sorted times between the
bottleneck (:func:`_bottleneck`, the smallest achievable slowest stage) and the slowest stage
of the least-total plan. Each DP at ``t`` returns a plan whose slowest stage ``t' ≤ t`` has
total ``Σ*(t)``, which settles every bound in ``[t', t]`` (and every bound above ``t`` when
``Σ*`` is already as low there as it gets); a range of bounds
``[t_lo, t_hi]`` is dropped once ``(B − 1)·t_lo + Σ*(just above t_hi)`` cannot beat the best
latency found. The answer is exact.

Example::

    plan = solve_stages(stage_cost=table, submesh_devices=[1, 2, 4, 8], total_devices=8,
                        num_microbatches=16)
    plan.stages          # ((0, 11, 2), (12, 23, 2)): layers 0..11 and 12..23, 4 devices each
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Mapping

import numpy as np

from autopar.core.errors import InfeasibleError, SolverInputError


@dataclass(frozen=True)
class StagePlan:
    """Stages as ``(first_layer, last_layer, submesh_index)``, inclusive, in pipeline order."""

    stages: tuple[tuple[int, int, int], ...]
    stage_times: tuple[float, ...]  # per micro-batch, boundary communication included
    latency: float  # (B − 1) · max_stage + Σ stage_times
    max_stage: float
    bubble_fraction: float  # idle share of all device-time during the step
    num_microbatches: int

    def __post_init__(self):
        if not self.stages or len(self.stages) != len(self.stage_times):
            raise SolverInputError("a StagePlan needs at least one stage and one time per stage")
        expected = 0
        for first, last, _ in self.stages:
            if first != expected or last < first:
                raise SolverInputError(f"stages must be contiguous from layer 0, got {self.stages}")
            expected = last + 1
        if self.num_microbatches < 1 or not 0 <= self.bubble_fraction <= 1:
            raise SolverInputError("num_microbatches must be ≥ 1 and bubble_fraction in [0, 1]")


@dataclass
class _Table:
    times: np.ndarray  # (L, L, M) stage times with boundaries, inf where impossible
    units: np.ndarray  # (M,) devices per sub-mesh in units of the gcd
    total_units: int
    devices: np.ndarray
    total_devices: int


def _prepare(stage_cost, submesh_devices, total_devices, boundary_cost) -> _Table:
    cost = np.array(stage_cost, dtype=np.float64)
    if cost.ndim != 3 or cost.shape[0] != cost.shape[1] or cost.shape[0] == 0 or cost.shape[2] == 0:
        raise SolverInputError(f"stage_cost must have shape (L, L, num_submeshes), got {cost.shape}")
    num_layers, _, num_meshes = cost.shape
    upper = np.triu(np.ones((num_layers, num_layers), bool))
    if np.isnan(cost).any() or (cost[upper] < 0).any():
        raise SolverInputError("stage_cost must be ≥ 0 (np.inf for 'does not fit') and contain no NaN")
    devices = np.array(submesh_devices)
    if devices.shape != (num_meshes,) or not np.issubdtype(devices.dtype, np.integer) or (devices < 1).any():
        raise SolverInputError(f"submesh_devices must be {num_meshes} positive integers, got {submesh_devices!r}")
    if isinstance(total_devices, bool) or not isinstance(total_devices, (int, np.integer)) or total_devices < 1:
        raise SolverInputError(f"total_devices must be a positive integer, got {total_devices!r}")
    after = np.zeros(num_layers)
    if boundary_cost is not None:
        boundary = np.array(boundary_cost, dtype=np.float64)
        if boundary.shape != (num_layers - 1,) or not np.isfinite(boundary).all() or (boundary < 0).any():
            raise SolverInputError(
                f"boundary_cost must hold {num_layers - 1} finite non-negative times (after layers "
                f"0..{num_layers - 2}), got shape {boundary.shape}"
            )
        after[:-1] = boundary
    times = np.where(upper[:, :, None], cost + after[None, :, None], np.inf)
    times[:, :, devices > total_devices] = np.inf
    unit = reduce(math.gcd, [int(d) for d in devices], int(total_devices))
    return _Table(times, (devices // unit).astype(np.int64), int(total_devices) // unit, devices, int(total_devices))


def _dp(times: np.ndarray, units: np.ndarray, total_units: int, combine) -> tuple[float, list]:
    """Best value of layers 0..L−1 on exactly ``total_units``: value[i, d] over the first stage (i..j, m)."""
    num_layers, _, num_meshes = times.shape
    width = total_units + 1
    value = np.full((num_layers + 1, width), np.inf)
    value[num_layers, 0] = 0.0
    shifted = np.full((num_meshes, num_layers + 1, width), np.inf)  # [m, j, d] = value[j, d − units[m]]
    source = np.arange(width)[None, :] - units[:, None]
    valid = source >= 0
    source = np.clip(source, 0, None)

    def shift(row: int) -> None:
        shifted[:, row, :] = np.where(valid, value[row][source], np.inf)

    shift(num_layers)
    choice = np.zeros((num_layers, width), np.int64)
    columns = np.arange(width)
    finite = np.isfinite(times).any(axis=2)
    # A stage from layer i ends at most at the last j with a finite time: slice the rest away.
    last = np.where(finite.any(axis=1), num_layers - 1 - np.argmax(finite[:, ::-1], axis=1), -1)
    for i in range(num_layers - 1, -1, -1):
        if last[i] >= i:
            stage = times[i, i : last[i] + 1, :].T[:, :, None]  # (M, span, 1)
            candidates = combine(stage, shifted[:, i + 1 : last[i] + 2, :]).reshape(-1, width)
            best = np.argmin(candidates, axis=0)
            value[i] = candidates[best, columns]
            choice[i] = best
            shift(i)
    if not np.isfinite(value[0, total_units]):
        return math.inf, []
    stages, i, d = [], 0, total_units
    while i < num_layers:
        m, offset = divmod(int(choice[i, d]), int(last[i]) - i + 1)
        stages.append((i, i + offset, m))
        d -= int(units[m])
        i += offset + 1
    return float(value[0, total_units]), stages


def _min_total(table: _Table, bound: float) -> tuple[float, list]:
    """Σ*(bound): the least total stage time over plans whose every stage takes ≤ bound."""
    times = np.where(table.times <= bound, table.times, np.inf)
    return _dp(times, table.units, table.total_units, np.add)


def _bottleneck(table: _Table) -> float:
    """The smallest achievable slowest-stage time."""
    return _dp(table.times, table.units, table.total_units, np.maximum)[0]


def _stage_times(table: _Table, stages) -> list[float]:
    return [float(table.times[i, j, m]) for i, j, m in stages]


def _search(table: _Table, batches: int) -> list:
    """Exact minimum of (B − 1)·max + Σ by bisection over slowest-stage bounds (module docstring)."""
    total, stages = _min_total(table, math.inf)
    if not stages:
        return []
    best_latency = (batches - 1) * max(_stage_times(table, stages)) + total
    best = stages
    if batches == 1:
        return best
    values = np.unique(table.times[np.isfinite(table.times)])
    top = max(_stage_times(table, stages))
    bounds = values[(values >= _bottleneck(table)) & (values < top)]
    pending = [(0, len(bounds) - 1, total)]  # (lo, hi, Σ* just above bounds[hi]) — a lower bound
    while pending:
        lo, hi, floor = pending.pop()
        if lo > hi or (batches - 1) * bounds[lo] + floor >= best_latency * (1 - 1e-12):
            continue
        mid = (lo + hi) // 2
        total, stages = _min_total(table, bounds[mid])
        if not stages:
            pending.append((mid + 1, hi, floor))
            continue
        slowest = max(_stage_times(table, stages))
        latency = (batches - 1) * slowest + total
        if latency < best_latency:
            best_latency, best = latency, stages
        if total > floor * (1 + 1e-12):  # else Σ* is flat above mid: those bounds cannot win
            pending.append((mid + 1, hi, floor))
        pending.append((lo, int(np.searchsorted(bounds, slowest)) - 1, total))
    return best


def _plan(table: _Table, stages, batches: int) -> StagePlan:
    times = _stage_times(table, stages)
    slowest = max(times)
    latency = (batches - 1) * slowest + sum(times)
    busy = batches * sum(t * int(table.devices[m]) for t, (_, _, m) in zip(times, stages))
    bubble = 1.0 - busy / (latency * table.total_devices) if latency > 0 else 0.0
    return StagePlan(
        stages=tuple((int(i), int(j), int(m)) for i, j, m in stages),
        stage_times=tuple(times),
        latency=float(latency),
        max_stage=float(slowest),
        bubble_fraction=float(min(max(bubble, 0.0), 1.0)),
        num_microbatches=batches,
    )


def solve_stages(
    *, stage_cost, submesh_devices, total_devices: int, num_microbatches: int, boundary_cost=None
) -> StagePlan:
    """The stage partition and sub-mesh per stage of least pipeline latency (exact).

    Raises :class:`InfeasibleError` when no partition fits on exactly ``total_devices``.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, (int, np.integer)) or num_microbatches < 1:
        raise SolverInputError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    table = _prepare(stage_cost, submesh_devices, total_devices, boundary_cost)
    stages = _search(table, int(num_microbatches))
    if not stages:
        raise InfeasibleError(
            f"no split of {table.times.shape[0]} layers into stages uses exactly {total_devices} devices "
            "with every stage fitting its sub-mesh (all such stage costs are inf). Add devices or sub-mesh "
            "shapes, allow more sharding/recomputation inside stages, or use more micro-batches."
        )
    return _plan(table, stages, int(num_microbatches))


def solve_stages_over_microbatches(
    *, stage_costs: Mapping[int, np.ndarray], submesh_devices, total_devices: int, boundary_cost=None
) -> StagePlan:
    """Best plan over several micro-batch counts, given a stage-cost table per count.

    ``stage_costs[B]`` holds per-micro-batch times when the batch is cut into ``B`` pieces, so
    latencies compare directly. ``boundary_cost`` is one array for all counts or a mapping
    from count to array. Ties go to the fewer micro-batches.
    """
    if not stage_costs:
        raise SolverInputError("stage_costs needs at least one micro-batch count")
    best = None
    for batches in sorted(stage_costs):
        boundary = boundary_cost.get(batches) if isinstance(boundary_cost, Mapping) else boundary_cost
        try:
            plan = solve_stages(
                stage_cost=stage_costs[batches],
                submesh_devices=submesh_devices,
                total_devices=total_devices,
                num_microbatches=batches,
                boundary_cost=boundary,
            )
        except InfeasibleError:
            continue
        if best is None or plan.latency < best.latency:
            best = plan
    if best is None:
        raise InfeasibleError(
            f"no micro-batch count in {sorted(stage_costs)} has a stage split that fits on exactly "
            f"{total_devices} devices; add devices, allow more sharding or recomputation, or try more "
            "micro-batches."
        )
    return best
