"""A floor on the objective of every choice of a strategy problem, whatever its memory rows.

After :func:`~autopar.solver.presolve.presolve` every residual edge matrix is ``≥ 0`` (its row
and column minima moved into the node costs), so leaving an edge out lowers no choice's cost:
the exact optimum of the problem with the weakest edges left out (smallest largest entry first)
is a floor on the whole problem's optimum, under any memory bound. :func:`relaxed_floor` leaves
out the fewest such edges that let exact elimination (:mod:`autopar.solver.eliminate`) run
within ``max_entries`` per factor; where nothing is left out, the floor is the optimum without
memory rows. A search compares it with the fastest plan so far to skip a solve that cannot win.

Example::

    problem = ILPProblem(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 0.5])],
                         edges=[(0, 1, np.array([[0.0, 4.0], [1.0, 0.0]]))])
    relaxed_floor(problem)       # 2.5: the optimum (both take strategy 1)
"""

from __future__ import annotations

import numpy as np

from autopar.solver.eliminate import eliminate, elimination_order
from autopar.solver.presolve import presolve
from autopar.solver.problem import ILPProblem

FLOOR_ENTRIES = 1 << 16  # largest factor the floor's elimination builds: milliseconds, not seconds


def _kept(sizes: list[int], edges: list, max_entries: int) -> list:
    """``edges`` less the fewest of the weakest (smallest largest entry) whose removal lets an
    elimination order keep every factor within ``max_entries``."""
    if elimination_order(sizes, edges)[1] <= max_entries:
        return edges
    weakest = sorted(range(len(edges)), key=lambda i: float(edges[i][2].max()))
    low, high = 1, len(edges)  # leaving out all of them always fits: no factor has two groups
    while low < high:
        k = (low + high) // 2
        if elimination_order(sizes, [edges[i] for i in weakest[k:]])[1] <= max_entries:
            high = k
        else:
            low = k + 1
    return [edges[i] for i in sorted(weakest[low:])]


def relaxed_floor(problem: ILPProblem, *, max_entries: int = FLOOR_ENTRIES) -> float:
    """A floor on ``problem``'s objective for every choice (module docstring)."""
    reduced = presolve(problem)
    free = [g for g in range(len(reduced.costs)) if g not in reduced.fixed]
    local = {g: i for i, g in enumerate(free)}
    sizes = [len(reduced.costs[g]) for g in free]
    entries = max(max_entries, max(sizes, default=1))  # one group alone always fits
    edges = _kept(sizes, [(local[g], local[h], m) for g, h, m in reduced.edges], entries)
    costs = [reduced.costs[g] for g in free]
    choice = eliminate(costs, edges, max_entries=entries)
    value = reduced.offset + sum(float(c[a]) for c, a in zip(costs, choice))
    return value + sum(float(m[choice[g], choice[h]]) for g, h, m in edges)


__all__ = ["FLOOR_ENTRIES", "relaxed_floor"]
