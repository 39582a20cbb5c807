"""A search's tries that fit no plan, their errors made only when one is reported.

A try that nothing fits reports its least-memory plan's peak, and building that plan (its ZeRO
analysis, its step walk) costs more than the rest of the try. Where a cheap floor on that peak
(:func:`peak_floor`) is already over the limit, the try raises :class:`Unbuilt` instead, and
:func:`closest_miss` builds only the misses whose floor is below the smallest peak found so
far: the error it returns is the one building every miss would have picked.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from autopar.core.errors import InfeasibleError
from autopar.planner.peak import step_walk


class Unbuilt(InfeasibleError):
    """A try's "no plan fits" whose plan is not built yet: ``floor`` bounds the peak its error
    reports from below; :meth:`made` builds it (``make`` raises the InfeasibleError)."""

    def __init__(self, floor: float, make: Callable[[], object]):
        super().__init__(f"no plan fits: the peak is at least {floor:.0f} bytes (its plan is not built)",
                         smallest_peak=None)
        self.floor, self._make, self._made = floor, make, None

    def made(self) -> InfeasibleError:
        if self._made is None:
            try:
                self._make()
            except InfeasibleError as exc:
                self._made = exc
            else:
                raise AssertionError("a try whose peak floor is over the limit built a plan that fits")
        return self._made


def closest(exc: InfeasibleError) -> float:
    """The peak ``exc`` reports (inf: none)."""
    return exc.smallest_peak or math.inf


def _floor(exc: InfeasibleError) -> float:
    return exc.floor if isinstance(exc, Unbuilt) else closest(exc)


def closest_miss(misses) -> InfeasibleError:
    """The error among ``misses`` (InfeasibleErrors, some :class:`Unbuilt`) that reports the
    smallest peak; an unbuilt one is built only while its floor is below the best made so far."""
    best = None
    for exc in sorted(misses, key=_floor):
        if best is not None and closest(best) <= _floor(exc):
            break
        made = exc.made() if isinstance(exc, Unbuilt) else exc
        if best is None or closest(made) < closest(best):
            best = made
    return best


def peak_floor(solved, captured, cost_model, *, offload: bool | str, recompute: bool | str,
               checkpoints: bool) -> float:
    """A lower bound on the step peak of every plan :func:`~autopar.planner.intra.build_plan`
    makes of ``solved`` (any ZeRO stage, offload, tiles): its step walk with no parameter,
    gradient or optimizer bytes and nothing fetched, each of which only adds to the peak. The
    walk's parts that do not depend on them stay in ``solved.derived`` for the build."""
    nothing = {node.target: (0.0, 0.0, 0.0) for node in solved.graph.nodes if node.kind == "parameter"}
    memory, _ = step_walk(solved.graph, solved.choice, captured, cost_model, nothing, recompute=recompute,
                          offload=bool(offload), offload_checkpoints=checkpoints, memo=solved.derived)
    return memory.total


__all__ = ["Unbuilt", "closest", "closest_miss", "peak_floor"]
