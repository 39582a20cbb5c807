"""Variable elimination: exact without memory rows, handed back when too entangled, and used by
solve_ilp only when its answer fits the memory rows."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.solver import ILPProblem, MemoryRow, solve_ilp
from autopar.solver.brute_force import brute_force_ilp
from autopar.solver.eliminate import eliminate, elimination_order, greedy_order
from test_solver_ilp import random_graph


@pytest.mark.parametrize("seed", range(40))
def test_elimination_objective_equals_brute_force(seed):
    problem = random_graph(seed, ties=False, memory=False)
    choice = eliminate(problem.node_costs, problem.edges)
    assert problem.objective_of(choice) == pytest.approx(brute_force_ilp(problem).objective, rel=1e-12)


def test_a_graph_too_entangled_for_the_factor_limit_is_handed_back():
    rng = np.random.default_rng(0)
    n, k = 6, 4  # a complete graph: eliminating any node builds a k^n table
    edges = [(u, v, rng.random((k, k))) for u in range(n) for v in range(u + 1, n)]
    costs = [rng.random(k) for _ in range(n)]
    assert eliminate(costs, edges, max_entries=k**3) is None
    problem = ILPProblem(node_costs=costs, edges=edges)
    assert problem.objective_of(eliminate(costs, edges)) == pytest.approx(brute_force_ilp(problem).objective)


def _two_nodes(limit):
    # Strategy 0 of node 0 is cheapest but needs 10 bytes; strategy 1 costs 1 more and needs 1.
    return ILPProblem(
        node_costs=[np.array([0.0, 1.0]), np.array([0.0, 0.5])],
        edges=[(0, 1, np.array([[0.0, 3.0], [3.0, 0.0]]))],
        memory_rows=[MemoryRow(terms=((0, np.array([10.0, 1.0])),))],
        memory_limit=limit,
    )


def test_solve_ilp_keeps_the_elimination_answer_only_when_it_fits_memory():
    free = solve_ilp(_two_nodes(20.0))
    assert (free.backend, free.choice.tolist(), free.objective) == ("elimination", [0, 0], 0.0)
    tight = solve_ilp(_two_nodes(5.0))
    assert tight.backend == "highs" and tight.choice.tolist() == [1, 1] and tight.objective == 1.5


def test_among_equally_fast_plans_the_one_with_less_memory_is_kept():
    # Strategies 0 and 1 of node 0 cost the same time everywhere; strategy 1 needs less memory.
    linked = ILPProblem(
        node_costs=[np.array([1.0, 1.0, 5.0]), np.array([0.0, 0.0])],
        edges=[(0, 1, np.array([[0.0, 2.0], [0.0, 2.0], [2.0, 0.0]]))],
        memory_rows=[MemoryRow(terms=((0, np.array([8.0, 2.0, 0.0])),))],
    )
    solution = solve_ilp(linked)
    assert solution.backend == "elimination" and solution.choice.tolist() == [1, 0]
    # The same when presolve decides the node alone (its edge folds into node costs).
    alone = ILPProblem(
        node_costs=[np.array([1.0, 1.0]), np.array([0.0, 2.0])],
        edges=[(0, 1, np.array([[0.0, 1.0], [0.0, 1.0]]))],
        memory_rows=[MemoryRow(terms=((0, np.array([8.0, 2.0])),))],
        memory_limit=100.0,
    )
    solution = solve_ilp(alone)
    assert solution.backend == "none" and solution.choice.tolist() == [1, 0]


def test_elimination_plans_its_order_and_takes_min_fill_where_it_keeps_factors_smaller():
    """Eliminating the smallest factor first builds a factor of 64 entries on this graph; min-fill
    gets by with 32, so a limit of 32 is still solved exactly."""
    sizes = [4, 3, 2, 2, 4, 2, 4]
    pairs = [(0, 2), (0, 3), (1, 6), (2, 3), (2, 4), (2, 5), (3, 5), (3, 6), (4, 6), (5, 6)]
    rng = np.random.default_rng(103)
    edges = [(u, v, rng.random((sizes[u], sizes[v]))) for u, v in pairs]
    costs = [rng.random(k) for k in sizes]
    assert elimination_order(sizes, edges)[1] == 32
    choice = eliminate(costs, edges, max_entries=32)
    problem = ILPProblem(node_costs=costs, edges=edges)
    assert problem.objective_of(choice) == pytest.approx(brute_force_ilp(problem).objective, rel=1e-12)
    assert eliminate(costs, edges, max_entries=31) is None


def _spec_order(sizes, adjacency, min_fill):
    """The greedy order as its docstring states it, one full scan per step."""
    adj = [set(a) for a in adjacency]
    left, order, largest = set(range(len(sizes))), [], 0.0

    def key(x):
        entries = float(np.prod([sizes[v] for v in adj[x]])) * sizes[x]
        near = sorted(adj[x])
        fill = sum(1 for i, a in enumerate(near) for b in near[i + 1:] if b not in adj[a])
        return (fill, entries, x) if min_fill else (entries, x)

    while left:
        x = min(left, key=key)
        largest = max(largest, key(x)[-2])
        for v in adj[x]:
            adj[v] |= adj[x] - {v}
            adj[v].discard(x)
        left.remove(x)
        order.append(x)
    return order, largest


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_orders_take_the_smallest_score_each_step_lowest_index_on_ties(seed):
    rng = np.random.default_rng(seed)
    n = 60
    sizes = [int(s) for s in rng.choice([1, 2, 3, 4, 8], size=n)]  # many equal scores
    adjacency = [set() for _ in range(n)]
    for g in range(n):
        for h in rng.choice(n, size=2, replace=False):
            if h != g:
                adjacency[g].add(int(h))
                adjacency[int(h)].add(g)
    for min_fill in (False, True):
        assert greedy_order(sizes, adjacency, min_fill) == _spec_order(sizes, adjacency, min_fill)
