"""The strategy ILP's data, numpy in and numpy out: an :class:`ILPProblem` (node costs, edge
resharding matrices, memory rows, ties), checked when built, and the :class:`ILPSolution`
:func:`autopar.solver.ilp.solve_ilp` returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.core.errors import SolverInputError


def _vector(values, what: str) -> np.ndarray:
    array = np.array(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise SolverInputError(f"{what} must be a non-empty 1-D array, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise SolverInputError(f"{what} must be finite and non-negative, got {array}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class MemoryRow:
    """Bytes live on the worst device at one program point: ``constant + Σ vector[choice[node]]``."""

    terms: tuple[tuple[int, np.ndarray], ...]
    constant: float = 0.0

    def __post_init__(self):
        terms = []
        for term in self.terms:
            if len(term) != 2 or isinstance(term[0], bool) or not isinstance(term[0], (int, np.integer)):
                raise SolverInputError(f"a memory term must be (node index, byte vector), got {term!r}")
            terms.append((int(term[0]), _vector(term[1], f"memory vector of node {term[0]}")))
        if not math.isfinite(self.constant) or self.constant < 0:
            raise SolverInputError(f"memory row constant must be finite and ≥ 0, got {self.constant}")
        object.__setattr__(self, "terms", tuple(terms))
        object.__setattr__(self, "constant", float(self.constant))


@dataclass(frozen=True, eq=False)
class ILPProblem:
    """One strategy per node; node costs, edge resharding matrices, memory rows, tied nodes."""

    node_costs: Sequence[np.ndarray]
    edges: Sequence[tuple[int, int, np.ndarray]] = ()
    memory_rows: Sequence[MemoryRow] = ()
    memory_limit: float | None = None
    ties: Sequence[tuple[int, int]] = ()

    def __post_init__(self):
        costs = tuple(_vector(c, f"node_costs[{i}]") for i, c in enumerate(self.node_costs))
        n = len(costs)
        sizes = [len(c) for c in costs]

        def node(index, where: str) -> int:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n:
                raise SolverInputError(f"{where}: node index {index!r} is not in 0..{n - 1}")
            return int(index)

        edges = []
        for e, edge in enumerate(self.edges):
            if len(edge) != 3:
                raise SolverInputError(f"edges[{e}] must be (u, v, matrix), got {len(edge)} items")
            u, v = node(edge[0], f"edges[{e}]"), node(edge[1], f"edges[{e}]")
            if u == v:
                raise SolverInputError(f"edges[{e}] joins node {u} to itself; fold it into node_costs[{u}]")
            matrix = np.array(edge[2], dtype=np.float64)
            if matrix.shape != (sizes[u], sizes[v]):
                raise SolverInputError(
                    f"edges[{e}] ({u}→{v}) matrix has shape {matrix.shape}, expected {(sizes[u], sizes[v])}"
                )
            if not np.all(np.isfinite(matrix)) or np.any(matrix < 0):
                raise SolverInputError(f"edges[{e}] ({u}→{v}) costs must be finite and non-negative")
            matrix.setflags(write=False)
            edges.append((u, v, matrix))
        rows = tuple(self.memory_rows)
        for r, row in enumerate(rows):
            if not isinstance(row, MemoryRow):
                raise SolverInputError(f"memory_rows[{r}] must be a MemoryRow, got {type(row).__name__}")
            for i, vector in row.terms:
                if len(vector) != sizes[node(i, f"memory_rows[{r}]")]:
                    raise SolverInputError(
                        f"memory_rows[{r}]: node {i} has {sizes[i]} strategies but its vector has {len(vector)}"
                    )
        limit = self.memory_limit
        if limit is not None:
            if isinstance(limit, bool) or not math.isfinite(limit) or limit < 0:
                raise SolverInputError(f"memory_limit must be None or finite and ≥ 0, got {limit!r}")
            limit = float(limit)
        ties = []
        for t, tie in enumerate(self.ties):
            if len(tie) != 2:
                raise SolverInputError(f"ties[{t}] must be a pair of node indices, got {tie!r}")
            u, v = node(tie[0], f"ties[{t}]"), node(tie[1], f"ties[{t}]")
            if sizes[u] != sizes[v]:
                raise SolverInputError(
                    f"ties[{t}] joins node {u} ({sizes[u]} strategies) and node {v} ({sizes[v]}); "
                    "tied nodes must offer the same strategies in the same order"
                )
            ties.append((u, v))
        object.__setattr__(self, "node_costs", costs)
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "memory_rows", rows)
        object.__setattr__(self, "memory_limit", limit)
        object.__setattr__(self, "ties", tuple(ties))

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def _checked_choice(self, choice) -> np.ndarray:
        choice = np.asarray(choice)
        if choice.shape != (self.num_nodes,) or not np.issubdtype(choice.dtype, np.integer):
            raise SolverInputError(f"choice must be {self.num_nodes} integers, got {choice.dtype} {choice.shape}")
        for i, (a, c) in enumerate(zip(choice, self.node_costs)):
            if not 0 <= a < len(c):
                raise SolverInputError(f"choice[{i}] = {a} but node {i} has {len(c)} strategies")
        return choice

    def objective_of(self, choice) -> float:
        """Total cost of one strategy per node (ties are not checked)."""
        choice = self._checked_choice(choice)
        total = sum(float(c[a]) for c, a in zip(self.node_costs, choice))
        return total + sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges)

    def peak_of(self, choice) -> float:
        """Largest memory row for one strategy per node; 0 when there are no rows."""
        choice = self._checked_choice(choice)
        return max(
            (row.constant + sum(float(vec[choice[i]]) for i, vec in row.terms) for row in self.memory_rows),
            default=0.0,
        )


@dataclass(frozen=True, eq=False)
class ILPSolution:
    """The chosen strategy per node and how the solve went (``gap`` is relative, ≥ 0)."""

    choice: np.ndarray
    objective: float
    peak_memory: float
    optimal: bool  # proved optimal within the requested relative gap
    gap: float
    status: str  # "optimal", "time_limit", "trivial" (no solver needed) or "cut" (none below the cutoff)
    solve_time_s: float  # wall time of the whole call: presolve, building, solving
    num_variables: int
    num_constraints: int
    backend: str  # "highs", "cpsat", "elimination" or "none"


__all__ = ["ILPProblem", "ILPSolution", "MemoryRow"]
