"""Plans for report/render/regression tests, built from the golden plans in tests/golden: a
deep model (one layer repeated) and a pipelined one (stages recorded as the pipeline planner
records them)."""

import dataclasses
import os

import numpy as np

from autopar.plan import Plan, Stage

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def golden(name) -> Plan:
    return Plan.load(os.path.join(GOLDEN, f"{name}.json"))




def staged(plan, *, stages, micro_batches, schedule):
    """``plan`` cut into ``stages`` pipeline stages of consecutive layers, as the pipeline planner
    records them: per-stage nodes, ranks, mesh, weights; time per micro-batch; no alternatives."""
    layers = sorted({n.layer for n in plan.nodes if n.layer}, key=lambda s: int(s.rsplit(".", 1)[1]))
    per = -(-len(layers) // stages)
    stage_of_layer = {layer: k // per for k, layer in enumerate(layers)}
    names, seen = [[] for _ in range(stages)], False
    for n in plan.nodes:
        seen = seen or n.layer is not None
        names[stage_of_layer[n.layer] if n.layer else (stages - 1 if seen else 0)].append(n.node)
    devices = int(np.prod(plan.mesh_shape)) // stages
    cost = {n.node: n.compute_time + n.communication_time for n in plan.nodes}
    compute = {n.node: n.compute_time for n in plan.nodes}
    times = [sum(cost[x] for x in names[k]) / micro_batches for k in range(stages)]
    built = []
    for k in range(stages):
        mine = {layer for layer, s in stage_of_layer.items() if s == k}
        params = {fqn: pl for fqn, pl in plan.parameter_placements.items()
                  if any(fqn.startswith(layer + ".") for layer in mine)
                  or (not fqn.startswith("model.layers.") and (k == 0) == ("embed" in fqn))}
        built.append(Stage(index=k, ranks=tuple(range(k * devices, (k + 1) * devices)), mesh_shape=(1, devices),
                           layers=tuple(x for x in layers if x in mine), has_pre=k == 0, has_post=k == stages - 1,
                           nodes=tuple(names[k]), parameter_placements=params, input_placements={},
                           time=times[k], memory=plan.memory.total * (1 - 0.1 * k),
                           in_flight=min(stages - k, micro_batches) if schedule == "1f1b" else micro_batches))
    slow = int(np.argmax(times))
    c_max = sum(compute[x] for x in names[slow]) / micro_batches
    latency = (micro_batches - 1) * times[slow] + sum(times)
    kw = {f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)}
    bare = [dataclasses.replace(n, alternatives=1, top_alternatives=(), flops=0.0, forward_compute_time=0.0,
                                activation_memory=0.0) for n in plan.nodes]
    kw.update(nodes=tuple(bare), parameter_placements={}, input_placements={}, collective_records=(),
              parameter_memory={}, stages=tuple(built),
              micro_batches=micro_batches, schedule=schedule,
              time=type(plan.time)(compute=micro_batches * c_max, communication=micro_batches * (times[slow] - c_max),
                                   resharding=0.0, bubble=latency - micro_batches * times[slow]))
    return Plan(**kw)


def deep(plan, layers: int) -> Plan:
    """``plan`` with its layer 1 repeated ``layers - 1`` times after layer 0 (renamed)."""
    first = [n for n in plan.nodes if n.layer == "model.layers.0"]
    one = [n for n in plan.nodes if n.layer == "model.layers.1"]
    before = list(plan.nodes[:plan.nodes.index(first[0])])
    after = list(plan.nodes[plan.nodes.index(one[-1]) + 1:])
    body = list(first)
    params = {k: v for k, v in plan.parameter_placements.items() if not k.startswith("model.layers.1.")}
    memory = {k: v for k, v in plan.parameter_memory.items() if not k.startswith("model.layers.1.")}
    for k in range(1, layers):
        rename = lambda s: s.replace("model.layers.1", f"model.layers.{k}") if s else s  # noqa: E731
        body += [dataclasses.replace(n, node=f"{n.node}_L{k}", module=rename(n.module), layer=rename(n.layer))
                 for n in one]
        for fqn, v in plan.parameter_placements.items():
            if fqn.startswith("model.layers.1."):
                params[rename(fqn)] = v
                memory[rename(fqn)] = plan.parameter_memory[fqn]
    return dataclasses.replace(plan, nodes=tuple(before + body + after), parameter_placements=params,
                               parameter_memory=memory)
