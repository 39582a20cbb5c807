"""Exhaustive reference answers for the two solvers, for tests on small problems only.

:func:`brute_force_ilp` scores every strategy assignment (numpy, in chunks) and
:func:`brute_force_stages` every partition of the pipeline units into stages with every
sub-mesh assignment. Both refuse problems too large to enumerate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import SolverInputError
from autopar.solver.problem import ILPProblem

MAX_ASSIGNMENTS = 5_000_000
_CHUNK = 1 << 18


@dataclass(frozen=True, eq=False)
class BruteForceILP:
    """Best assignment under the memory limit (None and inf if none fits) and the smallest peak."""

    choice: np.ndarray | None
    objective: float
    min_peak: float


def brute_force_ilp(problem: ILPProblem) -> BruteForceILP:
    """Score every assignment that honours the ties; keep the cheapest one within the limit."""
    sizes = np.array([len(c) for c in problem.node_costs])
    total = int(np.prod(sizes, dtype=np.float64))
    if total > MAX_ASSIGNMENTS:
        raise SolverInputError(f"{total} assignments is too many to enumerate (limit {MAX_ASSIGNMENTS})")
    limit = problem.memory_limit
    best_cost, best_choice, min_peak = np.inf, None, np.inf
    for start in range(0, total, _CHUNK):
        flat = np.arange(start, min(start + _CHUNK, total))
        choice = np.stack(np.unravel_index(flat, sizes), axis=1) if len(sizes) else np.zeros((1, 0), int)
        ok = np.ones(len(flat), bool)
        for u, v in problem.ties:
            ok &= choice[:, u] == choice[:, v]
        cost = np.zeros(len(flat))
        for i, c in enumerate(problem.node_costs):
            cost += c[choice[:, i]]
        for u, v, matrix in problem.edges:
            cost += matrix[choice[:, u], choice[:, v]]
        peak = np.zeros(len(flat))
        for row in problem.memory_rows:
            live = np.full(len(flat), row.constant)
            for i, vector in row.terms:
                live += vector[choice[:, i]]
            peak = np.maximum(peak, live)
        if ok.any():
            min_peak = min(min_peak, float(peak[ok].min()))
        if limit is not None:
            ok &= peak <= limit
        if ok.any():
            index = np.flatnonzero(ok)[np.argmin(cost[ok])]
            if cost[index] < best_cost:
                best_cost, best_choice = float(cost[index]), choice[index].copy()
    return BruteForceILP(choice=best_choice, objective=best_cost, min_peak=min_peak)


def brute_force_stages(
    *, stage_times: np.ndarray, submesh_devices, total_devices: int, num_microbatches: int
) -> tuple[float, tuple[tuple[int, int, int], ...] | None]:
    """(best latency, its stages) over every split into contiguous stages and every sub-mesh per
    stage, the ``k``-th stage from the end timed at ``stage_times[k − 1]``; (inf, None) if none."""
    stage_times = np.asarray(stage_times, dtype=np.float64)
    positions, units, _, num_meshes = stage_times.shape
    devices = list(submesh_devices)
    if 2 ** (units - 1) * num_meshes**units > MAX_ASSIGNMENTS:
        raise SolverInputError("too many stage partitions to enumerate")
    best, best_stages = np.inf, None
    for cuts in itertools.product((False, True), repeat=units - 1):
        bounds = [0] + [j + 1 for j, cut in enumerate(cuts) if cut] + [units]
        spans = [(bounds[k], bounds[k + 1] - 1) for k in range(len(bounds) - 1)]
        if len(spans) > positions:
            continue
        for meshes in itertools.product(range(num_meshes), repeat=len(spans)):
            if sum(devices[m] for m in meshes) != total_devices:
                continue
            times = [stage_times[len(spans) - k - 1, i, j, m] for k, ((i, j), m) in enumerate(zip(spans, meshes))]
            if not np.isfinite(times).all():
                continue
            latency = (num_microbatches - 1) * max(times) + sum(times)
            if latency < best:
                best, best_stages = latency, tuple((i, j, m) for (i, j), m in zip(spans, meshes))
    return float(best), best_stages
