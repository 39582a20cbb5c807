"""The intra-op plans a pipeline stage may run on its ``tp`` axis: the window's ILP solved for the
fastest plan, the fastest Megatron-style plan (no split of dim 0 on the ``tp`` axis) and the plan
of least memory, with the window's ``layer`` part weighted as all ``L − 1`` repeated layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.core.ir import Strategy
from autopar.planner.costgraph import CostGraph, CostNode
from autopar.planner.layers import LAYER, part_of
from autopar.planner.solve import restrict, solve_graph


def weighted(g: CostGraph, weight: float) -> CostGraph:
    """The window's cost graph with the ``layer`` part (its nodes, parameters and the edges into
    them) counted ``weight`` times: the window then stands for a model of ``weight + 1`` layers."""
    scale = np.array([weight if part_of(n.layer) == LAYER else 1.0 for n in g.nodes])
    nodes = [CostNode(n.name, n.kind, n.strategies, n.compute * scale[i], n.communication * scale[i],
                      n.memory * scale[i], n.memory_kind, n.layer, n.op, n.target, n.requires_grad, n.fixed)
             for i, n in enumerate(g.nodes)]
    edges = [dataclasses.replace(e, cost=e.cost * scale[e.dst], phases=None) for e in g.edges]
    unary = {i: v * scale[i] for i, v in g.unary.items()}
    return CostGraph(nodes, edges, g.index, unary, g.flops_per_step)


@dataclass(frozen=True)
class Candidate:
    """One intra-op plan of the window on the tp axis: a strategy per node (by name)."""

    name: str
    tp: int
    choice: tuple[tuple[str, Strategy], ...]

    def strategy_of(self) -> dict[str, Strategy]:
        return dict(self.choice)


def _solve(graph: CostGraph, options, limit, method) -> np.ndarray:
    return solve_graph(graph, options, limit, method=method).choice


def candidates(window_graph: CostGraph, options, *, tp: int, layer_weight: float, megatron_allow=None
               ) -> tuple[list[Candidate], dict[str, int]]:
    """The fastest, the fastest Megatron-style and the least-memory plans of the window's cost
    graph on ``tp`` devices (equal plans once), and the index of each by name."""
    graph = weighted(window_graph, layer_weight)
    if tp == 1:
        only = _candidate("replicated", window_graph, np.zeros(len(graph.nodes), dtype=int), tp)
        return [only], {"fastest": 0, "megatron": 0, "lean": 0}
    out: list[tuple[str, CostGraph, np.ndarray]] = []
    out.append(("fastest", graph, _solve(graph, options, None, "stage: fastest")))
    if megatron_allow is not None:
        mgraph = restrict(graph, megatron_allow)
        out.append(("megatron", mgraph, _solve(mgraph, options, None, "stage: megatron")))
    try:
        _solve(graph, options, 1.0, "stage: least memory")
    except InfeasibleError as exc:
        if exc.smallest_peak is not None and math.isfinite(exc.smallest_peak):
            try:
                out.append(("lean", graph, _solve(graph, options, exc.smallest_peak * (1 + 1e-6) + 1,
                                                  "stage: least memory")))
            except InfeasibleError:
                pass
    result: list[Candidate] = []
    names: dict[str, int] = {}
    for name, g, choice in out:
        cand = _candidate(name, g, choice, tp)
        for k, other in enumerate(result):
            if other.choice == cand.choice:
                names[name] = k
                break
        else:
            names[name] = len(result)
            result.append(cand)
    return result, names


def _candidate(name, graph: CostGraph, choice, tp) -> Candidate:
    return Candidate(name, tp, tuple((n.name, n.strategies[int(c)]) for n, c in zip(graph.nodes, choice)))


__all__ = ["Candidate", "candidates", "weighted"]
