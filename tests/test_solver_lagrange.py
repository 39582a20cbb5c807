"""The Lagrangian search under one memory row (:mod:`autopar.solver.lagrange`): its floor is
never above the optimum, its plan fits and costs what it says, and solve_ilp takes that plan
without the ILP only where it is within the gap of the floor."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.solver import ILPProblem, MemoryRow, solve_ilp
from autopar.solver.brute_force import brute_force_ilp
from autopar.solver.lagrange import lagrangian
from test_solver_ilp import random_graph


def one_row(seed: int) -> ILPProblem:
    """A random graph with one memory row over every node, its limit between the least and the
    unbounded optimum's bytes."""
    problem = random_graph(seed, ties=False, memory=False)
    rng = np.random.default_rng(seed)
    row = MemoryRow(terms=tuple((i, rng.random(len(c)) * 1e9) for i, c in enumerate(problem.node_costs)))
    problem = dataclasses.replace(problem, memory_rows=[row])
    free = brute_force_ilp(problem)
    low, high = free.min_peak, problem.peak_of(free.choice)
    return dataclasses.replace(problem, memory_limit=low + rng.uniform(0.1, 0.9) * (high - low))


def _parts(problem: ILPProblem):
    memory = [t for _, t in problem.memory_rows[0].terms]
    return problem.node_costs, memory, problem.edges, problem.memory_limit


@pytest.mark.parametrize("max_entries", [4, 1 << 16])
@pytest.mark.parametrize("seed", range(25))
def test_the_floor_is_below_the_optimum_and_the_plan_fits(seed, max_entries):
    problem = one_row(seed)
    best = brute_force_ilp(problem)
    found = lagrangian(*_parts(problem), gap=0.0, max_entries=max_entries)
    assert found.floor <= best.objective * (1 + 1e-12)
    if found.choice is not None:
        assert problem.peak_of(found.choice) <= problem.memory_limit
        assert found.cost == pytest.approx(problem.objective_of(found.choice), rel=1e-12)
        assert found.cost >= best.objective * (1 - 1e-12)


def test_a_knapsack_with_no_duality_gap_is_solved_without_the_ilp():
    """Ten equal nodes, each free and 10 bytes or 1 second and 1 byte, within 64 bytes: at the
    price 1/9 s a byte both choices cost alike, so the floor reaches the optimum (four nodes lean:
    4 s), which the plan of every node lean reaches by spending the bytes it leaves."""
    problem = ILPProblem(node_costs=[np.array([0.0, 1.0])] * 10, edges=[],
                         memory_rows=[MemoryRow(terms=tuple((i, np.array([10.0, 1.0])) for i in range(10)))],
                         memory_limit=64.0)
    solution = solve_ilp(problem, relative_gap=1e-3)
    assert solution.backend == "lagrangian" and solution.optimal
    assert solution.objective == 4.0 and solution.peak_memory <= 64.0
    assert solution.objective == brute_force_ilp(problem).objective


@pytest.mark.parametrize("seed", range(12))
def test_solve_ilp_within_the_gap_whichever_way_it_solves(seed):
    problem = one_row(seed)
    best = brute_force_ilp(problem).objective
    solution = solve_ilp(problem, relative_gap=1e-2)
    assert best * (1 - 1e-12) <= solution.objective <= best * (1 + 1e-2)
    assert solution.peak_memory <= problem.memory_limit
