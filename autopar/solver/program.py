"""The mixed-integer program of :mod:`autopar.solver.ilp` in plain arrays, and the function that
adds each constraint family: :func:`add_one_hot`, :func:`add_edge_marginals`,
:func:`add_memory_rows` and, for the smallest-peak program, :func:`add_peak_rows`.
"""

from __future__ import annotations

import math

import numpy as np

from autopar.solver.presolve import row_max


class Program:
    """A mixed-integer linear program in plain arrays: variables, objective, sparse rows."""

    def __init__(self):
        self.objective: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.num_vars = 0
        self.entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row, col, coef)
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []

    def add_vars(self, count: int, *, objective=None, upper=1.0, integer: bool) -> np.ndarray:
        ids = np.arange(self.num_vars, self.num_vars + count)
        self.num_vars += count
        self.objective.append(np.zeros(count) if objective is None else np.asarray(objective, float))
        self.upper.append(np.full(count, float(upper)))
        self.integer.append(np.full(count, integer))
        return ids

    def add_row(self, cols, coefs, *, lower: float, upper: float) -> None:
        row = len(self.row_lower)
        cols = np.asarray(cols, dtype=np.int64)
        self.entries.append((np.full(cols.size, row), cols, np.asarray(coefs, dtype=np.float64)))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


def add_one_hot(program: Program, groups: list[int], costs: list[np.ndarray], scale: float) -> dict:
    """One vector s_g per free group, Σ_a s_g[a] = 1; its objective is the group's cost."""
    s = {}
    for g in groups:
        s[g] = program.add_vars(len(costs[g]), objective=costs[g] * scale, integer=True)
        program.add_row(s[g], np.ones(len(s[g])), lower=1.0, upper=1.0)
    return s


def add_edge_marginals(program: Program, edges, s: dict, scale: float, *, integer: bool) -> list:
    """Product variables e_gh with row sums equal to s_g and column sums equal to s_h.

    Strategies of ``g`` with equal rows of ``R_gh`` (and of ``h`` with equal columns) share one
    row (column) of ``e``, its marginal being the sum of their ``s``: for integral ``s`` the one
    chosen class pair still carries the product, at the same cost, with fewer variables and rows.
    Returns, per edge, ``(e, row class of each g strategy, column class of each h strategy)``."""
    product = []
    for g, h, matrix in edges:
        rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
        unique, col_of = np.unique(rows, axis=1, return_inverse=True)
        row_of, col_of = row_of.ravel(), col_of.ravel()
        kr, kc = unique.shape
        e = program.add_vars(kr * kc, objective=unique.ravel() * scale, integer=integer).reshape(kr, kc)
        product.append((e, row_of, col_of))
        for r in range(kr):
            members = s[g][row_of == r]
            program.add_row(np.append(e[r], members), np.append(np.ones(kc), -np.ones(len(members))),
                            lower=0.0, upper=0.0)
        for c in range(kc):
            members = s[h][col_of == c]
            program.add_row(np.append(e[:, c], members), np.append(np.ones(kr), -np.ones(len(members))),
                            lower=0.0, upper=0.0)
    return product


def _row_entries(terms: dict[int, np.ndarray], s: dict, scale: float):
    """(columns, coefficients) of a memory row's bytes over the one-hot variables."""
    cols = np.concatenate([s[g] for g in terms]) if terms else np.zeros(0, np.int64)
    coefs = np.concatenate([v for v in terms.values()]) * scale if terms else np.zeros(0)
    return cols, coefs


def add_memory_rows(program: Program, rows, s: dict, limit: float, scale: float) -> None:
    """K_r + Σ m_r·s ≤ limit for every row that some plan could break."""
    for constant, terms in rows:
        cols, coefs = _row_entries(terms, s, scale)
        program.add_row(cols, coefs, lower=-math.inf, upper=(limit - constant) * scale)


def add_peak_rows(program: Program, rows, s: dict, scale: float, *, integer: bool) -> int:
    """A variable P (the objective) with K_r + Σ m_r·s ≤ P for every row; returns P's index."""
    top = max(row_max(r) for r in rows) * scale
    peak = int(program.add_vars(1, objective=[1.0], upper=math.ceil(top) if integer else top, integer=integer)[0])
    for constant, terms in rows:
        cols, coefs = _row_entries(terms, s, scale)
        program.add_row(np.append(cols, peak), np.append(coefs, -1.0), lower=-math.inf, upper=-constant * scale)
    return peak


def decode(values: np.ndarray, s: dict) -> dict[int, int]:
    """The strategy each group's one-hot vector ``s[g]`` picks in a solution's ``values``."""
    return {g: int(np.argmax(values[ids])) for g, ids in s.items()}


__all__ = ["Program", "add_edge_marginals", "add_memory_rows", "add_one_hot", "add_peak_rows", "decode"]
