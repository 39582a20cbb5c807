"""Single-group moves: what each strategy of one group costs while its neighbours keep theirs.

Both the ILP's tie-break towards fewer bytes (:mod:`autopar.solver.ilp`) and the Lagrangian's
spending of unused bytes (:mod:`autopar.solver.lagrange`) move one group at a time to a better
strategy; :class:`Neighbours` gives the cost vector each move compares.
"""

from __future__ import annotations

import numpy as np


class Neighbours:
    """The edges at each group of ``edges`` (``(g, h, R)``: ``R[s_g, s_h]``), as ``(other, matrix
    indexed by this group's strategy first)``."""

    def __init__(self, edges):
        self.incident: dict[int, list] = {}
        for g, h, m in edges:
            self.incident.setdefault(g, []).append((h, m))
            self.incident.setdefault(h, []).append((g, m.T))

    def seconds(self, g: int, costs: np.ndarray, choice) -> np.ndarray:
        """Group ``g``'s node ``costs`` plus its edges' costs at the neighbours' strategies in
        ``choice`` (indexable by group), one entry per strategy of ``g``."""
        return costs + sum((m[:, choice[h]] for h, m in self.incident.get(g, ())), np.zeros(len(costs)))


__all__ = ["Neighbours"]
