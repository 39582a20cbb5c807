"""Intra-operator planning: captured graph + cluster → cost graph → simplified ILP → Plan.

``plan_intra`` is what ``autopar.compile`` and every baseline call; a baseline passes
``allow`` to restrict each node's strategies (e.g. data parallel: parameters replicated, inputs
batch-sharded), so baselines and autopar are costed by the very same model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from autopar.core.errors import InfeasibleError, SolverTimeLimitWarning
from autopar.core.placement import format_sharding
from autopar.plan import (
    CollectiveRecord,
    MemoryBreakdown,
    NodeChoice,
    Plan,
    SolverStats,
    TimeBreakdown,
)
from autopar.planner.alternatives import node_details
from autopar.planner.costgraph import CostEdge, CostGraph, CostNode, build_cost_graph
from autopar.planner.costs import CostModel
from autopar.planner.restrictions import megatron_rule
from autopar.planner.simplify import simplify
from autopar.solver import ILPProblem, MemoryRow, solve_ilp

log = logging.getLogger("autopar.planner")

Allow = Callable[[CostGraph, int, object], bool]  # (graph, node index, strategy) -> keep?


@dataclass
class Solved:
    """A cost graph with one strategy index per node, and how it was found."""

    graph: CostGraph
    choice: np.ndarray
    stats: SolverStats


def graph_fingerprint(captured) -> str:
    """A hash of the graph's ops and shapes: plans are tied to the model they were made for."""
    h = hashlib.sha256()
    for node in captured.graph_module.graph.nodes:
        h.update(f"{node.op}|{node.target}|{node.meta.get('autopar_tensor')}\n".encode())
    return h.hexdigest()[:16]


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

    edges = [CostEdge(e.src, e.dst, e.out_index, e.in_index, e.meta, e.cost[np.ix_(keep[e.src], keep[e.dst])])
             for e in graph.edges]
    unary = {i: v[keep[i]] for i, v in graph.unary.items()}
    return CostGraph(nodes, edges, graph.index, unary, graph.flops_per_step)


def solve_graph(graph: CostGraph, options, memory_limit: float | None, *, method: str) -> Solved:
    """Simplify ``graph``, solve the ILP, expand to one strategy per node."""
    start = time.perf_counter()
    red = simplify(graph, share_layers=options.share_layers)
    problem = ILPProblem(
        node_costs=red.costs,
        edges=[(u, v, m) for (u, v), m in red.edges.items()],
        memory_rows=[MemoryRow(tuple(enumerate(red.memory)), red.constant_memory)],
        memory_limit=memory_limit,
    )
    try:
        sol = solve_ilp(problem, time_limit_s=options.time_limit_s, backend=options.backend,
                        relative_gap=options.relative_gap)
    except InfeasibleError as exc:
        raise InfeasibleError(
            f"{method}: {exc}", smallest_peak=exc.smallest_peak
        ) from None
    if not sol.optimal:
        bound = f"within {sol.gap:.1%} of the best bound" if np.isfinite(sol.gap) else "with no bound yet"
        warnings.warn(f"{method}: the solver stopped at time_limit_s={options.time_limit_s} with the best plan"
                      f" found so far, {bound} (plan.solver.gap); raise Options(time_limit_s=...) for a"
                      " better plan", SolverTimeLimitWarning, stacklevel=2)
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


def build_plan(solved: Solved, captured, cluster, cost_model: CostModel, options, *, name: str) -> Plan:
    """Turn a solved cost graph into a :class:`Plan` with costs and collectives itemised."""
    graph, choice = solved.graph, solved.choice
    records: list[CollectiveRecord] = []
    comm = resh = 0.0
    edge_time = np.zeros(len(graph.nodes))
    seconds: dict = {}  # (kind, bytes, axis) -> collective seconds
    for e in graph.edges:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        s, t = src.strategies[choice[e.src]], dst.strategies[choice[e.dst]]
        grad = src.requires_grad and e.meta.dtype.is_floating_point
        steps = cost_model.collectives(e.meta, s.outputs[e.out_index], t.inputs[e.in_index], t, grad=grad,
                                       regather=src.kind == "parameter")
        for phase, kind, axis, nbytes in steps:
            secs = seconds.get((kind, nbytes, axis))
            if secs is None:
                secs = seconds[(kind, nbytes, axis)] = cluster.collective_time(kind, nbytes, axis)
            records.append(CollectiveRecord(kind, (axis,) if isinstance(axis, int) else tuple(axis), nbytes, phase, dst.name, secs))
            edge_time[e.dst] += secs
            if src.kind == "parameter":
                comm += secs
            else:
                resh += secs
    for i, extra in graph.unary.items():
        resh += float(extra[choice[i]])
        edge_time[i] += float(extra[choice[i]])
    nodes, params, inputs, param_memory = [], {}, {}, {}
    p_mem = g_mem = o_mem = act = 0.0
    compute = 0.0
    gm_nodes = {n.name: n for n in captured.graph_module.graph.nodes}
    details = node_details(graph, choice, captured, cost_model)
    texts: dict[int, tuple] = {}  # id(strategy) -> its shardings as text (layers share strategies)
    for i, (node, c) in enumerate(zip(graph.nodes, choice)):
        strat = node.strategies[c]
        if node.kind == "parameter":
            params[node.target] = tuple(str(p) for p in strat.outputs[0])
            meta = captured.parameters[node.target]
            p, g, o = cost_model.parameter_split(meta, strat.outputs[0])
            param_memory[node.target] = (p, g, o)
            p_mem, g_mem, o_mem = p_mem + p, g_mem + g, o_mem + o
            continue
        act += float(node.memory[c])
        if node.kind == "user_input":
            inputs[node.target] = tuple(str(p) for p in strat.outputs[0])
            continue
        if node.kind != "op":
            continue
        compute += float(node.compute[c])
        text = texts.get(id(strat))
        if text is None:
            text = texts[id(strat)] = (tuple(format_sharding(s) for s in strat.inputs),
                                       tuple(format_sharding(s) for s in strat.outputs))
        nodes.append(NodeChoice(
            node.name, node.op, gm_nodes[node.name].meta.get("autopar_module"), node.layer, *text,
            float(node.compute[c]), float(edge_time[i] + node.communication[c]), len(node.strategies),
            local=strat.local, **details[node.name],
        ))
    return Plan(
        name=name, cluster=cluster, mesh_shape=tuple(cluster.mesh_shape),
        fingerprint=graph_fingerprint(captured), nodes=tuple(nodes), parameter_placements=params,
        input_placements=inputs, collective_records=tuple(records),
        time=TimeBreakdown(compute=compute, communication=comm, resharding=resh),
        memory=MemoryBreakdown(parameters=p_mem, gradients=g_mem, optimizer=o_mem, activations=act),
        flops_per_step=graph.flops_per_step,
        peak_flops=cluster.num_devices * cluster.device_spec.peak(
            "bf16" if options.mixed_precision else "fp32"),
        solver=solved.stats, options=options, parameter_memory=param_memory,
    )


def plan_intra(captured, cluster, options, *, allow: Allow | None = None, name: str = "autopar") -> Plan:
    """Plan ``captured`` on ``cluster``'s mesh; ``allow`` restricts strategies (baselines)."""
    log.info("%s: costing strategies on mesh %s", name, tuple(cluster.mesh_shape))
    start = time.perf_counter()
    cost_model = CostModel(cluster, options)
    graph = build_cost_graph(captured, cluster.mesh_shape, cost_model, shard_parameters=options.shard_parameters)
    if allow is not None:
        graph = restrict(graph, allow)
    log.info("%s: cost graph of %d nodes in %.2f s; solving", name, len(graph.nodes), time.perf_counter() - start)
    limit = cluster.memory_per_device * options.memory_fraction
    solved = solve_graph(graph, options, limit, method=name)
    log.info("%s: solved (%s) in %.2f s", name, solved.stats.status, solved.stats.solve_time_s)
    return build_plan(solved, captured, cluster, cost_model, options, name=name)


def candidate_meshes(cluster) -> list[tuple[int, ...]]:
    """Logical meshes worth planning on: the cluster's own and every ``(devices / t, t)`` with
    ``t`` dividing the devices and fitting in a node (the meshes the Megatron grid tries)."""
    n = cluster.num_devices
    per_node = cluster.devices_per_node or n
    shapes = [tuple(cluster.mesh_shape)]
    if cluster.axis_links is None:  # fixed per-axis links tie the plan to the given mesh
        shapes += [(n // t, t) for t in range(1, n + 1) if n % t == 0 and t <= per_node]
    return list(dict.fromkeys(shapes))


def plan_intra_best_mesh(captured, cluster, options, *, name: str = "autopar") -> Plan:
    """The fastest plan over :func:`candidate_meshes` (all on the same devices).

    On each mesh the unrestricted ILP runs, and so do the Megatron-style restrictions the grid
    baseline tries (ZeRO 0 and 3): follower folding makes the unrestricted solve a heuristic,
    and a restricted space can fold better, so the grid's plans are kept as candidates.
    """
    best, tightest = None, None
    for shape in candidate_meshes(cluster):
        mesh = cluster.with_mesh(shape)
        allows = [None] + ([megatron_rule(shape, zero=z) for z in (0, 3)] if len(shape) == 2 else [])
        for allow in allows:
            try:
                plan = plan_intra(captured, mesh, options, allow=allow, name=name)
            except InfeasibleError as exc:
                if tightest is None or (exc.smallest_peak or math.inf) < (tightest.smallest_peak or math.inf):
                    tightest = exc  # no mesh fits: report the one that came closest
                continue
            if best is None or plan.predicted_step_time < best.predicted_step_time:
                best = plan
    if best is None:
        raise tightest
    return best
