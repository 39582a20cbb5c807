"""Turn a pipeline choice (stages, configurations, micro-batches) into a :class:`~autopar.plan.Plan`.

Each :class:`~autopar.plan.Stage` lists its graph nodes, the ranks of its sub-mesh and its
logical mesh ``(dp, tp)``; every node of a stage gets a :class:`~autopar.plan.NodeChoice`
whose shardings are on that mesh: on ``dp`` the batch split found by the micro-batch analysis
(``Replicate`` when ``dp = 1``, and for parameters ``Shard`` under ZeRO-3), on ``tp`` the
window plan's strategy for the node's position in its layer. Ranks are given to stages largest
first, so whole-node stages get whole nodes and smaller ones never straddle a node.

The stage DP prices a stage's send to the next at the sender's ``dp`` (it does not know the next
stage's mesh); the plan prices it as the runtime moves it (:func:`cross_mesh_excess`), so a
plan whose neighbouring stages have different meshes can predict a slower step than the DP's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from autopar.core.ir import Strategy, gradient_inputs, gradient_values, spec_of_node
from autopar.core.placement import Replicate, Shard, local_shape, parse_sharding
from autopar.core.recompute import recomputed_kernels
from autopar.plan import NodeChoice, Plan, SolverStats, Stage, TimeBreakdown
from autopar.plan.records import trainable_parameters
from autopar.planner.costs import executed_flops
from autopar.planner.intra import graph_fingerprint
from autopar.planner.stage_alternatives import StageAlternatives, stage_sharding
from autopar.planner.stage_table import in_flight

R = Replicate()


def allocate_ranks(sizes: list[int]) -> list[tuple[int, ...]]:
    """Consecutive rank blocks for stages of ``sizes`` devices, largest first (module docstring)."""
    order = sorted(range(len(sizes)), key=lambda k: -sizes[k])
    out: list[tuple[int, ...]] = [()] * len(sizes)
    start = 0
    for k in order:
        out[k] = tuple(range(start, start + sizes[k]))
        start += sizes[k]
    return out


def _graph_to_window(model) -> tuple[dict[str, str], dict[str, str]]:
    """Compute node name → window node, parameter/input FQN → window placeholder."""
    win = model.info.window
    nodes = {g: w for w, gs in win.source.items() for g in gs}
    places = {inp.name: name for name, inp in win.inputs.items()}
    return nodes, places


def _window_fqn(model, fqn: str, layer: str | None) -> str:
    seg = model.segments
    if seg is None or layer is None or layer not in seg.names:
        return fqn
    return seg.representative(layer) + fqn[len(layer):]


def _stage_nodes(model, i: int, j: int) -> list:
    gm = model.captured.graph_module
    if model.layered:
        seg, g = model.segments, model.layers_per_unit
        nodes = list(seg.pre) if i == 0 else []
        for layer in seg.layers[i * g:(j + 1) * g]:
            nodes += layer
        nodes += list(seg.post) if j == model.units - 1 else []
        return nodes
    labels = set(model.info.window.parts[i:j + 1])
    part = model.info.window.part
    return [n for n in gm.graph.nodes if n.op == "call_function" and part.get(n.name) in labels]


def _dp_placement(p, dp: int):
    return p if dp > 1 else R


def _stage_flops(captured, choices, mesh_shape, recomputed: set[str]) -> float:
    """FLOPs one device of a stage executes per step: its nodes' ``choices`` on ``mesh_shape``
    over the whole batch (the micro-batches together), an input's gradient only where it depends
    on a parameter, and the forward again of the ``recomputed`` nodes."""
    graph = {n.name: n for n in captured.graph_module.graph.nodes}
    needs = gradient_values(captured.graph_module.graph, trainable_parameters(captured))
    total = 0.0
    for c in choices:
        node = graph[c.node]
        strategy = Strategy(tuple(parse_sharding(x) for x in c.inputs), tuple(parse_sharding(x) for x in c.outputs))
        grads = gradient_inputs(node, needs)
        total += executed_flops(spec_of_node(node), strategy, mesh_shape, grads, forward_again=c.node in recomputed)
    return total


def bubble_fraction(times, devices, batches, latency, total) -> float:
    """The idle share of all ``total`` devices' time in a step of ``latency`` seconds whose stages
    on ``devices`` devices each take ``times`` seconds per micro-batch, ``batches`` times."""
    busy = batches * sum(t * d for t, d in zip(times, devices))
    return float(min(max(1.0 - busy / (latency * total), 0.0), 1.0)) if latency > 0 else 0.0


def cross_mesh_excess(model, choice) -> list[float]:
    """Per stage, the seconds per micro-batch its send to the next stage and the gradient back
    take beyond the DP's price: on a next stage of another mesh the busiest rank moves up to
    ``max(1, tp_r / tp_s, dp_s / dp_r)`` times the sender's piece (:mod:`autopar.runtime.boundary`)."""
    out = []
    for (_, _, _, a), (_, _, _, b) in zip(choice.stages, choice.stages[1:]):
        factor = max(1.0, b.tp / a.tp, a.dp / b.dp)
        boundary = model.range_costs(a.tp, model.microbatch(a.dp, choice.batches), a.candidate).boundary
        out.append(2 * (factor - 1) * (boundary / model.link.bandwidth + model.link.latency))
    return out + [0.0]


def repriced(model, choice):
    """``choice`` with its stage times, latency and bubble as its plan prices them
    (:func:`cross_mesh_excess`; the same choice where no stage sends to another mesh)."""
    excess = cross_mesh_excess(model, choice)
    if not any(excess):
        return choice
    times = [t + e for t, e in zip(choice.stage_times, excess)]
    latency = (choice.batches - 1) * max(times) + sum(times)
    bubble = bubble_fraction(times, [d for _, _, d, _ in choice.stages], choice.batches, latency,
                             model.cluster.num_devices)
    return dataclasses.replace(choice, stage_times=times, latency=latency, bubble_fraction=bubble)


def build_pipeline_plan(model, choice, *, name: str, solve_time: float) -> Plan:
    """The Plan of ``choice`` (see the module docstring)."""
    info, cluster, options = model.info, model.cluster, model.options
    to_window, place_of = _graph_to_window(model)
    inputs_by_node = {inp.node: inp for inp in model.captured.inputs}
    count = len(choice.stages)
    ranks = allocate_ranks([d for _, _, d, _ in choice.stages])
    stages, node_choices = [], []
    worst = None
    flops = 0.0
    batches = choice.batches
    details = []
    alternatives = StageAlternatives(model, choice.stage_times)
    excess = cross_mesh_excess(model, choice)
    for k, (i, j, devices, cfg) in enumerate(choice.stages):
        b = model.microbatch(cfg.dp, batches)
        arrays = model.arrays(cfg, b, batches)
        rc = model.range_costs(cfg.tp, b, cfg.candidate)
        flops = rc.flops
        flight = int(in_flight(count - k, batches=batches, schedule=options.schedule))
        breakdown = arrays.memory.breakdown(i, j, flight, batches)
        memory = breakdown.total
        t = float(arrays.time[i, j]) + excess[k]
        details.append((t, float(arrays.compute[i, j])))
        if worst is None or memory > worst.total:
            worst = breakdown
        cand = model.candidates[cfg.tp][cfg.candidate].strategy_of()
        node_costs = rc.part.node_costs
        alts = alternatives.of_stage(k, cfg, b=b, batches=batches, in_flight=flight)
        names, params, inputs = [], {}, {}
        first_choice = len(node_choices)
        for node in _stage_nodes(model, i, j):
            names.append(node.name)
            w = to_window.get(node.name)
            if w is None or w not in info.specs or w not in cand:
                continue
            strat = cand[w]
            ins, outs = stage_sharding(info, w, strat, cfg.dp)
            compute, comm = node_costs.get(w, (0.0, 0.0))
            strategies, top = alts.get(w, (1, ()))
            node_choices.append(NodeChoice(
                node.name, str(node.target), node.meta.get("autopar_module"), node.meta.get("autopar_layer"),
                ins, outs, compute * batches, comm * batches, strategies, top_alternatives=top,
                local=strat.local or (info.mb_local.get(w) if cfg.dp > 1 else None)))
            for a in node.all_input_nodes:
                inp = inputs_by_node.get(a.name)
                if inp is None or inp.kind not in ("parameter", "user_input"):
                    continue
                wp = place_of.get(_window_fqn(model, inp.name, a.meta.get("autopar_layer")))
                if wp is None or wp not in cand:
                    continue
                tp_sharding = tuple(cand[wp].outputs[0])
                if inp.kind == "parameter":
                    dp_p = R
                    if cfg.zero == 3 and cfg.dp > 1:
                        shape = local_shape(inp.meta.shape, (R,) + tp_sharding, (1, cfg.tp))
                        dims = [d for d, size in enumerate(shape) if size % cfg.dp == 0]
                        dp_p = Shard(dims[0]) if dims else R
                    params[inp.name] = tuple(str(p) for p in (dp_p,) + tp_sharding)
                else:
                    inputs[inp.name] = tuple(str(p) for p in (_dp_placement(info.mb_out[wp][0], cfg.dp),) + tp_sharding)
        recomputed = (recomputed_kernels(_stage_nodes(model, i, j), selective=cfg.recompute == "selective")
                      if cfg.recompute else set())
        flops_per_device = _stage_flops(model.captured, node_choices[first_choice:], (cfg.dp, cfg.tp), recomputed)
        seg = model.segments
        layers = seg.held(i * model.layers_per_unit, (j + 1) * model.layers_per_unit - 1) if seg else ()
        stages.append(Stage(
            index=k, ranks=ranks[k], mesh_shape=(cfg.dp, cfg.tp), layers=layers,
            has_pre=bool(seg) and i == 0, has_post=bool(seg) and j == model.units - 1, nodes=tuple(names),
            parameter_placements=params, input_placements=inputs, time=t, memory=memory, in_flight=flight,
            zero=cfg.zero, recompute=cfg.recompute, breakdown=breakdown,
            flops_per_device=flops_per_device))
    slow = int(np.argmax([d[0] for d in details]))
    t_max, c_max = details[slow][0], details[slow][1]
    latency, bubble = choice.latency, choice.bubble_fraction
    if any(excess):  # the choice's times may or may not hold it already (repriced): from the arrays
        times = [d[0] for d in details]
        latency = (batches - 1) * t_max + sum(times)
        bubble = bubble_fraction(times, [d for _, _, d, _ in choice.stages], batches, latency, cluster.num_devices)
    time_bd = TimeBreakdown(compute=batches * c_max, communication=batches * (t_max - c_max), resharding=0.0,
                            bubble=max(0.0, latency - batches * t_max))
    stats = SolverStats(method=choice.method, status="optimal", optimal=True, solve_time_s=solve_time,
                        graph_nodes=len(model.captured.graph_module.graph.nodes), solver_nodes=model.units)
    return Plan(
        name=name, cluster=cluster, mesh_shape=tuple(cluster.mesh_shape),
        fingerprint=graph_fingerprint(model.captured), nodes=tuple(node_choices), parameter_placements={},
        input_placements={}, collective_records=(), time=time_bd, memory=worst, flops_per_step=flops,
        precision=model.precision.name,
        solver=stats, options=options, stages=tuple(stages), micro_batches=batches,
        schedule=options.schedule, bubble_fraction=bubble)


__all__ = ["allocate_ranks", "bubble_fraction", "build_pipeline_plan", "cross_mesh_excess", "repriced"]
