"""Exact presolve of the strategy ILP, and the way back from its groups to the nodes.

:func:`presolve` merges tied nodes into groups, makes nodes with one strategy constants, splits
each edge matrix as ``R = r1ᵀ + 1cᵀ + R'`` (row minima, then column minima, moved into the node
costs) and drops it when ``R' = 0``, and moves each memory row's least bytes per group into its
constant. :func:`choice_of` expands a strategy per group to one per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autopar.solver.problem import ILPProblem


@dataclass
class Reduced:
    """The presolved problem over groups of tied nodes; ``free`` groups still have a choice."""

    group_of: np.ndarray  # node → group
    costs: list[np.ndarray]  # per group
    edges: list[tuple[int, int, np.ndarray]]  # residual matrices, groups g < h, both free
    rows: list[tuple[float, dict[int, np.ndarray]]]  # every memory row: (constant, group → bytes)
    offset: float
    fixed: dict[int, int] = field(default_factory=dict)  # group → strategy decided in presolve


def merge_ties(problem: ILPProblem) -> np.ndarray:
    """Ties by substitution: tied nodes map to one group and share one one-hot vector."""
    parent = list(range(problem.num_nodes))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for u, v in problem.ties:
        a, b = root(u), root(v)
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [root(i) for i in range(problem.num_nodes)]
    _, group_of = np.unique(roots, return_inverse=True)
    return group_of.astype(np.int64)


def presolve(problem: ILPProblem) -> Reduced:
    """The exact rewrite of the module docstring."""
    group_of = merge_ties(problem)
    num_groups = int(group_of.max()) + 1 if problem.num_nodes else 0
    costs = [np.zeros(0)] * num_groups
    for i, c in enumerate(problem.node_costs):
        g = group_of[i]
        costs[g] = c.copy() if costs[g].size == 0 else costs[g] + c
    sizes = [len(c) for c in costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, matrix in problem.edges:
        g, h = group_of[u], group_of[v]
        if g == h:
            costs[g] = costs[g] + np.diag(matrix)
            continue
        if g > h:
            g, h, matrix = h, g, matrix.T
        merged[(g, h)] = merged[(g, h)] + matrix if (g, h) in merged else matrix.copy()
    edges = []
    for (g, h), matrix in merged.items():
        row_min = matrix.min(axis=1)
        matrix = matrix - row_min[:, None]
        col_min = matrix.min(axis=0)
        matrix = matrix - col_min[None, :]
        costs[g] = costs[g] + row_min
        costs[h] = costs[h] + col_min
        if sizes[g] > 1 and sizes[h] > 1 and matrix.max() > 0:
            edges.append((int(g), int(h), matrix))
    # With one strategy on either side the residual is zero: the minima moved everything.
    offset = 0.0
    fixed = {}
    for g, c in enumerate(costs):
        if sizes[g] == 1:
            fixed[g] = 0
            offset += float(c[0])
    rows = []
    for row in problem.memory_rows:
        constant = row.constant
        terms: dict[int, np.ndarray] = {}
        for i, vector in row.terms:
            g = int(group_of[i])
            terms[g] = terms[g] + vector if g in terms else vector.copy()
        reduced = {}
        for g, vector in terms.items():
            low = float(vector.min())
            constant += low
            if sizes[g] > 1 and vector.max() > low:
                reduced[g] = vector - low
        rows.append((constant, reduced))
    return Reduced(group_of=group_of, costs=costs, edges=edges, rows=rows, offset=offset, fixed=fixed)


def row_max(row: tuple[float, dict[int, np.ndarray]]) -> float:
    """The most bytes a reduced memory row can reach."""
    return row[0] + sum(float(v.max()) for v in row[1].values())


def choice_of(problem: ILPProblem, reduced: Reduced, decided: dict[int, int]) -> np.ndarray:
    """One strategy per node of ``problem`` from the groups' (decided, else fixed in presolve)."""
    choice = np.array([decided.get(int(g), reduced.fixed.get(int(g), 0)) for g in reduced.group_of], dtype=np.int64)
    choice.setflags(write=False)
    return choice


def group_memory(reduced: Reduced, g: int) -> np.ndarray:
    """Bytes per strategy of group ``g`` summed over the memory rows (its tie-breaker)."""
    return sum((terms[g] for _, terms in reduced.rows if g in terms), np.zeros(len(reduced.costs[g])))


def least_of(time: np.ndarray, memory: np.ndarray) -> int:
    """The strategy of least ``memory`` among those of least ``time``."""
    near = np.flatnonzero(time == time.min())
    return int(near[np.argmin(memory[near])])


__all__ = ["Reduced", "choice_of", "group_memory", "least_of", "presolve", "row_max"]
