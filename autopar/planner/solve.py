"""Solving a cost graph: restrict its strategies, simplify it, solve the ILP, expand the answer
to one strategy per node; and the total cost of any such choice.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from autopar.core.errors import InfeasibleError, SolverTimeLimitWarning
from autopar.plan import SolverStats
from autopar.planner.costgraph import CostGraph, CostNode, copied
from autopar.planner.simplify import simplify
from autopar.solver import ILPProblem, MemoryRow, solve_ilp
from autopar.solver.relaxed import relaxed_floor
from autopar.solver.least import least_memory

Allow = Callable[[CostGraph, int, object], bool]  # (graph, node index, strategy) -> keep?


@dataclass
class Solved:
    """A cost graph with one strategy index per node, and how it was found."""

    graph: CostGraph
    choice: np.ndarray
    stats: SolverStats
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # what plans of it share (ZeRO's analysis)


def restrict(graph: CostGraph, allow: Allow) -> CostGraph:
    """Keep only the strategies ``allow(graph, node index, strategy)`` accepts (at least one:
    the all-replicated strategy stays when a node would have none)."""
    keep = []
    for n, node in enumerate(graph.nodes):
        idx = [i for i, s in enumerate(node.strategies) if allow(graph, n, s)]
        if not idx:
            idx = [0]
        keep.append(np.array(idx))
    nodes = []
    for node, idx in zip(graph.nodes, keep):
        nodes.append(CostNode(
            node.name, node.kind, [node.strategies[i] for i in idx], node.compute[idx],
            node.communication[idx], node.memory[idx], node.memory_kind, node.layer, node.op,
            node.target, node.requires_grad, node.fixed and 0 in idx.tolist() and idx[0] == 0,
            node.batch_dependent, node.spec, None if node.forward is None else node.forward[idx], node.flops,
        ))

    edges = [copied(e, cost=e.cost[np.ix_(keep[e.src], keep[e.dst])], phases=None) for e in graph.edges]
    unary = {i: v[keep[i]] for i, v in graph.unary.items()}
    return CostGraph(nodes, edges, graph.index, unary, graph.flops_per_step)


def solve_graph(graph: CostGraph, options, memory_limit: float | None, *, method: str,
                cutoff: float | None = None) -> Solved:
    """Simplify ``graph``, solve the ILP, expand to one strategy per node; ``cutoff``: a cost
    only a choice below which matters (status ``"cut"`` where the solve proves none is:
    :func:`~autopar.solver.ilp.solve_ilp`)."""
    return _solved(graph, options, memory_limit, method=method, least=False, cutoff=cutoff)


def solve_least_memory(graph: CostGraph, options, *, method: str) -> Solved:
    """The fastest choice of ``graph`` among those whose summed memory (what the ILP bounds) is
    least (:func:`autopar.solver.least.least_memory`)."""
    return _solved(graph, options, None, method=method, least=True)


def least_memory_sum(graph: CostGraph, options) -> float:
    """The least memory sum (what the ILP bounds) any choice of ``graph`` reaches: the sum of
    each solver group's least bytes. A bound below it has no plan, as the ILP would find."""
    red = _reduced(graph, options)
    return red.constant_memory + sum(float(m.min()) for m in red.memory)


def _reduced(graph: CostGraph, options):
    """``graph`` simplified, kept in its memo: the same for every memory bound a try solves at."""
    key = ("simplified", options.share_layers)
    red = graph.memo.get(key)
    if red is None:
        same = graph.memo.get("costs of")  # a memory saver's view of it: only the memory is summed again
        if same is None:
            red = simplify(graph, share_layers=options.share_layers)
        else:
            base = same.memo.get(key)
            if base is None:
                base = same.memo[key] = simplify(same, share_layers=options.share_layers)
            red = base.with_memory(graph)
        graph.memo[key] = red
    return red


def _problem(red, memory_limit: float | None) -> ILPProblem:
    """The ILP of a simplified graph under ``memory_limit`` bytes (None: no limit)."""
    return ILPProblem(
        node_costs=red.costs,
        edges=[(u, v, m) for (u, v), m in red.edges.items()],
        memory_rows=[MemoryRow(tuple(enumerate(red.memory)), red.constant_memory)],
        memory_limit=memory_limit,
    )


def solve_floor(graph: CostGraph, options) -> float:
    """A floor on the cost (:func:`evaluate`) of every choice a solve of ``graph`` returns, under
    any memory bound: its simplified problem's :func:`~autopar.solver.relaxed.relaxed_floor`."""
    key = ("solve floor", options.share_layers)
    if key not in graph.memo:
        graph.memo[key] = relaxed_floor(_problem(_reduced(graph, options), None))
    return graph.memo[key]


def _solved(graph: CostGraph, options, memory_limit: float | None, *, method: str, least: bool,
            cutoff: float | None = None) -> Solved:
    start = time.perf_counter()
    red = _reduced(graph, options)
    problem = _problem(red, memory_limit)
    try:
        if least:
            sol = least_memory(problem, time_limit_s=options.time_limit_s, backend=options.backend,
                               relative_gap=options.relative_gap)
        else:
            sol = solve_ilp(problem, time_limit_s=options.time_limit_s, backend=options.backend,
                            relative_gap=options.relative_gap, cutoff=cutoff)
    except InfeasibleError as exc:
        raise InfeasibleError(
            f"{method}: {exc}", smallest_peak=exc.smallest_peak
        ) from None
    if not sol.optimal and sol.status != "cut":
        bound = f"within {sol.gap:.1%} of the best bound" if np.isfinite(sol.gap) else "with no bound yet"
        warnings.warn(f"{method}: the solver stopped at time_limit_s={options.time_limit_s} with the best plan"
                      f" found so far, {bound} (plan.solver.gap); raise Options(time_limit_s=...) for a"
                      " better plan", SolverTimeLimitWarning, stacklevel=3)
    stats = SolverStats(
        method=method, status=sol.status, optimal=bool(sol.optimal), gap=float(sol.gap),
        solve_time_s=time.perf_counter() - start, graph_nodes=len(graph.nodes),
        solver_nodes=problem.num_nodes, num_variables=sol.num_variables,
        num_constraints=sol.num_constraints,
    )
    return Solved(graph, red.expand(sol.choice), stats)


def evaluate(graph: CostGraph, choice) -> float:
    """Total predicted cost (seconds) of a full assignment, straight from the cost graph."""
    total = sum(float(n.cost()[c]) for n, c in zip(graph.nodes, choice))
    total += sum(float(v[choice[i]]) for i, v in graph.unary.items())
    total += sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in graph.edges)
    return total


def least_cost(graph: CostGraph) -> float:
    """A floor on :func:`evaluate` of every choice: each node's, output's and edge's cheapest
    entry, summed (no solve)."""
    total = sum(float(n.cost().min()) for n in graph.nodes)
    total += sum(float(v.min()) for v in graph.unary.values())
    return total + sum(float(e.cost.min()) for e in graph.edges)


__all__ = ["Allow", "Solved", "evaluate", "least_cost", "least_memory_sum", "restrict", "solve_floor", "solve_graph",
           "solve_least_memory"]
