"""The fastest plan among those of least memory (autopar.solver.least) against exhaustive enumeration."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.solver import ILPProblem, MemoryRow, backends
from autopar.solver.brute_force import brute_force_ilp
from autopar.solver.least import least_memory
from tests.test_solver_ilp import random_graph


def coarse_rows(problem: ILPProblem, seed: int, rows: int) -> ILPProblem:
    """``problem`` with ``rows`` memory rows over every node, whose bytes take few values: many
    strategies share a node's least bytes, so the time decides among them."""
    rng = np.random.default_rng(seed)
    memory = [MemoryRow(terms=tuple((i, rng.integers(1, 4, size=len(c)) * 1e9) for i, c in enumerate(problem.node_costs)),
                        constant=float(rng.integers(0, 3)) * 1e8) for _ in range(rows)]
    return dataclasses.replace(problem, memory_rows=memory, memory_limit=None)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("seed", range(10))
def test_least_memory_is_the_fastest_plan_at_the_smallest_peak(seed, rows):
    problem = coarse_rows(random_graph(seed, ties=seed % 2 == 0, memory=False), seed, rows)
    smallest = brute_force_ilp(problem).min_peak
    expected = brute_force_ilp(dataclasses.replace(problem, memory_limit=smallest * (1 + 1e-9)))
    solution = least_memory(problem, relative_gap=0.0)
    assert solution.peak_memory == pytest.approx(smallest, rel=1e-12)
    assert solution.objective == pytest.approx(expected.objective, rel=1e-9)
    assert all(solution.choice[u] == solution.choice[v] for u, v in problem.ties)


def test_least_memory_with_one_row_needs_no_branch_and_bound(monkeypatch):
    """One row: the least-bytes strategies are kept and elimination solves the rest exactly."""
    problem = coarse_rows(random_graph(3, ties=False, memory=False), 3, 1)
    monkeypatch.setattr(backends, "run", lambda *a, **k: pytest.fail("a solver ran for a one-row least-memory plan"))
    solution = least_memory(problem)
    assert solution.backend in ("elimination", "none")
    assert solution.peak_memory == pytest.approx(brute_force_ilp(problem).min_peak, rel=1e-12)


def test_one_row_smallest_peak_of_an_infeasible_solve_needs_no_second_program(monkeypatch):
    from autopar.core.errors import InfeasibleError
    from autopar.solver import solve_ilp

    problem = coarse_rows(random_graph(5, ties=True, memory=False), 5, 1)
    smallest = brute_force_ilp(problem).min_peak
    monkeypatch.setattr(backends, "run", lambda *a, **k: pytest.fail("a solver ran for the smallest peak"))
    with pytest.raises(InfeasibleError) as caught:
        solve_ilp(dataclasses.replace(problem, memory_limit=0.9 * smallest))
    assert caught.value.smallest_peak == pytest.approx(smallest, rel=1e-12)
