"""The fastest plan among those of least memory, without a branch-and-bound where one row bounds it.

With one memory row, the row's least sum is the sum of each group's least bytes (presolve moves
them into the row's constant), and a plan reaches it exactly when every group takes one of its
least-bytes strategies: :func:`least_memory` keeps only those strategies and solves the program
without memory rows (exact elimination where the graph allows, else the ILP), where a bound of
the least sum itself would make the ILP prove a knapsack at zero slack. With several rows it
finds the smallest peak by the min-peak program and solves at that bound.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from autopar.solver.ilp import solve_ilp
from autopar.solver.infeasible import smallest_peak
from autopar.solver.presolve import presolve
from autopar.solver.problem import ILPProblem, ILPSolution

EXCESS = 1e-12  # bytes over a group's least, as a share of the row's least sum, still counted least


def least_memory(problem: ILPProblem, *, time_limit_s: float = 30.0, backend: str = "highs",
                 relative_gap: float = 1e-4, cpsat_workers: int = 8) -> ILPSolution:
    """The fastest plan of ``problem`` whose peak (largest memory row) is the least any plan
    reaches (``problem.memory_limit`` is ignored)."""
    reduced = presolve(problem)
    if len(reduced.rows) != 1:
        peak = smallest_peak(problem, reduced, backend=backend, time_limit_s=time_limit_s,
                             workers=cpsat_workers) if reduced.rows else None
        bounded = dataclasses.replace(problem, memory_limit=None if peak is None else peak * (1 + 1e-9))
        return solve_ilp(bounded, time_limit_s=time_limit_s, backend=backend,
                         relative_gap=relative_gap, cpsat_workers=cpsat_workers)
    constant, terms = reduced.rows[0]
    keep = {g: np.flatnonzero(bytes_ <= EXCESS * constant) for g, bytes_ in terms.items()}
    kept = [keep.get(int(g)) for g in reduced.group_of]
    narrowed = ILPProblem(
        node_costs=[c if k is None else c[k] for c, k in zip(problem.node_costs, kept)],
        edges=[(u, v, m[np.ix_(_all(kept[u], m.shape[0]), _all(kept[v], m.shape[1]))]) for u, v, m in problem.edges],
        ties=problem.ties,
    )
    solution = solve_ilp(narrowed, time_limit_s=time_limit_s, backend=backend, relative_gap=relative_gap,
                         cpsat_workers=cpsat_workers)
    choice = np.array([a if k is None else k[a] for a, k in zip(solution.choice, kept)], dtype=np.int64)
    choice.setflags(write=False)
    return ILPSolution(
        choice=choice, objective=problem.objective_of(choice), peak_memory=problem.peak_of(choice),
        optimal=solution.optimal, gap=solution.gap, status=solution.status, solve_time_s=solution.solve_time_s,
        num_variables=solution.num_variables, num_constraints=solution.num_constraints, backend=solution.backend,
    )


def _all(keep: np.ndarray | None, size: int) -> np.ndarray:
    return np.arange(size) if keep is None else keep


__all__ = ["least_memory"]
