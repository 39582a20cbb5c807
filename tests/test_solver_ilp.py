"""The strategy ILP (both backends) against exhaustive enumeration on seeded random graphs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.core.errors import InfeasibleError, SolverInputError, SolverTimeoutError
from autopar.core.options import BACKENDS
from autopar.solver import ILPProblem, MemoryRow, backends, solve_ilp
from autopar.solver.brute_force import brute_force_ilp

MODES = ["none", "binding", "infeasible"]


def random_graph(seed: int, *, ties: bool, memory: bool) -> ILPProblem:
    """≤ 12 nodes × ≤ 4 strategies: a chain, skip edges, a few random DAG edges."""
    rng = np.random.default_rng(seed)
    while True:
        n = int(rng.integers(3, 13))
        sizes = rng.integers(1, 5, size=n)
        if np.prod(sizes.astype(float)) <= 2e5 and (sizes > 1).sum() >= 2:
            break
    costs = [rng.random(k) * rng.choice([1e-3, 1.0]) for k in sizes]
    edges = []
    for v in range(1, n):
        edges.append((v - 1, v, rng.random((sizes[v - 1], sizes[v]))))
        if v >= 2 and rng.random() < 0.5:
            edges.append((v - 2, v, rng.random((sizes[v - 2], sizes[v]))))
    for _ in range(int(rng.integers(0, 4))):
        u, v = sorted(rng.choice(n, 2, replace=False).tolist())
        edges.append((u, v, rng.random((sizes[u], sizes[v])) * (rng.random((sizes[u], sizes[v])) < 0.6)))
    tied = []
    if ties:
        for k in np.unique(sizes):
            same = np.flatnonzero(sizes == k)
            tied += [(int(same[a]), int(same[a + 1])) for a in range(len(same) - 1) if rng.random() < 0.7]
    rows = []
    if memory:
        for _ in range(int(rng.integers(1, 5))):
            members = rng.choice(n, size=int(rng.integers(1, min(n, 5) + 1)), replace=False)
            terms = tuple((int(i), rng.random(sizes[i]) * 1e9) for i in members)
            rows.append(MemoryRow(terms=terms, constant=float(rng.random() * 1e8)))
    return ILPProblem(node_costs=costs, edges=edges, memory_rows=rows, ties=tied)


def with_limit(problem: ILPProblem, mode: str, seed: int) -> ILPProblem:
    if mode == "none" or not problem.memory_rows:
        return problem
    free = brute_force_ilp(problem)
    low, high = free.min_peak, problem.peak_of(free.choice)
    if mode == "infeasible":
        return dataclasses.replace(problem, memory_limit=0.97 * low)
    fraction = np.random.default_rng(seed).uniform(0.1, 0.9)
    return dataclasses.replace(problem, memory_limit=low + fraction * (high - low))


CASES = [(seed, mode) for seed in range(12) for mode in MODES]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed,mode", CASES)
def test_ilp_objective_equals_brute_force(seed, mode, backend):
    problem = with_limit(random_graph(seed, ties=seed % 2 == 0, memory=mode != "none"), mode, seed)
    expected = brute_force_ilp(problem)
    if not np.isfinite(expected.objective):
        with pytest.raises(InfeasibleError) as caught:
            solve_ilp(problem, backend=backend, relative_gap=0.0)
        assert caught.value.smallest_peak == pytest.approx(expected.min_peak, rel=1e-6)
        return
    solution = solve_ilp(problem, backend=backend, relative_gap=0.0)
    assert solution.objective == pytest.approx(expected.objective, rel=1e-6)
    assert solution.objective == pytest.approx(problem.objective_of(solution.choice), rel=1e-12)
    assert all(solution.choice[u] == solution.choice[v] for u, v in problem.ties)
    if problem.memory_limit is not None:
        assert solution.peak_memory <= problem.memory_limit * (1 + 1e-7)
    assert solution.optimal and solution.gap <= 1e-6


def test_a_cutoff_under_the_optimum_ends_the_solve_cut_and_one_over_it_changes_nothing():
    """``cutoff``: where the optimum is not below it the solve may end early with status "cut" and
    a plan at or over it (by the Lagrangian's floor or HiGHS's bound); where it is, the optimum."""
    how = set()
    for seed, mode in CASES:
        problem = with_limit(random_graph(seed, ties=seed % 2 == 0, memory=True), "binding", seed)
        best = brute_force_ilp(problem).objective
        over = solve_ilp(problem, relative_gap=0.0, cutoff=best * 1.01)
        assert over.status != "cut" and over.objective == pytest.approx(best, rel=1e-6)
        under = solve_ilp(problem, relative_gap=0.0, cutoff=best * 0.99)
        if under.status == "cut":
            how.add(under.backend)
            assert under.objective >= best * 0.99 and not under.optimal
        else:
            assert under.objective == pytest.approx(best, rel=1e-6)
    assert how == {"lagrangian", "highs"}


def test_random_cases_cover_infeasible_binding_and_tied_problems():
    """The parametrised cases above exercise every branch they claim to."""
    kinds = set()
    for seed, mode in CASES:
        problem = with_limit(random_graph(seed, ties=seed % 2 == 0, memory=mode != "none"), mode, seed)
        expected = brute_force_ilp(problem)
        free = brute_force_ilp(dataclasses.replace(problem, memory_limit=None))
        if not np.isfinite(expected.objective):
            kinds.add("infeasible")
        elif expected.objective > free.objective * (1 + 1e-9):
            kinds.add("memory changes the answer")
        if problem.ties:
            kinds.add("ties")
    assert kinds == {"infeasible", "memory changes the answer", "ties"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible_message_says_how_far_over_and_what_to_do(backend):
    row = MemoryRow(terms=((0, np.array([6.0, 4.0]) * 2**30), (1, np.array([3.0, 5.0]) * 2**30)))
    problem = ILPProblem(
        node_costs=[np.array([0.0, 1.0]), np.array([0.0, 1.0])],
        edges=[(0, 1, np.array([[0.0, 2.0], [2.0, 0.0]]))],
        memory_rows=[row],
        memory_limit=6.0 * 2**30,
    )
    with pytest.raises(InfeasibleError) as caught:
        solve_ilp(problem, backend=backend)
    assert caught.value.smallest_peak == pytest.approx(7.0 * 2**30)  # strategies (1, 0): 4 + 3 GiB
    message = str(caught.value)
    assert "7.000 GiB" in message and "1.000 GiB over" in message and "more devices" in message


def test_memory_row_over_the_limit_for_every_plan_raises_without_the_main_solve():
    row = MemoryRow(terms=((0, np.array([1.0, 2.0])),), constant=10.0)
    problem = ILPProblem(node_costs=[np.array([1.0, 0.0])], memory_rows=[row], memory_limit=5.0)
    with pytest.raises(InfeasibleError) as caught:
        solve_ilp(problem)
    assert caught.value.smallest_peak == 11.0


def test_trivial_problems_do_not_call_a_solver(monkeypatch):
    def no_solver(*args, **kwargs):
        raise AssertionError("a solver was called for a trivial problem")

    monkeypatch.setattr(backends, "run", no_solver)
    single = ILPProblem(
        node_costs=[np.array([2.0]), np.array([3.0])],
        edges=[(0, 1, np.array([[0.5]]))],
        memory_rows=[MemoryRow(terms=((0, np.array([4.0])),), constant=1.0)],
        memory_limit=10.0,
    )
    solution = solve_ilp(single)
    assert (solution.backend, solution.status, solution.objective, solution.peak_memory) == \
        ("none", "trivial", 5.5, 5.0)
    # Edges only into one-strategy nodes fold into node costs; the rest is an argmin per node.
    folded = ILPProblem(
        node_costs=[np.array([1.0, 0.0, 3.0]), np.array([7.0]), np.array([0.2, 0.1])],
        edges=[(0, 1, np.array([[0.0], [5.0], [0.0]])), (1, 2, np.array([[0.0, 1.0]]))],
    )
    solution = solve_ilp(folded)
    assert solution.backend == "none" and solution.choice.tolist() == [0, 0, 0]
    assert solution.objective == pytest.approx(1.0 + 7.0 + 0.2)
    # An edge between tied nodes is a diagonal cost; nothing is left to decide jointly.
    tied = ILPProblem(
        node_costs=[np.array([1.0, 1.0]), np.array([1.0, 1.0])],
        edges=[(0, 1, np.array([[3.0, 0.0], [0.0, 2.0]]))],
        ties=[(0, 1)],
    )
    solution = solve_ilp(tied)
    assert solution.backend == "none" and solution.choice.tolist() == [1, 1] and solution.objective == 4.0
    with pytest.raises(InfeasibleError):
        solve_ilp(dataclasses.replace(single, memory_limit=4.0))


def chain(n: int, k: int, seed: int) -> ILPProblem:
    rng = np.random.default_rng(seed)
    edges = [(v - 1, v, rng.random((k, k))) for v in range(1, n)]
    edges += [(v - 3, v, rng.random((k, k))) for v in range(3, n, 3)]
    return ILPProblem(node_costs=[rng.random(k) for _ in range(n)], edges=edges)


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_limit_returns_best_plan_with_its_gap(backend):
    problem = chain(400, 8, seed=7)
    solution = solve_ilp(problem, backend=backend, time_limit_s=1.0, relative_gap=0.0, cpsat_workers=1)
    assert solution.gap >= 0
    assert solution.status == ("optimal" if solution.optimal else "time_limit")
    if not solution.optimal:
        assert solution.gap > 0
    assert solution.objective == pytest.approx(problem.objective_of(solution.choice))
    assert solution.solve_time_s < 10.0


def test_no_plan_within_the_time_limit_is_a_clear_error():
    rng = np.random.default_rng(3)
    n, k = 600, 8
    base = chain(n, k, seed=3)
    # every row weighs each node's strategies differently, so neither the cheapest nor the
    # least-memory plan (the solver's starting points) fits: the solver must search
    rows = [MemoryRow(terms=tuple((i, rng.random(k)) for i in range(t, t + 8))) for t in range(0, n - 8, 2)]
    cheapest = max(sum(v.min() for _, v in row.terms) for row in rows)
    problem = dataclasses.replace(base, memory_rows=rows, memory_limit=cheapest * 1.02)
    with pytest.raises(SolverTimeoutError, match="time_limit_s"):
        solve_ilp(problem, time_limit_s=0.01)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(node_costs=[np.array([1.0, -1.0])]), "non-negative"),
        (dict(node_costs=[np.array([1.0, np.nan])]), "finite"),
        (dict(node_costs=[np.array([])]), "non-empty"),
        (dict(node_costs=[np.ones(2), np.ones(3)], edges=[(0, 1, np.ones((3, 2)))]), "expected \\(2, 3\\)"),
        (dict(node_costs=[np.ones(2), np.ones(3)], edges=[(0, 2, np.ones((2, 3)))]), "not in 0..1"),
        (dict(node_costs=[np.ones(2)], edges=[(0, 0, np.ones((2, 2)))]), "itself"),
        (dict(node_costs=[np.ones(2), np.ones(3)], ties=[(0, 1)]), "same strategies"),
        (dict(node_costs=[np.ones(2)], memory_rows=[MemoryRow(terms=((0, np.ones(3)),))]), "vector has 3"),
        (dict(node_costs=[np.ones(2)], memory_limit=float("nan")), "memory_limit"),
    ],
)
def test_malformed_problems_are_rejected(kwargs, match):
    with pytest.raises(SolverInputError, match=match):
        ILPProblem(**kwargs)


def test_unknown_backend_is_rejected():
    with pytest.raises(SolverInputError, match="backend"):
        solve_ilp(ILPProblem(node_costs=[np.ones(2)]), backend="gurobi")
