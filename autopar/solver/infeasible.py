"""When no plan fits the memory limit: the smallest peak any plan reaches (a second program,
minimising the peak) and the error that reports it.
"""

from __future__ import annotations

from autopar.core.errors import InfeasibleError, SolverTimeoutError
from autopar.solver import backends
from autopar.solver.presolve import choice_of, least_of
from autopar.solver.problem import ILPProblem
from autopar.solver.program import Program, add_one_hot, add_peak_rows, decode


def smallest_peak(problem, reduced, *, backend, time_limit_s, workers) -> float:
    """The lowest peak any plan reaches: with one memory row, each group's least bytes (presolve
    moved them into the row's constant); with several, the min-peak program over them."""
    rows = reduced.rows
    groups = sorted({g for _, terms in rows for g in terms})
    if not groups:
        return max(r[0] for r in rows)
    if len(rows) == 1:
        terms = rows[0][1]
        return problem.peak_of(choice_of(problem, reduced, {g: least_of(terms[g], reduced.costs[g]) for g in terms}))
    _, mem_scale = backends.scales(reduced, [], rows, backend=backend)
    program = Program()
    s = add_one_hot(program, groups, reduced.costs, 0.0)
    add_peak_rows(program, rows, s, mem_scale, integer=backend == "cpsat")
    outcome = backends.run(program, backend=backend, time_limit_s=time_limit_s, relative_gap=0.0, workers=workers)
    if outcome.values is None:
        raise SolverTimeoutError(
            f"no plan fits memory_limit, and the {backend} solver found no plan at all within "
            f"time_limit_s={time_limit_s} while looking for the smallest peak; raise time_limit_s"
        )
    return problem.peak_of(choice_of(problem, reduced, decode(outcome.values, s)))


def format_bytes(b: float) -> str:
    """``3.200 GiB``, ``512.0 MiB``, ``90 bytes``: readable at any scale (limits may be tiny)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.{3 if unit == 'GiB' else 1}f} {unit}"
    return f"{b:.0f} bytes"


def no_plan_fits(limit: float, peak: float, *, method: str = "", what: str = "") -> InfeasibleError:
    """The error for a memory ``limit`` that no plan meets, the least any plan reaches being
    ``peak`` bytes per device (``what``: what that peak is made of)."""
    over = peak - limit
    ratio = f" ({peak / limit:.2f}× the limit)" if limit > 0 else ""
    return InfeasibleError(
        f"{method + ': ' if method else ''}no plan fits the memory limit of {format_bytes(limit)} per device: the"
        f" smallest achievable peak is {format_bytes(peak)} ({peak:.0f} bytes{what}), {format_bytes(over)} over{ratio}."
        " Use more devices, a larger memory fraction, or let the search shard parameters/optimizer state"
        " (ZeRO/FSDP) and recompute activations.",
        smallest_peak=peak,
    )


def raise_infeasible(problem: ILPProblem, peak: float) -> None:
    raise no_plan_fits(problem.memory_limit, peak)


__all__ = ["format_bytes", "no_plan_fits", "raise_infeasible", "smallest_peak"]
