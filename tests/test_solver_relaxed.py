"""The relaxed-elimination floor (:mod:`autopar.solver.relaxed`): never above any choice's objective
under any memory bound, equal to the optimum without memory rows where no edge is left out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.solver import ILPProblem
from autopar.solver.brute_force import brute_force_ilp
from autopar.solver.eliminate import greedy_order
from autopar.solver.relaxed import kept_edges, relaxed_floor
from test_solver_ilp import random_graph


@pytest.mark.parametrize("seed", range(30))
def test_the_floor_is_the_optimum_without_memory_where_the_factors_fit(seed):
    problem = random_graph(seed, ties=True, memory=True)
    free = dataclasses.replace(problem, memory_limit=None)
    assert relaxed_floor(problem) == pytest.approx(brute_force_ilp(free).objective, rel=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_a_floor_that_leaves_edges_out_is_below_every_plan(seed):
    """Factors of at most 4 entries leave out most edges: the floor drops, never above the
    memory-bound optimum (nor any other choice's objective) and not below the cheapest entries' sum."""
    problem = random_graph(seed, ties=False, memory=True)
    floor = relaxed_floor(problem, max_entries=4)
    exact = relaxed_floor(problem)
    rng = np.random.default_rng(seed)
    others = [problem.objective_of([int(rng.integers(len(c))) for c in problem.node_costs]) for _ in range(20)]
    best = brute_force_ilp(problem)
    assert floor <= exact + 1e-12
    assert all(floor <= o + 1e-12 for o in others)
    if best.choice is not None:
        assert floor <= best.objective + 1e-12
    cheapest = sum(float(c.min()) for c in problem.node_costs) + sum(float(m.min()) for _, _, m in problem.edges)
    assert floor >= cheapest - 1e-12


def test_a_dense_graph_is_floored_below_its_optimum():
    """A complete graph of 6 nodes: factors of 4^3 entries cannot hold it, so edges are left out
    and the floor is below the optimum, yet above the sum of the cheapest entries."""
    rng = np.random.default_rng(0)
    n, k = 6, 4
    edges = [(u, v, rng.random((k, k))) for u in range(n) for v in range(u + 1, n)]
    problem = ILPProblem(node_costs=[rng.random(k) for _ in range(n)], edges=edges)
    optimum = brute_force_ilp(problem).objective
    floor = relaxed_floor(problem, max_entries=k**3)
    cheapest = sum(float(c.min()) for c in problem.node_costs) + sum(float(m.min()) for _, _, m in edges)
    assert cheapest < floor < optimum
    assert relaxed_floor(problem, max_entries=k**6) == pytest.approx(optimum, rel=1e-12)


def _whole_graph_growth(sizes, edges, entries):
    """kept_edges' growth as specified: every trial orders the whole graph with its edges."""
    strongest = sorted(range(len(edges)), key=lambda i: -float(edges[i][2].max()))
    adjacency = [set() for _ in sizes]
    kept, order, at, run = [], list(range(len(sizes))), 0, 1
    while at < len(strongest):
        trial = [set(a) for a in adjacency]
        for i in strongest[at:at + run]:
            trial[edges[i][0]].add(edges[i][1])
            trial[edges[i][1]].add(edges[i][0])
        found, largest = greedy_order(sizes, trial, False)
        if largest <= entries:
            kept, adjacency, order, at, run = kept + strongest[at:at + run], trial, found, at + run, run * 2
        elif run > 1:
            run //= 2
        else:
            at += 1
    return sorted(kept), order


@pytest.mark.parametrize("seed", range(8))
def test_edges_are_kept_as_by_ordering_the_whole_graph_each_trial(seed):
    """Trials order only the components their edges touch: the same edges and order as ordering
    the whole graph every time, on graphs of many components that grow and merge."""
    rng = np.random.default_rng(seed)
    n = 80
    sizes = [int(s) for s in rng.choice([1, 2, 3, 4, 8], size=n)]
    pairs = {tuple(sorted(int(v) for v in rng.choice(n, 2, replace=False))) for _ in range(3 * n)}
    pairs |= {(v - 1, v) for v in range(1, n) if rng.random() < 0.7}
    edges = [(g, h, rng.random((sizes[g], sizes[h]))) for g, h in sorted(pairs)]
    entries = int(rng.choice([64, 256, 1024]))
    found = kept_edges(sizes, edges, entries)
    assert 0 < len(found[0]) < len(edges)  # some edges kept, some left out
    assert found == _whole_graph_growth(sizes, edges, entries)
