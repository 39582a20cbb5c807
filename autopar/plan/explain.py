"""``plan.explain(target)``: the strategies the solver weighed for a module's nodes, and what each
would have cost.

``target`` is a module path (``"model.layers.3.mlp"``: every node whose module is it or inside
it) or a graph node name (``"linear_4"``). For each node the chosen strategy comes first (marked
``*``), then the alternatives the plan recorded (the planner keeps the few with the smallest
step-time change, see :mod:`autopar.planner.alternatives`), each with its own compute and
communication seconds, ``Δstep`` (the change in predicted step time if that node alone switched,
every other node fixed, resharding on its edges included) and ``Δmem`` (activation bytes per
device). Everything comes from the saved plan, so a plan loaded from JSON explains itself.

    print(plan.explain("model.layers.3.mlp"))
"""

from __future__ import annotations

import difflib
import textwrap

from autopar.core.errors import PlanError
from autopar.plan.formatting import GiB, fmt_bytes, fmt_placements, fmt_time_short, fold_numbered, natural_key
from autopar.plan.report import memory_limit, plan_stages, stage_index, weight_placements

STRATEGY_WIDTH = 44


def select(plan, target: str) -> list:
    """The NodeChoices ``target`` names: one node by name, else every node of the module."""
    if not isinstance(target, str) or not target:
        raise PlanError(f"explain needs a module path or node name, got {target!r}")
    for n in plan.nodes:
        if n.node == target:
            return [n]
    chosen = [n for n in plan.nodes if n.module and (n.module == target or n.module.startswith(target + "."))]
    if chosen:
        return chosen
    known = sorted({n.module for n in plan.nodes if n.module} | {n.node for n in plan.nodes})
    close = difflib.get_close_matches(target, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else (
        "; give a module path such as " + repr(next((n.module for n in plan.nodes if n.module), "model")))
    raise PlanError(f"the plan has no module or node {target!r}{hint}")


def _signed_time(s: float) -> str:
    return ("+" if s >= 0 else "-") + fmt_time_short(abs(s))


def _signed_bytes(b: float) -> str:
    return ("+" if b >= 0 else "-") + fmt_bytes(abs(b))


def _strategy(text: str) -> str:
    return text if len(text) <= STRATEGY_WIDTH else text[:STRATEGY_WIDTH - 3] + "..."


def _weights(plan, target: str) -> list[str]:
    prefix = target + "."
    rows = []
    for fqn, by_stage in sorted(weight_placements(plan).items(), key=lambda item: natural_key(item[0])):
        if fqn.startswith(prefix):
            for stage, pl in by_stage.items():
                where = f"  (stage {stage})" if stage is not None else ""
                rows.append(f"  {fqn[len(prefix):]} = {fmt_placements(pl)}{where}")
    return rows


def explain(plan, target: str, *, top: int | None = None) -> str:
    """The alternatives for the nodes ``target`` names (see the module docstring) as text;
    ``top`` limits the alternatives shown per node. Raises PlanError for an unknown target."""
    if top is not None and (not isinstance(top, int) or top < 0):
        raise PlanError(f"top must be a non-negative int or None, got {top!r}")
    nodes = select(plan, target)
    layers = fold_numbered({n.layer for n in nodes if n.layer})
    index = stage_index(plan)
    stages = sorted({index[n.node] for n in nodes if n.node in index})
    lines = [
        f"{target}: {len(nodes)} graph node(s)"
        + (f" in {', '.join(layers)}" if layers else "")
        + "".join(f", pipeline stage {k} on mesh {tuple(getattr(plan_stages(plan)[k], 'mesh_shape', ()))}"
                  for k in stages)
        + ("" if stages else f"; mesh {tuple(plan.mesh_shape)}"),
        f"plan {plan.name!r}: step {fmt_time_short(plan.predicted_step_time)}, peak memory"
        f" {plan.predicted_peak_memory / GiB:.2f} GiB of {memory_limit(plan) / GiB:.1f} GiB allowed",
    ]
    weights = _weights(plan, target)
    if weights:
        lines += ["weights (placement per mesh axis):"] + weights
    lines.append("")
    if any(n.alternatives > 1 for n in nodes):
        lines.append(f"{'    strategy (inputs -> outputs)':{STRATEGY_WIDTH + 4}s} {'compute':>8s} {'comm':>8s}"
                     f" {'step':>9s} {'mem':>7s}")
    single = []
    recorded = False
    for n in nodes:
        if n.alternatives <= 1:
            single.append(n.node)
            continue
        where = f" in {n.module[len(target) + 1:]}" if n.module and n.module.startswith(target + ".") else ""
        lines.append(f"{n.node} = {n.op}{where}: {n.alternatives} strategies")
        lines.append(f"  * {_strategy(n.strategy):{STRATEGY_WIDTH}s} {fmt_time_short(n.compute_time):>8s}"
                     f" {fmt_time_short(n.communication_time):>8s}   chosen")
        shown = n.top_alternatives if top is None else n.top_alternatives[:top]
        recorded = recorded or bool(n.top_alternatives)
        for a in shown:
            lines.append(f"    {_strategy(a.strategy):{STRATEGY_WIDTH}s} {fmt_time_short(a.compute_time):>8s}"
                         f" {fmt_time_short(a.communication_time):>8s} {_signed_time(a.step_time_delta):>9s}"
                         f" {_signed_bytes(a.memory_delta):>7s}")
        hidden = n.alternatives - 1 - len(shown)
        if hidden > 0:
            lines.append(f"    ... {hidden} more {'strategy' if hidden == 1 else 'strategies'}, none cheaper"
                         " alone than those above")
        lines.append("")
    if single and plan_stages(plan):
        why = ("with a single strategy on their stage's mesh (its dp axis splits the batch; its tp axis leaves"
               " no other choice)" if all(st.breakdown is not None for st in plan_stages(plan)) else
               "without recorded alternatives (the plan was made before autopar kept a pipelined plan's"
               " alternatives: re-plan to see them)")
        lines += textwrap.wrap(f"{len(single)} node(s) {why}:", width=100)
        lines.append(f"  {'node':14s} {'strategy (inputs -> outputs)':{STRATEGY_WIDTH}s} {'compute':>8s} {'comm':>8s}")
        by_name = {n.node: n for n in nodes}
        for name in single:
            n = by_name[name]
            lines.append(f"  {name:14s} {_strategy(n.strategy):{STRATEGY_WIDTH}s} {fmt_time_short(n.compute_time):>8s}"
                         f" {fmt_time_short(n.communication_time):>8s}")
    elif single:
        lines += [f"{len(single)} node(s) had a single strategy: {', '.join(single[:12])}"
                  + (" ..." if len(single) > 12 else "")]
    if recorded:
        lines += textwrap.wrap("step/mem: change in predicted step time and activation memory per device if that"
                  " node alone switched, every other node fixed. A negative step change means the"
                  " solver kept the node slower for the memory limit, for a decision shared by"
                  " repeated layers, or because the node follows its producer's choice.", width=100)
    elif len(single) < len(nodes):
        lines += ["this plan records no alternative strategies (it was made before autopar kept"
                  " them): re-plan to see what each alternative would cost"]
    return "\n".join(lines)


__all__ = ["explain", "select"]
