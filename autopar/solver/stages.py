"""Pipeline stages on sub-meshes (Alpa's training DP), numpy only: the stage times depend on
the stage's position.

Under 1F1B the ``s``-th stage from the end keeps ``min(s, B)`` micro-batches of activations, so
whether a layer range fits a sub-mesh (and whether it must recompute) depends on how many
stages follow it. The input is ``stage_times[s − 1, i, j, m]``: the time per micro-batch of
units ``i..j`` (inclusive) on sub-mesh ``m`` as the ``s``-th stage from the end (``np.inf``
where it does not fit or ``j < i``), boundary communication included. Stages are contiguous,
cover every unit and use exactly ``total_devices``. The step latency of a plan is the
GPipe/1F1B formula::

    latency = (B − 1) · max_s t_s + Σ_s t_s

For a bound ``t`` on every stage, ``Σ*(t)``, the least total, is a DP over (stages left ``s``,
first unit ``i``, devices left ``d``) (:meth:`_DP.min_total`)::

    V[0][U, 0] = 0
    V[s][i, d] = min over j ≥ i, m of  stage_times[s − 1, i, j, m] + V[s − 1][j + 1, d − devices[m]]

(stage times above ``t`` count as ``inf``), ``Σ*(t) = min_s V[s][0, D]``. The optimum is
``min over t of (B − 1)·t + Σ*(t)`` over the distinct stage times. Rather than one DP per
distinct time, :func:`_search` bisects them: each DP at ``t`` returns a plan whose slowest
stage ``t' ≤ t`` has total ``Σ*(t)``, which settles every bound in ``[t', t]`` (and every bound
above ``t`` when ``Σ*`` is already as low there as it gets); a range of bounds
``[t_lo, t_hi]`` is dropped once ``(B − 1)·t_lo + Σ*(just above t_hi)`` cannot beat the best
latency found. The answer is exact.

Example::

    plan = solve_stages(stage_times=table, submesh_devices=[1, 2, 4, 8], total_devices=8,
                        num_microbatches=16)
    plan.stages          # ((0, 11, 2), (12, 23, 2)): units 0..11 and 12..23, 4 devices each
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from autopar.core.errors import InfeasibleError, SolverInputError


@dataclass(frozen=True)
class StagePlan:
    """Stages as ``(first_unit, last_unit, submesh_index)``, inclusive, in pipeline order."""

    stages: tuple[tuple[int, int, int], ...]
    stage_times: tuple[float, ...]  # per micro-batch, in pipeline order
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
                raise SolverInputError(f"stages must be contiguous from unit 0, got {self.stages}")
            expected = last + 1
        if self.num_microbatches < 1 or not 0 <= self.bubble_fraction <= 1:
            raise SolverInputError("num_microbatches must be ≥ 1 and bubble_fraction in [0, 1]")


def _check(stage_times, submesh_devices, total_devices, num_microbatches):
    times = np.array(stage_times, dtype=np.float64)
    if times.ndim != 4 or times.shape[1] != times.shape[2] or 0 in times.shape:
        raise SolverInputError(f"stage_times must have shape (S, U, U, M), got {times.shape}")
    if np.isnan(times).any() or (times < 0).any():
        raise SolverInputError("stage_times must be ≥ 0 (np.inf for 'does not fit') without NaN")
    devices = np.array(submesh_devices)
    if devices.shape != (times.shape[3],) or not np.issubdtype(devices.dtype, np.integer) or (devices < 1).any():
        raise SolverInputError(f"submesh_devices must be {times.shape[3]} positive integers, got {submesh_devices!r}")
    if isinstance(total_devices, bool) or not isinstance(total_devices, (int, np.integer)) or total_devices < 1:
        raise SolverInputError(f"total_devices must be a positive integer, got {total_devices!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, (int, np.integer)) \
            or num_microbatches < 1:
        raise SolverInputError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    upper = np.triu(np.ones(times.shape[1:3], bool))
    times = np.where(upper[None, :, :, None], times, np.inf)
    times[:, :, :, devices > total_devices] = np.inf
    return times, devices.astype(np.int64)


class _DP:
    def __init__(self, times: np.ndarray, devices: np.ndarray, total: int):
        self.times = times
        unit = reduce(math.gcd, [int(d) for d in devices], int(total))
        self.units = devices // unit
        self.width = int(total) // unit + 1
        self.num_stages, self.num_units, _, self.num_meshes = times.shape
        source = np.arange(self.width)[None, :] - self.units[:, None]
        self.valid = source >= 0
        self.source = np.clip(source, 0, None)

    def min_total(self, bound: float) -> tuple[float, list]:
        """Σ*(bound) and a plan reaching it (empty when none exists)."""
        S, U, M, W = self.num_stages, self.num_units, self.num_meshes, self.width
        times = np.where(self.times <= bound, self.times, np.inf)
        value = np.full((U + 1, W), np.inf)
        value[U, 0] = 0.0
        choices, best, best_s = [], math.inf, 0
        for s in range(min(S, U)):
            # The stage s+1-th from the end starts at i and ends at j ≤ U − 1 − s: the s stages
            # after it need a unit each. shifted[j, m, d] = value[j + 1, d − units[m]].
            top = U - s
            shifted = np.where(self.valid[None, :, :], value[1:top + 1, :][:, self.source], np.inf)
            cand = times[s][:top, :top, :, None] + shifted[None, :, :, :]  # (i, j, m, d)
            cand = cand.reshape(top, top * M, W)
            arg = np.argmin(cand, axis=1)
            value = np.full((U + 1, W), np.inf)
            value[:top] = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
            choices.append((arg, top))
            if value[0, W - 1] < best:
                best, best_s = float(value[0, W - 1]), s + 1
            if not np.isfinite(value).any():
                break
        if not math.isfinite(best):
            return math.inf, []
        stages, i, d = [], 0, W - 1
        for s in range(best_s, 0, -1):
            arg, top = choices[s - 1]
            j, m = divmod(int(arg[i, d]), M)
            stages.append((i, j, m, s))
            d -= int(self.units[m])
            i = j + 1
        return best, stages

    def stage_times(self, stages) -> list[float]:
        return [float(self.times[s - 1, i, j, m]) for i, j, m, s in stages]


def _search(dp: _DP, batches: int, cutoff: float) -> list:
    """Exact minimum of (B − 1)·max + Σ by bisection over slowest-stage bounds (module
    docstring); empty when no plan beats ``cutoff``."""
    total, stages = dp.min_total(math.inf)
    if not stages:
        return []
    best_latency = (batches - 1) * max(dp.stage_times(stages)) + total
    best = stages
    if best_latency >= cutoff:
        best_latency, best = cutoff, []
    if batches == 1:
        return best
    values = np.unique(dp.times[np.isfinite(dp.times)])
    top = max(dp.stage_times(stages))
    bounds = values[values < top]
    pending = [(0, len(bounds) - 1, total)]
    while pending:
        lo, hi, floor = pending.pop()
        if lo > hi or (batches - 1) * bounds[lo] + floor >= best_latency * (1 - 1e-12):
            continue
        mid = (lo + hi) // 2
        total, stages = dp.min_total(bounds[mid])
        if not stages:
            pending.append((mid + 1, hi, floor))
            continue
        slowest = max(dp.stage_times(stages))
        latency = (batches - 1) * slowest + total
        if latency < best_latency:
            best_latency, best = latency, stages
        if total > floor * (1 + 1e-12):
            pending.append((mid + 1, hi, floor))
        pending.append((lo, int(np.searchsorted(bounds, slowest)) - 1, total))
    return best


def solve_stages(*, stage_times, submesh_devices, total_devices: int, num_microbatches: int,
                 cutoff: float = math.inf) -> StagePlan | None:
    """The least-latency stages (module docstring); raises InfeasibleError when none fits.
    With a ``cutoff`` latency (say, the best found for another micro-batch count) it returns
    None when no plan is faster, often after far fewer DPs."""
    times, devices = _check(stage_times, submesh_devices, total_devices, num_microbatches)
    dp = _DP(times, devices, int(total_devices))
    stages = _search(dp, int(num_microbatches), cutoff)
    if not stages and math.isfinite(cutoff) and dp.min_total(math.inf)[1]:
        return None
    if not stages:
        raise InfeasibleError(
            f"no split of {times.shape[1]} pipeline units into stages uses exactly {total_devices} devices"
            " with every stage fitting in memory; add devices, allow recomputation or sharded"
            " parameters, or use more micro-batches")
    t = dp.stage_times(stages)
    slowest = max(t)
    batches = int(num_microbatches)
    latency = (batches - 1) * slowest + sum(t)
    busy = batches * sum(x * int(devices[m]) for x, (_, _, m, _) in zip(t, stages))
    bubble = 1.0 - busy / (latency * int(total_devices)) if latency > 0 else 0.0
    return StagePlan(tuple((int(i), int(j), int(m)) for i, j, m, _ in stages), tuple(t), float(latency),
                     float(slowest), float(min(max(bubble, 0.0), 1.0)), batches)


__all__ = ["StagePlan", "solve_stages"]
