"""Intra-op strategy selection as an integer linear program (Alpa-style): numpy in, numpy out.

Node ``i`` has ``k_i`` strategies with cost vector ``c_i`` (seconds); ``s_i ∈ {0,1}^{k_i}`` is
its one-hot choice. Edge ``(u, v)`` has a resharding matrix ``R_uv`` (``k_u × k_v``) and a
variable matrix ``e_uv ∈ [0,1]^{k_u×k_v}`` standing for ``s_u s_vᵀ``. Memory row ``r`` has a
constant ``K_r`` and per-node byte vectors ``m_ri``::

    minimise    Σ_i c_i·s_i + Σ_(u,v) ⟨R_uv, e_uv⟩
    subject to  Σ_a s_i[a] = 1                          every node i       (program.add_one_hot)
                Σ_b e_uv[a,b] = s_u[a]   for every a,
                Σ_a e_uv[a,b] = s_v[b]   for every b     every edge (u, v)  (program.add_edge_marginals)
                K_r + Σ_i m_ri·s_i ≤ memory_limit         every memory row r (program.add_memory_rows)
                s_u = s_v                                 every tie (u, v)   (presolve.merge_ties)

The marginal equations force ``e = s_u s_vᵀ`` once ``s`` is integral, so ``e`` is continuous.
Strategies with equal rows of ``R_uv`` (columns) share a row (column) of ``e`` whose marginal is
the sum of their ``s`` (:func:`~autopar.solver.program.add_edge_marginals`); the written form is
the case of distinct rows. They are tighter than ``e ≥ s_u[a] + s_v[b] − 1`` (their LP
relaxation is the local polytope) and cost ``k_u + k_v`` rows per edge instead of ``k_u·k_v``. Ties are substituted:
tied nodes share one vector ``s``. When no plan fits, a second program finds the smallest
achievable peak: minimise ``P`` subject to one-hot, ties and ``K_r + Σ_i m_ri·s_i ≤ P``
(program.add_peak_rows, run by :func:`autopar.solver.infeasible.smallest_peak`).

Before solving, :func:`autopar.solver.presolve.presolve` rewrites the problem exactly: tied
nodes merge, nodes with one strategy become constants, each edge matrix is split as
``R = r1ᵀ + 1cᵀ + R'`` (row minima, then column minima, moved into the node costs) and dropped
when ``R' = 0``, and nodes left in no edge and no binding memory row take their cheapest strategy. Problems with nothing
left to decide never reach a solver. The rest is first solved without memory rows by exact
variable elimination (:func:`autopar.solver.eliminate.eliminate`); when that optimum fits every
memory row it is the optimum of the whole program (backend ``"elimination"``). Otherwise, with
one binding memory row, :func:`autopar.solver.lagrange.lagrangian` prices its bytes: where its
plan is within ``relative_gap`` of its Lagrangian floor that plan is the answer (backend
``"lagrangian"``), and elsewhere it is the ILP's starting plan. Only then is the ILP built and solved.

Backends (:mod:`autopar.solver.backends`, both through ``ortools.math_opt``): ``"highs"``
(costs divided by the largest coefficient, bytes by the largest row activity) and ``"cpsat"``
(all data made integer: costs times ``σ = 2^⌊log2(2^30/U)⌋``, ``U`` an upper bound of the
objective, and bytes times ``μ = 2^⌊log2(2^30/A)⌋``, ``A`` the largest row activity, rounded to
the nearest integer). With
``T`` cost terms in a plan (free nodes + edges), rounding moves a plan's cost by at most
``T/(2σ)``, so CP-SAT's plan costs at most ``T/σ ≤ T·U/2^29`` more than the optimum, and a
memory row is off by at most ``(terms + 1)/(2μ) ≤ (terms + 1)·A/2^30`` bytes. Reported objectives
and peaks are always recomputed exactly from the chosen strategies.

The problem and solution types are in :mod:`autopar.solver.problem`; the constraint families are
added by the functions of :mod:`autopar.solver.program` named above.

Example::

    problem = ILPProblem(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 0.5])],
                         edges=[(0, 1, np.array([[0.0, 4.0], [1.0, 0.0]]))])
    solve_ilp(problem).choice        # array([1, 1])
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.core.errors import SolverInputError, SolverTimeoutError
from autopar.core.options import BACKENDS
from autopar.solver import backends
from autopar.solver.eliminate import eliminate
from autopar.solver.infeasible import raise_infeasible, smallest_peak
from autopar.solver.lagrange import lagrangian
from autopar.solver.moves import Neighbours
from autopar.solver.presolve import Reduced, choice_of, group_memory, least_of, presolve, row_max
from autopar.solver.problem import ILPProblem, ILPSolution
from autopar.solver.program import Program, add_edge_marginals, add_memory_rows, add_one_hot, decode


def _greedy_pick(reduced: Reduced, s: dict, rows, limit) -> dict[int, int] | None:
    """A starting plan that fits the memory limit: each group's cheapest strategy, else each
    group's least-memory one (the fastest among equals); None when neither fits."""
    cheapest = {g: int(np.argmin(reduced.costs[g])) for g in s}
    leanest = {g: least_of(group_memory(reduced, g), reduced.costs[g]) for g in s}
    return next((p for p in (cheapest, leanest)
                 if all(c + sum(float(v[p[g]]) for g, v in terms.items()) <= limit for c, terms in rows)), None)


def _hint(reduced: Reduced, s: dict, products: list, pick: dict[int, int]) -> np.ndarray:
    """The program's variables at 1 for the plan ``pick`` (group -> strategy)."""
    ones = [s[g][a] for g, a in pick.items()]
    ones += [e[row_of[pick[g]], col_of[pick[h]]] for (g, h, _), (e, row_of, col_of) in zip(reduced.edges, products)]
    return np.array(ones)


def _priced(reduced: Reduced, groups: list[int], row, limit: float, gap: float) -> tuple[dict[int, int] | None, float]:
    """(the cheapest plan of ``groups`` within ``row`` that :func:`~autopar.solver.lagrange.lagrangian`
    finds, or None; its floor on their optimum's cost)."""
    constant, terms = row
    local = {g: i for i, g in enumerate(groups)}
    found = lagrangian([reduced.costs[g] for g in groups],
                       [terms.get(g, np.zeros(len(reduced.costs[g]))) for g in groups],
                       [(local[g], local[h], m) for g, h, m in reduced.edges], limit - constant, gap=gap)
    pick = None if found.choice is None else {g: int(found.choice[i]) for g, i in local.items()}
    return pick, found.floor


def _unconstrained(reduced: Reduced, groups: list[int], decided: dict[int, int], problem) -> np.ndarray | None:
    """The optimum ignoring memory rows, by variable elimination (None: graph too entangled);
    among plans of the same cost it prefers less memory (:func:`_less_memory_on_ties`)."""
    local = {g: i for i, g in enumerate(groups)}
    picked = eliminate([reduced.costs[g] for g in groups],
                       [(local[g], local[h], m) for g, h, m in reduced.edges])
    if picked is None:
        return None
    chosen = {g: int(picked[i]) for g, i in local.items()}
    _less_memory_on_ties(reduced, chosen)
    return choice_of(problem, reduced, {**decided, **chosen})


def _less_memory_on_ties(reduced: Reduced, chosen: dict[int, int]) -> None:
    """Move single groups to strategies that cost no more time (up to rounding, 1e-12 of the
    plan's cost) and need fewer bytes summed over the memory rows, until none is left."""
    neighbours = Neighbours(reduced.edges)
    memory = {g: group_memory(reduced, g) for g in chosen}
    scale = sum(float(reduced.costs[g][a]) for g, a in chosen.items()) + sum(
        float(m[chosen[g], chosen[h]]) for g, h, m in reduced.edges)
    tolerance = 1e-12 * scale
    moved = True
    while moved:
        moved = False
        for g, a in chosen.items():
            if not memory[g].any():
                continue
            time = neighbours.seconds(g, reduced.costs[g], chosen)
            near = np.flatnonzero(time <= time[a] + tolerance)
            best = int(near[np.argmin(memory[g][near])])
            if memory[g][best] < memory[g][a]:
                chosen[g] = best
                moved = True


def solve_ilp(
    problem: ILPProblem,
    *,
    time_limit_s: float = 30.0,
    backend: str = "highs",
    relative_gap: float = 1e-4,
    cpsat_workers: int = 8,
    cutoff: float | None = None,
) -> ILPSolution:
    """Pick one strategy per node minimising total cost under the memory limit.

    Returns the best plan found within ``time_limit_s`` (``optimal`` False and ``gap`` > the
    requested one when the limit stopped the search). The search starts from each node's
    cheapest strategy when that plan fits the memory limit, so then a plan always comes back.
    Raises :class:`InfeasibleError` (with ``smallest_peak``, found by a second solve with the
    same time limit) when no plan fits and :class:`SolverTimeoutError` when no plan was found
    in time. ``cpsat_workers`` is CP-SAT's worker count (HiGHS picks its own threads).
    ``cutoff``: a cost only a plan below which matters to the caller; where the solve proves that
    none is (within ``relative_gap``: the Lagrangian's floor, or HiGHS's search from a start that
    fits, which then stops early), the plan it had comes back with status ``"cut"``.
    """
    if backend not in BACKENDS:
        raise SolverInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    workers = cpsat_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SolverInputError(f"cpsat_workers must be a positive integer, got {workers!r}")
    if not time_limit_s > 0 or not 0 <= relative_gap < 1:
        raise SolverInputError(f"need time_limit_s > 0 and 0 ≤ relative_gap < 1, got {time_limit_s}, {relative_gap}")
    start = time.perf_counter()
    reduced = presolve(problem)
    limit = problem.memory_limit

    def infeasible():
        peak = smallest_peak(problem, reduced, backend=backend, time_limit_s=time_limit_s, workers=workers)
        raise_infeasible(problem, peak)

    binding = [r for r in reduced.rows if limit is not None and row_max(r) > limit]
    if any(r[0] > limit for r in binding):  # some row is over the limit whatever is chosen
        infeasible()
    linked = {g for g, h, _ in reduced.edges} | {h for _, h, _ in reduced.edges}
    linked |= {g for _, terms in binding for g in terms}
    free = sorted(g for g in range(len(reduced.costs)) if g not in reduced.fixed)
    decided = {g: least_of(reduced.costs[g], group_memory(reduced, g)) for g in free if g not in linked}
    groups = [g for g in free if g in linked]

    def solution(choice, *, optimal, gap, status, backend_name, num_vars=0, num_rows=0):
        return ILPSolution(
            choice=choice, objective=problem.objective_of(choice), peak_memory=problem.peak_of(choice),
            optimal=optimal, gap=gap, status=status, solve_time_s=time.perf_counter() - start,
            num_variables=num_vars, num_constraints=num_rows, backend=backend_name,
        )

    if not groups:
        choice = choice_of(problem, reduced, decided)
        return solution(choice, optimal=True, gap=0.0, status="trivial", backend_name="none")
    free_choice = _unconstrained(reduced, groups, decided, problem)
    if free_choice is not None and (limit is None or problem.peak_of(free_choice) <= limit):
        # The optimum without memory rows fits them: it is the optimum with them.
        return solution(free_choice, optimal=True, gap=0.0, status="optimal", backend_name="elimination",
                        num_vars=sum(len(reduced.costs[g]) for g in groups))
    # The decided-in-presolve part adds the same amount to the objective and to its bounds.
    fixed_part = reduced.offset + sum(float(reduced.costs[g][a]) for g, a in decided.items())
    pick = None
    if len(binding) == 1:  # one row: the Lagrangian's plan, optimal where within the gap of its floor
        pick, floor = _priced(reduced, groups, binding[0], limit, relative_gap)
        if pick is not None:
            choice = choice_of(problem, reduced, {**decided, **pick})
            objective = problem.objective_of(choice)
            gap = max(0.0, objective - floor - fixed_part) / objective if objective > 0 else 0.0
            if gap <= relative_gap or (cutoff is not None and floor + fixed_part >= cutoff):
                return solution(choice, optimal=gap <= relative_gap, gap=gap,
                                status="optimal" if gap <= relative_gap else "cut", backend_name="lagrangian",
                                num_vars=sum(len(reduced.costs[g]) for g in groups))
    cost_scale, mem_scale = backends.scales(reduced, groups, binding, backend=backend)
    cpsat = backend == "cpsat"
    program = Program()
    s = add_one_hot(program, groups, reduced.costs, cost_scale)
    products = add_edge_marginals(program, reduced.edges, s, cost_scale, integer=cpsat)
    add_memory_rows(program, binding, s, limit, mem_scale)
    pick = pick or _greedy_pick(reduced, s, binding, limit)
    hint = None if pick is None else _hint(reduced, s, products, pick)
    # with a start that fits, "infeasible" under a cutoff can only mean that nothing is below it
    cut = None if cutoff is None or hint is None or backend != "highs" else (cutoff - fixed_part) * cost_scale
    outcome = backends.run(
        program, backend=backend, time_limit_s=time_limit_s, relative_gap=relative_gap, workers=workers, hint=hint,
        cutoff=cut,
    )
    below = cut is not None and outcome.infeasible  # proved: no plan under the cutoff
    if below:
        outcome.values, outcome.infeasible = None, False
    if outcome.infeasible:
        infeasible()
    if outcome.values is None and hint is not None:  # the solver ran out of time before beating the hint
        outcome.values = np.zeros(program.num_vars)
        outcome.values[hint] = 1.0
    if outcome.values is None:
        raise SolverTimeoutError(
            f"the {backend} solver found no plan within time_limit_s={time_limit_s} "
            f"({program.num_vars} variables, {program.num_rows} constraints; {outcome.detail}). Raise "
            "time_limit_s, or give the solver a smaller graph (fold followers, tie repeated layers)."
        )
    decided.update(decode(outcome.values, s))
    choice = choice_of(problem, reduced, decided)
    objective = problem.objective_of(choice)
    bound = outcome.dual_bound / cost_scale + fixed_part if math.isfinite(outcome.dual_bound) else -math.inf
    gap = max(0.0, objective - bound) / objective if objective > 0 else 0.0
    if cut is not None and objective >= cutoff and (outcome.proved or below):
        return solution(choice, optimal=False, gap=gap, status="cut", backend_name=backend,
                        num_vars=program.num_vars, num_rows=program.num_rows)
    optimal = outcome.proved or gap <= relative_gap
    return solution(
        choice, optimal=optimal, gap=gap, status="optimal" if optimal else "time_limit",
        backend_name=backend, num_vars=program.num_vars, num_rows=program.num_rows,
    )


__all__ = ["solve_ilp"]
