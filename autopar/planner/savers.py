"""The memory savers a one-program search weighs: activation recompute (its checkpoints on the
device or on the host), the optimizer on the host (ZeRO-Offload) and the parameters there too,
fetched per layer (ZeRO-Infinity), and why a plan took them.

Recompute is weighed in two strengths, selective (the cheap ops between matmuls run again) and
full (every layer's forward): :mod:`autopar.core.recompute`. The search goes by levels
(:func:`saver_levels`): first no saver (or only those the options ask for), then one of them
(selective recompute, full recompute, the optimizer offloaded, the parameters offloaded with it),
then recompute with either offload; full recompute with its checkpoints on the host comes one
level after full recompute without (it adds their moves to the step). A level is tried only
where no plan of the levels before fits the devices; within a level the fastest plan that fits
wins. Recomputing also competes with a plan that fits without it where memory binds that plan
(:func:`memory_bound`: it needs ZeRO, or its peak is within 10 % of the limit): with activations
dropped a faster sharding may fit. Offload is taken only where nothing fits without a saver;
there the parameters' offload wins over the optimizer's alone where its fetches, hidden behind
compute, cost less than the optimizer's moves at the step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from autopar.core.errors import ClusterError

TIGHT = 0.9  # a plan whose peak is above this share of the limit is bound by memory
SLOWER = "slower"  # a saver whose every try was cut short by a faster plan of its level
RECOMPUTE = (False, "selective", True)  # from least memory saved and time spent to most


class Savers(NamedTuple):
    """Which savers a plan uses."""

    recompute: bool | str  # False, "selective" or True
    offload: bool | str  # False, True (the optimizer) or "parameters" (the parameters and the optimizer)
    checkpoints: bool = False  # under full recompute: the checkpoints wait on the host

    def text(self) -> str:
        recompute = "selective recompute" if self.recompute == "selective" else "recompute"
        offload = "parameters offloaded" if self.offload == "parameters" else "optimizer offloaded"
        return " and ".join(w for w, on in ((recompute, self.recompute), (offload, self.offload),
                                             ("checkpoints offloaded", self.checkpoints)) if on)


def saver_levels(options, cluster) -> list[list[Savers]]:
    """The :class:`Savers` to try, level by level (module docstring), as ``options`` allow: True,
    False (or "parameters" for offload) fixes a saver, "auto" lets the search take it (offload only
    where the cluster's host is known)."""
    if options.offload in (True, "parameters") and cluster.host is None:
        raise ClusterError(f"Options(offload={options.offload!r}) needs the cluster's host (CPU memory, host-device"
                           " link): use a Cluster.preset or pass host=autopar.cost_models.host.Host(...)")
    recompute = RECOMPUTE if options.recompute == "auto" else (options.recompute,)
    offload = ((False, True, "parameters") if cluster.host is not None else (False,)) if options.offload == "auto" \
        else (options.offload,)
    levels: dict[int, list[Savers]] = {}
    for r in recompute:
        for o in offload:
            level = (r != recompute[0]) + (o != offload[0])
            levels.setdefault(level, []).append(Savers(r, o))
            if r is True and o != "parameters" and options.offload == "auto" and cluster.host is not None:
                levels.setdefault(level + 1, []).append(Savers(r, o, True))
    return [levels[k] for k in sorted(levels)]


def memory_bound(plan, limit: float, *, zero_chosen: bool) -> bool:
    """Whether the memory limit may have held ``plan`` off a faster sharding: its peak is within
    10 % of ``limit``, or the search (``zero_chosen``) had to shard its optimizer state (ZeRO)."""
    return (zero_chosen and bool(plan.zero)) or plan.predicted_peak_memory > TIGHT * limit


def why_taken(savers: Savers, asked: Savers, limit: float, closest: tuple[float, bool], others: dict) -> str:
    """Why a plan took ``savers`` beyond those ``asked`` for (the first level's): nothing fitted
    the ``limit`` without them (``closest``: the smallest peak missed and whether it is exact, or
    a floor under every miss's: :func:`~autopar.planner.misses.least_known_peak`); ``others``: the
    level's other savers -> their plan, None (none fits) or :data:`SLOWER`."""
    taken = Savers(savers.recompute if savers.recompute != asked.recompute else False,
                   savers.offload if savers.offload != asked.offload else False, savers.checkpoints)
    peak, exact = closest
    came = ("" if not math.isfinite(peak) else f" (the closest came to {peak / 2**30:.2f} GiB)" if exact
            else f" (none came under {peak / 2**30:.2f} GiB)")
    alternatives = "".join(
        f"; {s.text()} instead: " + ("does not fit" if p is None else "slower" if p is SLOWER
                                     else f"{p.predicted_step_time * 1e3:.1f} ms")
        for s, p in others.items())
    return f"{taken.text()}: no plan fits the devices' {limit / 2**30:.2f} GiB without it{came}{alternatives}"


def why_faster(plan, without, limit: float) -> str:
    """Why ``plan`` recomputes although ``without`` (its search without recompute) fits."""
    what = Savers(plan.recompute, False).text()
    return (f"{what}: {plan.predicted_step_time * 1e3:.1f} ms against {without.predicted_step_time * 1e3:.1f} ms"
            f" without it, whose sharding the {limit / 2**30:.2f} GiB limit binds (peak"
            f" {without.predicted_peak_memory / 2**30:.2f} GiB, ZeRO-{without.zero})")


__all__ = ["RECOMPUTE", "SLOWER", "Savers", "TIGHT", "memory_bound", "saver_levels", "why_faster", "why_taken"]
