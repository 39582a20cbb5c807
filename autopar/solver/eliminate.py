"""Exact min-sum variable elimination for strategy selection without a memory limit.

Minimises ``Σ_g c_g[s_g] + Σ_(g,h) R_gh[s_g, s_h]`` over one strategy per group by eliminating
groups one at a time (bucket elimination, dynamic programming on a tree decomposition): removing
group ``x`` with neighbours ``N`` sums every factor that mentions ``x`` and takes the minimum
over ``x``, leaving one factor over ``N`` and a table of the best ``x`` for each assignment of
``N``. Groups go in the greedy order that keeps the new factor smallest; when every remaining
group would create a factor of more than ``max_entries`` entries the problem is handed back
(``None``) to the ILP. The cost graphs of layered models are close to trees (a transformer
layer has treewidth 2 or 3 after follower folding), so this takes milliseconds where an LP
over the edge-product variables takes seconds. Memory rows are not modelled: the caller checks
the answer against them and solves the ILP only when it does not fit.

Example::

    choice = eliminate([np.array([1.0, 2.0]), np.array([3.0, 0.5])],
                       [(0, 1, np.array([[0.0, 4.0], [1.0, 0.0]]))])
    choice.tolist()          # [1, 1]
"""

from __future__ import annotations

import numpy as np

MAX_ENTRIES = 1 << 22  # largest intermediate factor (float64 entries) elimination may build


def _embed(variables: tuple[int, ...], table: np.ndarray, axes: list[int]) -> np.ndarray:
    """``table`` over ``variables`` as an array broadcastable over ``axes`` (their order)."""
    position = {v: a for a, v in enumerate(axes)}
    order = sorted(range(len(variables)), key=lambda i: position[variables[i]])
    moved = np.transpose(table, order)
    shape = [1] * len(axes)
    for i in order:
        shape[position[variables[i]]] = table.shape[i]
    return moved.reshape(shape)


def eliminate(costs, edges, *, max_entries: int = MAX_ENTRIES) -> np.ndarray | None:
    """One strategy index per group minimising node plus edge costs, or ``None`` when the
    graph is too entangled for factors of at most ``max_entries`` entries."""
    sizes = [len(c) for c in costs]
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    touching: list[set[int]] = [set() for _ in costs]  # group -> ids of factors mentioning it
    created = 0

    def add(variables: tuple[int, ...], table: np.ndarray) -> None:
        nonlocal created
        factors[created] = (variables, table)
        for v in variables:
            touching[v].add(created)
        created += 1

    for g, c in enumerate(costs):
        add((g,), np.asarray(c, dtype=np.float64))
    for g, h, m in edges:
        add((g, h), np.asarray(m, dtype=np.float64))

    def neighbours(x: int) -> set[int]:
        return {v for f in touching[x] for v in factors[f][0]} - {x}

    def entries(x: int) -> float:  # size of the table eliminating x builds
        return float(np.prod([sizes[v] for v in neighbours(x)], dtype=np.float64)) * sizes[x]

    score = {x: entries(x) for x in range(len(costs))}
    steps: list[tuple[int, list[int], np.ndarray]] = []  # (group, neighbours, argmin table)
    while score:
        x = min(score, key=lambda v: (score[v], v))
        if score[x] > max_entries:
            return None
        axes = sorted(neighbours(x)) + [x]
        total = np.zeros([sizes[v] for v in axes])
        for f in list(touching[x]):
            variables, table = factors.pop(f)
            total = total + _embed(variables, table, axes)
            for v in variables:
                touching[v].discard(f)
        steps.append((x, axes[:-1], np.argmin(total, axis=-1)))
        add(tuple(axes[:-1]), total.min(axis=-1))
        del score[x]
        for v in axes[:-1]:
            score[v] = entries(v)
    choice = np.zeros(len(costs), dtype=np.int64)
    for x, rest, table in reversed(steps):
        choice[x] = int(table[tuple(int(choice[v]) for v in rest)])
    return choice


__all__ = ["MAX_ENTRIES", "eliminate"]
