"""The two ILP backends, both through ``ortools.math_opt``: HiGHS and CP-SAT.

:func:`scales` gives the factors costs and bytes are multiplied by before solving (the module
docstring of :mod:`autopar.solver.ilp` states them and what CP-SAT's rounding costs),
:func:`run` solves a :class:`~autopar.solver.program.Program` with one backend.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import numpy as np
from ortools.math_opt import model_parameters_pb2, model_pb2, solution_pb2
from ortools.math_opt.core.python import solver as core_solver
from ortools.math_opt.python import callback, init_arguments, mathopt
from pybind11_abseil.status import StatusNotOk

from autopar.core.errors import SolverTimeoutError
from autopar.solver.presolve import Reduced, row_max
from autopar.solver.program import Program

# Integer range that scaled costs and bytes are fitted into for CP-SAT. At 2^40 CP-SAT (9.15)
# proved "optimal" a plan 4e-6 worse than HiGHS's optimum on a 200-node problem with memory
# rows, and was 6× slower; at 2^30 it matched HiGHS.
_CPSAT_RANGE = 2.0**30


@dataclass
class Outcome:
    """What one backend run gave."""

    values: np.ndarray | None  # variable values of the best solution, None if none was found
    infeasible: bool
    proved: bool  # the solver proved optimality within the requested gap (in its own units)
    dual_bound: float  # in the program's units
    detail: str


def _to_proto(program: Program, *, make_integer: bool) -> model_pb2.ModelProto:
    proto = model_pb2.ModelProto()
    n = program.num_vars
    objective = np.concatenate(program.objective) if n else np.zeros(0)
    upper = np.concatenate(program.upper) if n else np.zeros(0)
    integer = np.concatenate(program.integer) if n else np.zeros(0, bool)
    row_lower, row_upper = np.array(program.row_lower), np.array(program.row_upper)
    rows, cols, coefs = (np.concatenate(parts) for parts in zip(*program.entries))
    if make_integer:  # CP-SAT: every number integral (the caller scaled them); see module doc
        objective, coefs, upper = np.rint(objective), np.rint(coefs), np.floor(upper + 1e-9)
        row_lower = np.where(np.isfinite(row_lower), np.ceil(row_lower - 1e-9), row_lower)
        row_upper = np.where(np.isfinite(row_upper), np.floor(row_upper + 1e-9), row_upper)
        integer = np.ones(n, bool)
    keep = coefs != 0
    rows, cols, coefs = rows[keep], cols[keep], coefs[keep]
    order = np.lexsort((cols, rows))
    variables = proto.variables
    variables.ids.extend(range(n))
    variables.lower_bounds.extend(np.zeros(n).tolist())
    variables.upper_bounds.extend(upper.tolist())
    variables.integers.extend(integer.tolist())
    nonzero = np.flatnonzero(objective)
    proto.objective.linear_coefficients.ids.extend(nonzero.tolist())
    proto.objective.linear_coefficients.values.extend(objective[nonzero].tolist())
    constraints = proto.linear_constraints
    constraints.ids.extend(range(len(row_lower)))
    constraints.lower_bounds.extend(row_lower.tolist())
    constraints.upper_bounds.extend(row_upper.tolist())
    matrix = proto.linear_constraint_matrix
    matrix.row_ids.extend(rows[order].tolist())
    matrix.column_ids.extend(cols[order].tolist())
    matrix.coefficients.extend(coefs[order].tolist())
    return proto


def run(program: Program, *, backend: str, time_limit_s: float, relative_gap: float, workers: int,
        hint=None, cutoff: float | None = None) -> Outcome:
    """Solve with one backend; ``hint`` (indices of the variables at 1 in a feasible plan, every
    other at 0) seeds the search. ``cutoff`` (HiGHS only, in the program's units): only a
    solution below it matters, so the search drops every node whose bound is not, and stops with
    the best it had (the hint, or one at or over it) once none is left. The model, hint and
    answer go to the solver and back as protocol buffers, without math_opt's Python model (a
    wrapper per variable: seconds on the search's 100k-variable programs). HiGHS, given a hint,
    skips its presolve and its feasibility-jump heuristic: on these programs (one-hot rows, edge
    marginals, a memory row) they remove next to nothing and find no better start than the hint,
    and took 3-4 s of a 5 s solve."""
    cpsat = backend == "cpsat"
    model_params = model_parameters_pb2.ModelSolveParametersProto()
    if hint is not None:  # every variable given: HiGHS completes a partial hint with a sub-MIP of its own
        values = np.zeros(program.num_vars)
        values[np.asarray(hint, dtype=np.int64)] = 1.0
        given = model_params.solution_hints.add().variable_values
        given.ids.extend(range(program.num_vars))
        given.values.extend(values.tolist())
    params = mathopt.SolveParameters(
        time_limit=datetime.timedelta(seconds=float(time_limit_s)),
        relative_gap_tolerance=relative_gap,
        absolute_gap_tolerance=0.0,
    )
    if cpsat:
        params.threads = workers
        params.cp_sat.mip_max_bound = 2.0**40  # the peak variable reaches 2^30; default refuses > 1e7
    else:  # HiGHS takes no thread count through math_opt; it picks its own
        params.highs.double_options["mip_feasibility_tolerance"] = 1e-9
        if cutoff is not None:
            params.highs.double_options["objective_bound"] = float(cutoff)
        if hint is not None:
            params.presolve = mathopt.Emphasis.OFF
            params.highs.bool_options["mip_heuristic_run_feasibility_jump"] = False
    solver = mathopt.SolverType.CP_SAT if cpsat else mathopt.SolverType.HIGHS
    try:
        result = core_solver.solve(_to_proto(program, make_integer=cpsat), solver.value,
                                   init_arguments.StreamableSolverInitArguments().to_proto(), params.to_proto(),
                                   model_params, None, callback.CallbackRegistration().to_proto(), None, None)
    except StatusNotOk as exc:
        raise SolverTimeoutError(f"the {backend} solver refused the program ({exc})") from None
    termination = result.termination
    reason = mathopt.TerminationReason(termination.reason)
    detail = f"{reason.name}: {termination.detail}"
    infeasible = reason == mathopt.TerminationReason.INFEASIBLE
    if reason not in (
        mathopt.TerminationReason.OPTIMAL,
        mathopt.TerminationReason.FEASIBLE,
        mathopt.TerminationReason.INFEASIBLE,
        mathopt.TerminationReason.NO_SOLUTION_FOUND,
    ):
        raise SolverTimeoutError(f"the {backend} solver stopped without a usable answer ({detail})")
    values = None
    feasible = [s.primal_solution for s in result.solutions if s.HasField("primal_solution")
                and s.primal_solution.feasibility_status == solution_pb2.SOLUTION_STATUS_FEASIBLE]
    if feasible:
        found = feasible[0].variable_values
        values = np.zeros(program.num_vars)
        values[np.asarray(found.ids, dtype=np.int64)] = np.asarray(found.values, dtype=float)
    proved = reason == mathopt.TerminationReason.OPTIMAL
    return Outcome(values, infeasible, proved, termination.objective_bounds.dual_bound, detail)


def scales(reduced: Reduced, groups, rows, *, backend: str) -> tuple[float, float]:
    """(cost scale, byte scale) as the module docstring describes for each backend."""
    costs = [reduced.costs[g] for g in groups] + [m for _, _, m in reduced.edges]
    activity = max((row_max(r) for r in rows), default=0.0)
    if backend == "highs":
        largest = max((float(c.max()) for c in costs), default=0.0)
        return (1.0 / largest if largest > 0 else 1.0), (1.0 / activity if activity > 0 else 1.0)
    bound = sum(float(c.max()) for c in costs)

    def power(top: float) -> float:
        return 2.0 ** math.floor(math.log2(_CPSAT_RANGE / top)) if top > 0 else 1.0

    return power(bound), power(activity)


__all__ = ["Outcome", "run", "scales"]
