"""Plans under one memory row from the relaxed problem, with a bound on how far from optimal.

With one memory row ``Σ_g m_g[s_g] ≤ C`` the Lagrangian of the strategy problem at a price
``λ ≥ 0`` per byte, ``L(λ) = min_s Σ_g (c_g + λ m_g)[s_g] + Σ_(g,h) R_gh[s_g, s_h] − λ C``, is
a floor on the optimum under the row for every ``λ``, and stays one when the minimum is taken
over the problem with edges left out (:mod:`autopar.solver.relaxed`: each is ``≥ 0``), which
exact elimination solves. :func:`lagrangian` bisects ``λ`` between a price whose relaxed optimum
is over the row and one whose optimum fits; at each it improves the relaxed optimum on the whole
problem by block moves (the groups of a cover of the left-out edges fixed, every other group
re-chosen exactly by elimination, then the cover's other side, until no move lowers the priced
cost), spends the bytes a plan within the row leaves by single-group moves, and keeps the
cheapest plan that fits. That plan and the largest floor come back: where
they are within the caller's gap the ILP is not needed; elsewhere the plan seeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.solver.eliminate import eliminate
from autopar.solver.moves import Neighbours
from autopar.solver.relaxed import FLOOR_ENTRIES, kept_edges

BISECTIONS = 12  # halvings of the price interval
RAISES = 10  # quadruplings of the price past the first that may not fit
SWEEPS = 6  # rounds of block moves at one price


@dataclass
class Priced:
    """What :func:`lagrangian` found: the cheapest plan within the row (None: none found), its
    cost, and the largest floor on the optimum."""

    choice: np.ndarray | None
    cost: float
    floor: float


def lagrangian(costs, memory, edges, capacity: float, *, gap: float, max_entries: int = FLOOR_ENTRIES) -> Priced:
    """Plans of ``costs`` (per group), ``edges`` (``(g, h, R ≥ 0)``) with ``Σ memory[g][s_g] ≤
    capacity`` (module docstring); stops once the cheapest plan is within ``gap`` of the floor."""
    problem = _Problem(costs, memory, edges, max_entries)
    best = Priced(None, np.inf, -np.inf)

    def at(price: float) -> float:
        """Bytes of the plan found at ``price``; keeps the best plan and floor."""
        start, floor = problem.relaxed(price)
        best.floor = max(best.floor, floor - price * capacity)
        choice = problem.moved(price, start)
        used = problem.bytes(choice)
        if used <= capacity:
            choice = problem.filled(choice, capacity)
        cost, used = problem.cost(choice), problem.bytes(choice)
        if used <= capacity and cost < best.cost:
            best.choice, best.cost = choice, cost
        return used

    def close() -> bool:
        return best.choice is not None and best.cost - best.floor <= gap * abs(best.cost)

    excess = at(0.0) - capacity
    if excess <= 0 or close():
        return best
    # the price at which the row's bytes cost as much as the plan (where it costs nothing, as
    # every second the problem holds), raised until a plan fits
    seconds = best.floor if best.floor > 0 else sum(float(np.ptp(c)) for c in problem.costs) + sum(
        float(m.max()) for _, _, m in edges)
    low, high = 0.0, max(seconds, 1e-30) / max(capacity, excess)
    for _ in range(RAISES):  # a price high enough to fit
        if at(high) <= capacity:
            break
        low, high = high, high * 4
    else:
        return best  # no plan found within the row
    for _ in range(BISECTIONS):
        if close():
            break
        middle = 0.5 * (low + high)
        if at(middle) > capacity:
            low = middle
        else:
            high = middle
    return best


class _Problem:
    """The groups' costs, bytes and edges, with the edges kept for elimination and the covers of
    those left out."""

    def __init__(self, costs, memory, edges, max_entries: int):
        self.costs = [np.asarray(c, dtype=np.float64) for c in costs]
        self.memory = [np.asarray(m, dtype=np.float64) for m in memory]
        self.edges = edges
        kept, self.order = kept_edges([len(c) for c in costs], edges, max_entries)
        self.kept = [edges[i] for i in kept]
        left = [edges[i] for i in sorted(set(range(len(edges))) - set(kept))]
        self.covers = [sorted({g for g, _, _ in left}), sorted({h for _, h, _ in left})] if left else []

    def priced(self, price: float) -> list[np.ndarray]:
        return [c + price * m for c, m in zip(self.costs, self.memory)]

    def cost(self, choice, costs=None) -> float:
        costs = self.costs if costs is None else costs
        return sum(float(c[a]) for c, a in zip(costs, choice)) + sum(
            float(m[choice[g], choice[h]]) for g, h, m in self.edges)

    def bytes(self, choice) -> float:
        return sum(float(m[a]) for m, a in zip(self.memory, choice))

    def relaxed(self, price: float) -> tuple[np.ndarray, float]:
        """The optimum of the priced problem without the left-out edges, and its priced cost."""
        priced = self.priced(price)
        choice = eliminate(priced, self.kept, order=self.order)
        value = sum(float(c[a]) for c, a in zip(priced, choice))
        return choice, value + sum(float(m[choice[g], choice[h]]) for g, h, m in self.kept)

    def moved(self, price: float, choice: np.ndarray) -> np.ndarray:
        """``choice`` after block moves (module docstring) on the priced whole problem."""
        priced = self.priced(price)
        cost = self.cost(choice, priced)
        for _ in range(SWEEPS if self.covers else 0):
            lowered = False
            for cover in self.covers:
                moved = self._block(priced, choice, set(cover))
                moved_cost = self.cost(moved, priced)
                if moved_cost < cost - 1e-12 * abs(cost):
                    choice, cost, lowered = moved, moved_cost, True
            if not lowered:
                break
        return choice

    def filled(self, choice: np.ndarray, capacity: float) -> np.ndarray:
        """``choice`` (within ``capacity``) after single-group moves, each to the strategy that
        lowers the whole problem's cost most while the row still holds, until none does: the
        bytes a price left unspent."""
        neighbours = Neighbours(self.edges)
        choice, spare = choice.copy(), capacity - self.bytes(choice)
        for _ in range(SWEEPS * 4):
            lowered = False
            for g, memory in enumerate(self.memory):
                seconds = neighbours.seconds(g, self.costs[g], choice)
                room = memory <= memory[choice[g]] + spare
                best = int(np.flatnonzero(room)[np.argmin(seconds[room])])
                if seconds[best] < seconds[choice[g]] * (1 - 1e-12) - 1e-300:
                    spare -= memory[best] - memory[choice[g]]
                    choice[g], lowered = best, True
            if not lowered:
                break
        return choice

    def _block(self, priced, choice: np.ndarray, fixed: set[int]) -> np.ndarray:
        """Every group outside ``fixed`` re-chosen exactly, ``fixed`` keeping ``choice``: no kept
        edge is left out between two free groups, so the kept edges' order holds."""
        free = [g for g in self.order if g not in fixed]
        local = {g: i for i, g in enumerate(free)}
        costs = [priced[g].copy() for g in free]
        edges = []
        for g, h, m in self.edges:
            if g in fixed and h in fixed:
                continue
            if g in fixed:
                costs[local[h]] += m[choice[g], :]
            elif h in fixed:
                costs[local[g]] += m[:, choice[h]]
            else:
                edges.append((local[g], local[h], m))
        picked = eliminate(costs, edges, order=list(range(len(free))))
        moved = choice.copy()
        moved[free] = picked
        return moved


__all__ = ["BISECTIONS", "Priced", "RAISES", "SWEEPS", "lagrangian"]
