"""Intra-operator planning: captured graph + cluster → cost graph → simplified ILP → Plan, one
program on the whole mesh (no pipeline stages).

``plan_intra`` plans on the cluster's mesh. ``autopar.compile`` calls it without pipelining:
through :func:`plan_intra_best_mesh` (the default, ``Options(search_meshes=True)``) or directly.
``autopar demo`` calls it too. The single-mesh baselines (``data_parallel``, ``fsdp``,
``megatron`` and ``grid`` without pipeline stages) and
:func:`autopar.planner.transfer.transfer_plan` call it with ``allow``,
which restricts each node's strategies (e.g. data parallel: parameters replicated, inputs
batch-sharded), so those baselines and autopar are costed by the very same model. Pipelined
plans and baselines are costed by :mod:`autopar.planner.inter` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.core.ir import gradient_inputs, gradient_values
from autopar.core.placement import format_sharding
from autopar.core.precision import MOMENTS
from autopar.core.recompute import recomputed_kernels
from autopar.plan import (
    CollectiveRecord,
    NodeChoice,
    Plan,
    TimeBreakdown,
)
from autopar.plan.assignment import assignment_of
from autopar.plan.records import parameter_counts, program_collectives, trainable_parameters, zero_parameters
from autopar.plan.zero import zero_state_bytes, zero_step_collectives
from autopar.planner.alternatives import DEFAULT_TOP, node_details
from autopar.planner.collector import without_full_collections
from autopar.planner.costgraph import PlannedGraph, build_cost_graph
from autopar.planner.costs import CostModel, captured_dtype, model_precision
from autopar.planner.fetched import fetched, fetched_graph
from autopar.planner.misses import (Unbuilt, choices_floor, closest_miss, host_floor, least_known_peak, peak_floor,
                                    unfit_floor)
from autopar.planner.offload import host_copies, host_limit, host_step_floor, offloaded_graph
from autopar.planner.offload import offload as offload_cost
from autopar.planner.peak import recomputing_graph, step_walk
from autopar.planner.restrictions import megatron_rule
from autopar.planner.savers import RECOMPUTE, SLOWER, Savers, memory_bound, saver_levels, why_faster, why_taken
from autopar.planner.solve import (
    Allow,
    Solved,
    evaluate,
    least_cost,
    least_memory_sum,
    restrict,
    solve_floor,
    solve_graph,
    solve_least_memory,
)
from autopar.planner.tiling import tile_counts
from autopar.planner.time_floor import step_time_floor
from autopar.solver.infeasible import no_plan_fits

log = logging.getLogger("autopar.planner")

PRUNE_MARGIN = 1e-6  # a plan's time may come this share below its solve's cost (_cannot_beat)
SUM_MARGIN = 1e-9  # relative: a least memory sum this far over the bound is left to the solver
FLOOR_FIRST = 0.9  # a least memory sum over this share of the limit checks the least-memory floor before solving
RESOLVES = 2  # times the ILP is solved again, with a tighter bound, for a plan whose step peak is over the limit


def graph_fingerprint(captured) -> str:
    """A hash of the graph's ops and shapes: plans are tied to the model they were made for."""
    h = hashlib.sha256()
    for node in captured.graph_module.graph.nodes:
        h.update(f"{node.op}|{node.target}|{node.meta.get('autopar_tensor')}\n".encode())
    return h.hexdigest()[:16]


def build_plan(solved: Solved, captured, cluster, cost_model: CostModel, options, *, name: str,
               zero: int = 0, offload: bool | str = False, recompute: bool | str | None = None,
               tile: bool = False, checkpoints: bool = False, alternatives: bool = True) -> Plan:
    """Turn a solved cost graph into a :class:`Plan` with costs itemised (records:
    :func:`with_records`), its replicated parameters' optimizer state (``zero=2``: and
    gradients) sharded over their data-parallel axes at ZeRO stage ``zero``
    (:mod:`autopar.plan.zero`). With ``recompute`` (True or "selective"; None: ``options.recompute``
    when True or "selective") every layer recomputes
    its forward in backward: the FLOPs and compute torch's checkpoint runs again are added and the
    peak holds the layers' inputs instead of their saved tensors (:mod:`autopar.core.recompute`).
    ``offload``: the optimizer's state and step on the host (:mod:`autopar.planner.offload`);
    ``"parameters"``: the parameters too, fetched per layer (:mod:`autopar.planner.fetched`), and
    with ``tile`` on a one-device mesh the linears and embeddings too large for the device run tile
    by tile (:mod:`autopar.planner.tiling`). ``checkpoints``: under full recompute the layers'
    checkpoints wait on the host between forward and backward, each moved down and up over the
    link (on the compute stream: paid in full). ``alternatives``: record each node's next-best
    strategies (False for a plan the search may discard: :func:`with_alternatives` adds them later)."""
    graph, choice = solved.graph, solved.choice
    if recompute is None:
        recompute = options.recompute if options.recompute in (True, "selective") else False
    chosen = _chosen(solved, captured, cost_model, recompute, alternatives)
    nodes, params, inputs = chosen.nodes, dict(chosen.params), dict(chosen.inputs)
    param_memory, comm = dict(chosen.param_memory), chosen.comm
    sharded: dict = {}
    if zero:
        key = ("zero parameters", cost_model.precision)  # the same for every ZeRO stage of this choice
        if key not in solved.derived:
            strategies = {node.name: node.strategies[c] for node, c in zip(graph.nodes, choice) if node.kind == "op"}
            # another solve of the search (another saver, restriction or bound) may have chosen the same
            same = (key, tuple(strategies.items()), tuple(params.items()), tuple(inputs.items()))
            if same not in cost_model.memo:
                assignment = assignment_of(SimpleNamespace(mesh_shape=tuple(cluster.mesh_shape), nodes=nodes,
                                                           parameter_placements=params, input_placements=inputs),
                                           captured, strategies=strategies)
                cost_model.memo[same] = zero_parameters(captured, assignment, precision=cost_model.precision)
            solved.derived[key] = cost_model.memo[same]
        sharded = solved.derived[key]
        copy = not cost_model.precision.master
        param_memory = {fqn: zero_state_bytes(state, sharded[fqn][3], cluster.mesh_shape, zero, copy=copy)
                        if fqn in sharded else state
                        for fqn, state in param_memory.items()}
        # the optimizer step's collectives, less the gradient all-reduces they replace
        comm += _zero_seconds(sharded, zero, cost_model) - _zero_seconds(sharded, 0, cost_model)
    host = moved = 0.0
    held, tiles = None, {}
    if offload == "parameters":
        if tile and cluster.num_devices == 1:
            tiles = tile_counts(graph, captured, param_memory, cluster.memory_per_device * options.memory_fraction)
        fetch = fetched(graph, choice, captured, cluster, param_memory, tiles)
        held, moved = fetch.window, fetch.seconds
    if offload:
        off = offload_cost(param_memory, captured, sharded, zero, cluster, cost_model.precision, options.optimizer,
                           parameters=offload == "parameters")
        param_memory, host, moved = off.parameter_memory, off.host_bytes, moved + off.seconds
    memory, walk = step_walk(graph, choice, captured, cost_model, param_memory, recompute=recompute,
                             offload=bool(offload), copies=frozenset(sharded), fetched=held,
                             offload_checkpoints=checkpoints, memo=solved.derived)
    if checkpoints:
        moments = MOMENTS[options.optimizer]
        kept = host * (1 + moments) / host_copies(options.optimizer)  # masters and states, all step long
        host = max(host, kept + walk.checkpoints)
        moved += 2 * walk.checkpoints / cluster.host_link_bandwidth
    return Plan(
        name=name, cluster=cluster, mesh_shape=tuple(cluster.mesh_shape),
        fingerprint=chosen.fingerprint, nodes=nodes, parameter_placements=params,
        input_placements=inputs, collective_records=(),
        time=TimeBreakdown(compute=chosen.compute, communication=comm, resharding=chosen.resharding, offload=moved),
        memory=memory,
        flops_per_step=graph.flops_per_step, flops_per_device=chosen.local_flops,
        precision=cost_model.precision.name,
        solver=solved.stats, options=options, parameter_memory=param_memory, zero=zero,
        recompute=recompute, offload=bool(offload), offload_parameters=offload == "parameters", host_memory=host,
        tiles=tiles, offload_activations=checkpoints,
    )


class _Chosen(NamedTuple):
    """What every plan of one solve shares, whatever its ZeRO stage, offload or tiles."""

    nodes: tuple  # NodeChoice per op
    params: dict  # fqn -> placements as text
    inputs: dict
    param_memory: dict  # fqn -> (parameter, gradient, optimizer state) bytes, unsharded by ZeRO
    compute: float
    local_flops: float
    comm: float  # parameters' collectives
    resharding: float
    fingerprint: str


def _chosen(solved: Solved, captured, cost_model: CostModel, recompute, alternatives: bool) -> _Chosen:
    """The node choices, times and parameter bytes of ``solved`` (kept in ``solved.derived``: the
    search builds a solve at several ZeRO stages, tiled and not)."""
    key = ("chosen", recompute, alternatives)
    if key in solved.derived:
        return solved.derived[key]
    graph, choice = solved.graph, solved.choice
    comm = resh = 0.0
    edge_time = np.zeros(len(graph.nodes))
    fingerprint, grads_of = _graph_facts(captured, cost_model)
    for e in graph.edges:
        src = graph.nodes[e.src]
        if e.phases is None:  # its entry is the pair's collectives, forward and backward
            secs = float(e.cost[choice[e.src], choice[e.dst]])
        else:  # a micro-batch view's entry weighs its per-step part
            t = graph.nodes[e.dst].strategies[choice[e.dst]]
            secs = cost_model.reshard_time(e.meta, src.strategies[choice[e.src]].outputs[e.out_index],
                                           t.inputs[e.in_index], grad=e.grad, consumer=t, regather=e.regather)
        edge_time[e.dst] += secs
        if src.kind == "parameter":
            comm += secs
        else:
            resh += secs
    for i, extra in graph.unary.items():
        resh += float(extra[choice[i]])
        edge_time[i] += float(extra[choice[i]])
    nodes, params, inputs, param_memory = [], {}, {}, {}
    compute = local_flops = 0.0
    gm_nodes = {n.name: n for n in captured.graph_module.graph.nodes}
    again = _rerun(captured, recompute)
    details = node_details(graph, choice, captured, cost_model, top=DEFAULT_TOP if alternatives else 0)
    texts: dict[int, tuple] = {}  # id(strategy) -> its shardings as text (layers share strategies)
    for i, (node, c) in enumerate(zip(graph.nodes, choice)):
        strat = node.strategies[c]
        if node.kind == "parameter":
            params[node.target] = tuple(str(p) for p in strat.outputs[0])
            meta = captured.parameters[node.target]
            param_memory[node.target] = cost_model.parameter_split(meta, strat.outputs[0],
                                                                   frozen=not node.requires_grad)
            continue
        if node.kind == "user_input":
            inputs[node.target] = tuple(str(p) for p in strat.outputs[0])
            continue
        if node.kind != "op":
            continue
        compute += float(node.compute[c]) + (float(node.forward[c]) if node.name in again else 0.0)
        local_flops += cost_model.local_flops(node.spec, strat, grads_of[node.name], forward_again=node.name in again)
        text = texts.get(id(strat))
        if text is None:
            text = texts[id(strat)] = (tuple(format_sharding(s) for s in strat.inputs),
                                       tuple(format_sharding(s) for s in strat.outputs))
        nodes.append(NodeChoice(
            node.name, node.op, gm_nodes[node.name].meta.get("autopar_module"),
            gm_nodes[node.name].meta.get("autopar_layer"), *text,
            float(node.compute[c]), float(edge_time[i] + node.communication[c]), len(node.strategies),
            local=strat.local, **details[node.name],
        ))
    solved.derived[key] = chosen = _Chosen(tuple(nodes), params, inputs, param_memory, compute, local_flops, comm,
                                           resh, fingerprint)
    return chosen


def _graph_facts(captured, cost_model: CostModel) -> tuple[str, dict[str, tuple[bool, ...]]]:
    """``captured``'s fingerprint and, per call, which tensor inputs a gradient reaches: the same
    for every plan of a search (kept on its cost model)."""
    hit = cost_model.memo.get("graph facts")
    if hit is not None and hit[0] is captured:
        return hit[1]
    graph = captured.graph_module.graph
    needs = gradient_values(graph, trainable_parameters(captured))
    grads = {n.name: gradient_inputs(n, needs) for n in graph.nodes}
    facts = graph_fingerprint(captured), grads
    cost_model.memo["graph facts"] = (captured, facts)
    return facts


def with_alternatives(plan: Plan, solved: Solved, captured, cost_model: CostModel) -> Plan:
    """``plan``, built from ``solved`` without them, with each node's next-best strategies."""
    details = node_details(solved.graph, solved.choice, captured, cost_model)
    return dataclasses.replace(plan, nodes=tuple(
        dataclasses.replace(n, top_alternatives=details[n.node]["top_alternatives"]) for n in plan.nodes))


def with_records(plan: Plan, captured, cost_model: CostModel) -> Plan:
    """``plan`` with the collective records of the program it emits (made for the plan returned
    only: they cost a pass over the graph)."""
    records = [CollectiveRecord(kind, (axis,), nbytes, phase, node, cost_model.collective_time(kind, nbytes, axis))
               for phase, kind, axis, nbytes, node in program_collectives(
                   captured, assignment_of(plan, captured), precision=cost_model.precision, zero=plan.zero,
                   recompute=plan.recompute)]
    return dataclasses.replace(plan, collective_records=tuple(records))


def _zero_seconds(sharded: dict, zero: int, cost_model: CostModel) -> float:
    """Seconds of the gradient sums and gathers of the ``sharded`` parameters
    (:func:`~autopar.plan.records.zero_parameters`) at ZeRO stage ``zero``."""
    mesh = tuple(cost_model.mesh_shape)
    return sum(cost_model.collective_time(kind, nbytes, axis)
               for name, numel, itemsize, axes in sharded.values()
               for _, kind, axis, nbytes, _ in zero_step_collectives(name, numel, itemsize, axes, mesh, zero))


def plan_intra(captured, cluster, options, *, allow: Allow | None = None, name: str = "autopar",
               zero: int | None = None, beat: float | None = None) -> Plan | None:
    """Plan ``captured`` on ``cluster``'s mesh; ``allow`` restricts strategies (the baselines'
    rules, a transferred plan's placements). ``zero``: the ZeRO stage (0, 1, 2) of the plan's
    replicated parameters; None: 0, or where the plan does not fit the memory limit and
    ``options.shard_parameters``, the faster of ZeRO-1 and ZeRO-2 that fits. ``beat``: as
    :func:`plan_intra_fastest`."""
    return plan_intra_fastest(captured, cluster, options, {tuple(cluster.mesh_shape): [(allow, name)]}, zero=zero,
                              beat=beat)


def _costed(captured, cluster, options, name):
    """The cost graph of ``captured`` on ``cluster``'s mesh, and its cost model."""
    log.info("%s: costing strategies on mesh %s", name, tuple(cluster.mesh_shape))
    start = time.perf_counter()
    cost_model = CostModel(cluster, options, precision=model_precision(captured, options),
                           captured_dtype=captured_dtype(captured))
    graph = build_cost_graph(PlannedGraph.of(captured), cost_model)
    log.info("%s: cost graph of %d nodes in %.2f s", name, len(graph.nodes), time.perf_counter() - start)
    return graph, cost_model


def _solved_plan(graph, captured, cluster, cost_model, options, name, zero=None, *,
                 offload: bool | str = False, recompute: bool | str = False, checkpoints: bool = False,
                 beat: float | None = None) -> tuple[Plan, Solved] | None:
    """The fastest plan of ``graph`` (``offload``: the optimizer on the host, "parameters": they
    too; ``recompute``: every layer recomputes its forward in backward; ``checkpoints``: its
    checkpoints on the host) whose step peak fits the limit, without collective records or
    alternatives (:func:`with_alternatives` adds them to the search's winner), and its solve; None
    where no plan of it can be faster than ``beat`` seconds (:func:`_cannot_beat`; not applied
    where its plans may be tiled: :func:`_tiles`)."""
    if offload == "parameters":
        graph = fetched_graph(graph, cost_model, captured)
    elif offload:
        graph = offloaded_graph(graph, cost_model)
    limit = cluster.memory_per_device * options.memory_fraction

    def tried():
        g = recomputing_graph(graph, captured, cost_model, selective=recompute == "selective",
                              offloaded=checkpoints) if recompute else graph
        return _tried(g, captured, cluster, cost_model, options, name, zero, limit, offload=offload,
                      recompute=recompute, checkpoints=checkpoints, beat=beat)

    floor = choices_floor(graph, captured, cost_model, offload=offload, recompute=recompute)
    if floor > limit:  # no choice fits: the try runs only if its error is reported
        raise Unbuilt(floor, tried)
    if offload == "parameters" and host_floor(graph, captured, cost_model) > host_limit(cluster, options):
        raise Unbuilt(math.inf, tried)  # no choice's share fits the host: its error reports no peak
    return tried()


def _tried(graph, captured, cluster, cost_model, options, name, zero, limit, *, offload, recompute, checkpoints,
           beat) -> tuple[Plan, Solved] | None:
    """:func:`_solved_plan` of ``graph``, the savers' view, under ``limit`` bytes."""
    bound, closest = limit, math.inf
    if beat is not None and _floor(graph, captured, cluster, cost_model, options, offload, recompute,
                                   beat=beat) * (1 - PRUNE_MARGIN) >= beat:
        return None  # no plan of it can be faster: not solved
    log.info("%s: solving (%d nodes)%s", name, len(graph.nodes), ", optimizer on the host" if offload else "")
    least_sum = least_memory_sum(graph, options)

    @functools.cache
    def least_solve():  # the least-memory solve and the peak no plan of the try steps below
        solved = solve_least_memory(graph, options, method=name)
        return solved, peak_floor(solved, captured, cost_model, offload=offload, recompute=recompute,
                                  checkpoints=checkpoints)

    def least(closest: float):  # the least-memory plan, or the try's error (closest: its other plans' least peak)
        return _least_memory_plan(least_solve()[0], captured, cluster, cost_model, options, name, zero, limit,
                                  offload, recompute, checkpoints, closest)

    # near the limit, the least-memory solve (cheap) may show that no plan fits before the fastest one
    if least_sum > limit * FLOOR_FIRST:
        floor = least_solve()[1]
        if floor > limit:
            raise Unbuilt(floor, functools.partial(least, math.inf))
    added = _added_floor(graph, captured, cluster, options, cost_model.precision, offload, recompute)
    cutting = beat is not None and not _tiles(offload, cluster)
    # a choice costing this much or more makes no plan under ``beat`` (as _cannot_beat reads a solve)
    cutoff = (beat - added) / ((1 - PRUNE_MARGIN) * (1 - options.relative_gap)) if cutting else None
    for _ in range(RESOLVES + 1):
        if least_sum > bound * (1 + SUM_MARGIN):
            break  # no choice is within the bound (the solve would say so, at a presolve's cost)
        try:
            solved = solve_graph(graph, options, bound, method=name, cutoff=cutoff)
        except InfeasibleError:
            break
        log.info("%s: solved (%s) in %.2f s", name, solved.stats.status, solved.stats.solve_time_s)
        if cutting and (solved.stats.status == "cut" or _cannot_beat(solved, beat - added)):
            return None
        plan = _fitting(solved, captured, cluster, cost_model, options, name, zero, limit, offload, recompute,
                        checkpoints)
        if _fits(plan, limit, options):
            return plan, solved
        closest = min(closest, plan.predicted_peak_memory)
        # the step's peak is above the linear sum the ILP bounds: bound that sum by the limit less the excess
        linear = sum(float(n.memory[c]) for n, c in zip(graph.nodes, solved.choice))
        bound = min(bound * (1 - 1e-3), limit - (plan.predicted_peak_memory - linear))
        if bound <= 0:
            break
    solved, floor = least_solve()
    if floor > limit:  # no plan of it fits at any ZeRO stage: its error is made only if it is reported
        raise Unbuilt(min(closest, floor), functools.partial(least, closest))
    return least(closest), solved


def _floor(graph, captured, cluster, cost_model, options, offload, recompute=False, *,
           beat: float | None = None) -> float:
    """Seconds no plan of ``graph`` (a savers' view) steps below, before any solve: its cheapest
    entries' sum or its solves' floor (:func:`~autopar.planner.solve.solve_floor`), whichever is
    higher (the ILP's cost of a choice, which a plan's time is not below: :func:`_cannot_beat`),
    or where its plans may be tiled (:func:`_tiles`) the FLOPs' floor; plus the seconds its plans
    add to the ILP's cost (:func:`_added_floor`). With ``beat``, the solves' floor
    (a relaxation of the reduced problem) only where the cheapest entries' is under it."""
    if _tiles(offload, cluster):
        return _time_floor(captured, cluster, options, cost_model.memo, offload)
    added = _added_floor(graph, captured, cluster, options, cost_model.precision, offload, recompute)
    floor = least_cost(graph)
    if beat is None or (floor + added) * (1 - PRUNE_MARGIN) < beat:
        floor = max(floor, solve_floor(graph, options))
    return floor + added


def _added_floor(graph, captured, cluster, options, precision, offload, recompute) -> float:
    """Seconds every plan of ``graph`` (a savers' view) adds to its choice's cost in the ILP: with
    the optimizer alone offloaded, the host's step and the link's (:func:`_host_floor`; a fetching
    view's parameters cost theirs in the ILP: :func:`~autopar.planner.fetched.fetched_graph`), and
    recomputing, the forwards run again (:func:`_again_floor`)."""
    host = _host_floor(captured, cluster, options, precision, offload) if offload is True else 0.0
    return host + _again_floor(graph, captured, recompute)


def _again_floor(graph, captured, recompute) -> float:
    """Seconds no plan of ``graph`` recomputing so (True or "selective") spends less than on the
    forwards it runs again, which the ILP's costs leave out (:func:`_chosen` adds them): each
    rerun kernel's least forward over its strategies; 0 without recompute."""
    again = _rerun(captured, recompute)
    return sum(float(n.forward.min()) for n in graph.nodes
               if n.kind == "op" and n.name in again and n.forward is not None and len(n.forward))


def _rerun(captured, recompute) -> set[str]:
    """The nodes whose kernels a plan recomputing so (True or "selective") runs again; none without."""
    if not recompute:
        return set()
    return recomputed_kernels(list(captured.graph_module.graph.nodes), selective=recompute == "selective")


def _time_floor(captured, cluster, options, memo: dict, offload) -> float:
    """Seconds no plan of ``captured`` on ``cluster``'s devices (any mesh) with ``offload`` steps
    below, before any cost graph: the FLOPs' floor (:func:`~autopar.planner.time_floor.step_time_floor`,
    kept in ``memo``, a dict of this search), with an offload plus the host's and the link's
    (:func:`_host_floor`)."""
    if "time floor" not in memo:
        memo["time floor"] = step_time_floor(captured, cluster, options)
    return memo["time floor"] + _host_floor(captured, cluster, options, model_precision(captured, options), offload)


def _host_floor(captured, cluster, options, precision, offload) -> float:
    """Seconds no plan with ``offload`` spends less than on the host's step and the link
    (:func:`~autopar.planner.offload.host_step_floor`); 0 without one."""
    if not offload:
        return 0.0
    return host_step_floor(captured, cluster, options.optimizer, precision=precision,
                           parameters=offload == "parameters")


def _tiles(offload: bool | str, cluster) -> bool:
    """Whether plans with ``offload`` on ``cluster`` may run tiles (:mod:`autopar.planner.tiling`:
    fetched parameters on one device), whose step may take less than their solve's cost."""
    return offload == "parameters" and cluster.num_devices == 1


def _cannot_beat(solved: Solved, beat: float) -> bool:
    """Whether no plan of ``solved``'s graph left to build can take less than ``beat`` seconds:
    ``solved`` is its fastest (within its gap) under a memory bound that every later solve of the
    try tightens and the least-memory choice meets, and a plan's step time is never below its
    solve's cost (ZeRO-2's gradient collectives come to 5e-8 of it less: :data:`PRUNE_MARGIN`)."""
    gap = solved.stats.gap
    if not math.isfinite(gap):
        return False
    return evaluate(solved.graph, solved.choice) * (1 - gap) * (1 - PRUNE_MARGIN) >= beat


def _fits(plan: Plan, limit: float, options) -> bool:
    """Whether ``plan`` fits the device limit and, offloaded, its share of the host."""
    return plan.predicted_peak_memory <= limit and (
        not plan.offload or plan.host_memory <= host_limit(plan.cluster, options))


def _fitting(solved, captured, cluster, cost_model, options, name, zero, limit, offload=False,
             recompute=False, checkpoints=False, *, lean_first: bool = False) -> Plan:
    """The plan of ``solved`` at ZeRO stage ``zero``; for None, at 0 or, where that is over
    ``limit`` or the optimizer is on the host, and ``options.shard_parameters``, the fastest of
    the stages within it (the one of least memory when none is); with the parameters offloaded at ZeRO 0, tiled or not
    (:func:`_tiled_or_not`). ``lean_first``: ``solved`` is likely over the limit (the least-memory
    solve of a try nothing else fitted), so ZeRO-2, which holds the least, is built first and
    alone where it does not fit."""
    if offload == "parameters":
        return _tiled_or_not(solved, captured, cluster, cost_model, options, name, limit, recompute, checkpoints)
    levels = (zero,) if zero is not None else (0, 1, 2) if options.shard_parameters else (0,)

    built: dict[int, Plan] = {}

    def plan_at(z):  # the search keeps one plan at most: its alternatives are added then
        if z not in built:
            built[z] = build_plan(solved, captured, cluster, cost_model, options, name=name, zero=z, offload=offload,
                                  recompute=recompute, checkpoints=checkpoints, alternatives=False)
        return built[z]

    if lean_first and len(levels) > 1 and not _fits(plan_at(2), limit, options):
        return built[2]  # ZeRO-2 shards what ZeRO-0 and ZeRO-1 hold whole: where it does not fit, they do not
    plans = [plan_at(levels[0])]
    if len(levels) > 1 and (offload or not _fits(plans[0], limit, options)):
        # ZeRO-2 shards what ZeRO-1 does and the gradients too: where it does not fit, ZeRO-1 does not;
        # with the optimizer on the host each rank steps (and moves) only its chunk: often the faster
        sharded = plan_at(2)
        plans += [plan_at(1), sharded] if _fits(sharded, limit, options) else [sharded]
    fits = [p for p in plans if _fits(p, limit, options)]
    if not fits:
        return min(plans, key=lambda p: p.predicted_peak_memory)
    best = min(fits, key=lambda p: p.predicted_step_time)
    if best.zero and zero is None:
        runner = [p for p in plans if p is not best and p.zero]
        also = (f"; ZeRO-{runner[0].zero}: {runner[0].predicted_step_time * 1e3:.1f} ms"
                f"{'' if _fits(runner[0], limit, options) else ', does not fit'}") if runner else ""
        why = (f"ZeRO-{best.zero}: the host steps each rank's chunk of the optimizer state:"
               f" {best.predicted_step_time * 1e3:.1f} ms against ZeRO-0's {plans[0].predicted_step_time * 1e3:.1f} ms"
               if _fits(plans[0], limit, options) else
               f"ZeRO-{best.zero}: without it the step's peak is {plans[0].predicted_peak_memory / 2**30:.2f} GiB,"
               f" over the {limit / 2**30:.2f} GiB limit")
        best = dataclasses.replace(best, why=best.why + (why + also,))
    return best


def _tiled_or_not(solved, captured, cluster, cost_model, options, name, limit, recompute, checkpoints=False) -> Plan:
    """The plan of ``solved`` with its parameters fetched from the host (ZeRO 0): its largest
    linears and embeddings run tile by tile where that fits and the untiled plan does not, or is
    faster (:mod:`autopar.planner.tiling`); the one of least memory when neither fits."""
    whole = build_plan(solved, captured, cluster, cost_model, options, name=name, offload="parameters",
                       recompute=recompute, checkpoints=checkpoints, alternatives=False)
    if not _tiles("parameters", cluster):
        return whole
    tiled = build_plan(solved, captured, cluster, cost_model, options, name=name, offload="parameters",
                       recompute=recompute, tile=True, checkpoints=checkpoints, alternatives=False)
    if not tiled.tiles:
        return whole
    fits = [p for p in (whole, tiled) if _fits(p, limit, options)]
    best = min(fits, key=lambda p: p.predicted_step_time) if fits else min(
        (whole, tiled), key=lambda p: p.predicted_peak_memory)
    if best is not tiled:
        return best
    other = (f"untiled: {whole.predicted_step_time * 1e3:.1f} ms" if _fits(whole, limit, options)
             else f"untiled, the step's peak would be {whole.predicted_peak_memory / 2**30:.2f} GiB, over the"
                  f" {limit / 2**30:.2f} GiB limit")
    return dataclasses.replace(tiled, why=tiled.why + (f"tiled: {other}",))


def _least_memory_plan(solved, captured, cluster, cost_model, options, name, zero, limit, offload, recompute,
                       checkpoints, closest: float) -> Plan:
    """The plan of ``solved``, a least-memory solve
    (:func:`~autopar.planner.solve.solve_least_memory`), where it fits; else the InfeasibleError
    that reports its peak or ``closest`` (bytes: the smallest peak of the try's other plans),
    whichever is less: a real plan's, so a re-plan at it returns one."""
    least = _fitting(solved, captured, cluster, cost_model, options, name, zero, limit, offload, recompute,
                     checkpoints, lean_first=True)
    if _fits(least, limit, options):
        return least
    closest = min(closest, least.predicted_peak_memory)
    host = host_limit(cluster, options)
    if offload and least.host_memory > host:  # no device size makes it fit: the host is short
        raise InfeasibleError(
            f"{name}: no plan fits: with the optimizer offloaded the devices would hold"
            f" {least.predicted_peak_memory / 2**30:.1f} GiB (their limit: {limit / 2**30:.1f} GiB), but the host would"
            f" need {least.host_memory / 2**30:.1f} GiB per device of its {host / 2**30:.1f} GiB"
            f" ({options.memory_fraction:.0%} of its share of the node). Use a host with more memory (Cluster.host),"
            " or more devices to shard the optimizer state over")
    raise no_plan_fits(limit, closest, method=name,
                       what=" in its step: saved activations, the backward's gradients, the optimizer's scratch")


def candidate_meshes(cluster) -> list[tuple[int, ...]]:
    """Logical meshes worth planning on: the cluster's own and every ``(devices / t, t)`` with
    ``t`` dividing the devices and fitting in a node (the meshes the Megatron grid tries)."""
    n = cluster.num_devices
    per_node = cluster.devices_per_node or n
    shapes = [tuple(cluster.mesh_shape)]
    if cluster.axis_links is None:  # fixed per-axis links tie the plan to the given mesh
        shapes += [(n // t, t) for t in range(1, n + 1) if n % t == 0 and t <= per_node]
    return list(dict.fromkeys(shapes))


def plan_intra_best_mesh(captured, cluster, options, *, name: str = "autopar",
                         beat: float | None = None) -> Plan | None:
    """The fastest plan over :func:`candidate_meshes` (all on the same devices); ``beat``: as
    :func:`plan_intra_fastest`.

    On each mesh the unrestricted ILP runs, and so do the Megatron-style restrictions the grid
    baseline tries (ZeRO 0 and 3): follower folding makes the unrestricted solve a heuristic,
    and a restricted space can fold better, so the grid's plans are kept as candidates.
    """
    tries = {shape: [(None, name)] + ([(megatron_rule(shape, zero=z), name) for z in (0, 3)] if len(shape) == 2
                                       else []) for shape in candidate_meshes(cluster)}
    return plan_intra_fastest(captured, cluster, options, tries, beat=beat)


@without_full_collections
def plan_intra_fastest(captured, cluster, options, tries: dict, *, zero: int | None = None,
                       beat: float | None = None) -> Plan | None:
    """The fastest plan that fits among ``tries``: ``{mesh shape: [(allow, plan name), ...]}``
    on ``cluster``'s devices, at ZeRO stage ``zero`` (None: chosen), with the memory savers
    (recompute, the optimizer on the host) the search takes (:mod:`autopar.planner.savers`). Each
    mesh's cost graph is built once and restricted per ``allow``; only the winner gets its
    collective records. ``beat``: seconds (another search's plan) below which a plan must step to
    matter: the tries that cannot are cut short, and where none that ran fits and some were cut,
    None (a plan might fit, none faster). Raises the InfeasibleError of the try that came closest
    to fitting when none fits."""
    costed: dict = {}
    limit = cluster.memory_per_device * options.memory_fraction
    missed: list = []  # the misses of the levels tried
    levels = saver_levels(options, cluster)
    cut = False  # a try was cut by ``beat``: a later level may still beat it, or none
    for level in levels:
        found, faster = {}, beat
        for s in sorted(level, key=_likely_slower):  # a fast plan first cuts the slower savers' tries short
            found[s] = _fastest_try(captured, cluster, options, tries, costed, zero, s, beat=faster)
            if isinstance(found[s], tuple) and (faster is None or found[s][0].predicted_step_time < faster):
                faster = found[s][0].predicted_step_time
        cut = cut or any(f is None for f in found.values())
        found = {s: found[s] for s in level}
        fitting = {s: f for s, f in found.items() if isinstance(f, tuple)}
        if not fitting:
            last = [exc for misses in found.values() for exc in misses or ()]  # the last level's explain the failure
            missed += last
            continue
        savers, (best, model, solved) = min(fitting.items(), key=lambda kv: kv[1][0].predicted_step_time)
        if missed:
            others = {s: f[0] if s in fitting else SLOWER if f is None else None for s, f in found.items()
                      if s != savers}
            why = why_taken(savers, levels[0][0], limit, least_known_peak(missed), others)
            best = dataclasses.replace(best, why=best.why + (why,))
        elif options.recompute == "auto" and not savers.recompute and memory_bound(best, limit,
                                                                                  zero_chosen=zero is None):
            best, model, solved = _faster_recomputing(captured, cluster, options, tries, costed, zero, savers,
                                                      (best, model, solved))
        return with_records(with_alternatives(best, solved, captured, model), captured, model)
    if cut:
        return None
    raise closest_miss(last)


def _likely_slower(savers: Savers) -> tuple:
    """Which savers of a level to try first: recompute alone (its plans are usually the fastest:
    the moves to and from the host cost more), then the optimizer offloaded, then the parameters."""
    return savers.offload is not False, savers.offload == "parameters", savers.checkpoints


def _faster_recomputing(captured, cluster, options, tries, costed, zero, savers: Savers, found: tuple) -> tuple:
    """``found``, ``(plan, its cost model, its solve)``, or that of the fastest selectively or
    fully recomputing plan of ``tries``' unrestricted searches where it is faster
    (:func:`~autopar.planner.savers.memory_bound` plans only)."""
    unrestricted = {shape: [a for a in allows if a[0] is None] or allows[:1] for shape, allows in tries.items()}
    without, limit = found[0], cluster.memory_per_device * options.memory_fraction
    for mode in RECOMPUTE[1:]:
        again = _fastest_try(captured, cluster, options, unrestricted, costed, zero, savers._replace(recompute=mode),
                             beat=found[0].predicted_step_time)
        if isinstance(again, tuple) and again[0].predicted_step_time < found[0].predicted_step_time:
            found = again
    best = found[0]
    if best is without:
        return found
    return (dataclasses.replace(best, why=best.why + (why_faster(best, without, limit),)),) + found[1:]


def _fastest_try(captured, cluster, options, tries: dict, costed: dict, zero, savers: Savers, *,
                 beat: float | None = None):
    """``(plan, its cost model, its solve)`` of the fastest of ``tries`` (:func:`plan_intra_fastest`)
    that fits with ``savers``, or the InfeasibleErrors of those that did not (:mod:`autopar.planner.misses`);
    ``costed`` keeps each mesh's cost graph and its restrictions. A try that cannot beat the
    fastest plan so far (or ``beat`` seconds) is not searched further; None where none fits and
    a try was cut so (it might fit, but slower)."""
    def attempt(shape, allow, name, beat=None):
        if shape not in costed:
            costed[shape] = _costed(captured, cluster.with_mesh(shape), options, tries[shape][0][1])
        graph, cost_model = costed[shape]
        if allow is not None and (shape, allow) not in costed:  # restricted once for every saver level
            costed[shape, allow] = restrict(graph, allow)
        return _solved_plan(graph if allow is None else costed[shape, allow], captured, cluster.with_mesh(shape),
                            cost_model, options, name, zero, offload=savers.offload, recompute=savers.recompute,
                            checkpoints=savers.checkpoints, beat=beat)

    unfit = unfit_floor(parameter_counts(captured), cluster, options, offload=savers.offload)
    if beat is not None and unfit is None and _time_floor(captured, cluster, options, costed,
                                                          savers.offload) * (1 - PRUNE_MARGIN) >= beat:
        return None  # no plan with these savers can be faster, on any mesh: none costed
    best, misses, cut = None, [], False
    for shape, allows in tries.items():
        for allow, name in allows:
            if unfit is not None:  # no plan on any mesh fits: a try runs only if its error is reported
                misses.append(Unbuilt(unfit, functools.partial(attempt, shape, allow, name)))
                continue
            try:
                found = attempt(shape, allow, name,
                                beat if best is None else min(best[0].predicted_step_time, beat or math.inf))
            except InfeasibleError as exc:
                misses.append(exc)
                continue
            if found is None:
                cut = True
                continue
            plan, solved = found
            if best is None or plan.predicted_step_time < best[0].predicted_step_time:
                best = plan, costed[shape][1], solved
    return best if best is not None else None if cut else misses or None
