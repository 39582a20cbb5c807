"""The strategy problem with some edges left out, so that exact elimination solves it: a floor.

After :func:`~autopar.solver.presolve.presolve` every residual edge matrix is ``≥ 0`` (its row
and column minima moved into the node costs), so leaving an edge out lowers no choice's cost:
the exact optimum of the problem without some edges is a floor on the whole problem's optimum,
under any memory bound. :func:`kept_edges` keeps edges strongest first (largest entry), each one
that still lets an elimination order hold every factor within ``max_entries``; where every edge
is kept, :func:`relaxed_floor` is the optimum without memory rows. A search compares the floor
with the fastest plan so far to skip a solve that cannot win, and
:mod:`autopar.solver.lagrange` searches the relaxed problem for plans under a memory bound.

Example::

    problem = ILPProblem(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 0.5])],
                         edges=[(0, 1, np.array([[0.0, 4.0], [1.0, 0.0]]))])
    relaxed_floor(problem)       # 2.5: the optimum (both take strategy 1)
"""

from __future__ import annotations

import numpy as np

from autopar.solver.eliminate import eliminate, elimination_order, greedy_order
from autopar.solver.presolve import presolve
from autopar.solver.problem import ILPProblem

FLOOR_ENTRIES = 1 << 16  # largest factor the relaxation's elimination builds: milliseconds, not seconds


def kept_edges(sizes: list[int], edges: list, max_entries: int) -> tuple[list[int], list[int]]:
    """(indices of the edges kept, the elimination order that keeps every factor of them within
    ``max_entries``): strongest first, an edge is kept where the order with it still does (tried a
    run of edges at a time, the run doubling after a fit and halving after a miss). The answer
    depends on the structure only (sizes, edges, their order of strength), remembered for the
    last :data:`REMEMBERED` structures: a search solves one graph under many memory bounds."""
    entries = max(max_entries, max(sizes, default=1))  # one group alone always fits
    strongest = sorted(range(len(edges)), key=lambda i: -float(edges[i][2].max()))
    key = (tuple(sizes), entries, tuple((edges[i][0], edges[i][1]) for i in strongest))
    if key in _remembered:
        return _remembered[key]
    order, largest = elimination_order(sizes, edges)
    if largest <= entries:
        found = list(range(len(edges))), order
    else:
        found = _grown(sizes, edges, strongest, entries)
    if len(_remembered) >= REMEMBERED:
        del _remembered[next(iter(_remembered))]
    _remembered[key] = found
    return found


REMEMBERED = 16
_remembered: dict = {}


def _grown(sizes, edges, strongest: list[int], entries: float) -> tuple[list[int], list[int]]:
    """:func:`kept_edges`'s greedy growth from no edge."""
    adjacency: list[set[int]] = [set() for _ in sizes]
    kept, at, run = [], 0, 1
    while at < len(strongest):
        trial = [(edges[i][0], edges[i][1]) for i in strongest[at:at + run]]
        if _fits_with(sizes, adjacency, trial, entries):
            for g, h in trial:
                adjacency[g].add(h)
                adjacency[h].add(g)
            kept += strongest[at:at + run]
            at, run = at + run, run * 2
        elif run > 1:
            run //= 2
        else:
            at += 1  # this edge does not fit: left out
    order = greedy_order(sizes, adjacency, False)[0] if kept else list(range(len(sizes)))
    return sorted(kept), order


def _fits_with(sizes, adjacency: list[set[int]], added: list[tuple[int, int]], entries: float) -> bool:
    """Whether the smallest-factor order of ``adjacency`` plus ``added`` keeps every factor within
    ``entries``, given that of ``adjacency`` alone does. That order eliminates each connected
    component as it would the component alone (an elimination changes its own component's scores
    only; ties go to the lower index, kept by numbering the part in order), so only the components
    the added edges touch are ordered again."""
    part, todo = set(), [g for edge in added for g in edge]
    while todo:
        g = todo.pop()
        if g not in part:
            part.add(g)
            todo.extend(adjacency[g] - part)
    groups = sorted(part)
    local = {g: i for i, g in enumerate(groups)}
    sub = [{local[v] for v in adjacency[g]} for g in groups]
    for g, h in added:
        sub[local[g]].add(local[h])
        sub[local[h]].add(local[g])
    return greedy_order([sizes[g] for g in groups], sub, False)[1] <= entries


def relaxed_floor(problem: ILPProblem, *, max_entries: int = FLOOR_ENTRIES) -> float:
    """A floor on ``problem``'s objective for every choice (module docstring)."""
    reduced = presolve(problem)
    free = [g for g in range(len(reduced.costs)) if g not in reduced.fixed]
    local = {g: i for i, g in enumerate(free)}
    sizes = [len(reduced.costs[g]) for g in free]
    edges = [(local[g], local[h], m) for g, h, m in reduced.edges]
    kept, order = kept_edges(sizes, edges, max_entries)
    edges = [edges[i] for i in kept]
    costs = [reduced.costs[g] for g in free]
    choice = eliminate(costs, edges, order=order)
    value = reduced.offset + sum(float(c[a]) for c, a in zip(costs, choice))
    return value + sum(float(m[choice[g], choice[h]]) for g, h, m in edges)


__all__ = ["FLOOR_ENTRIES", "kept_edges", "relaxed_floor"]
