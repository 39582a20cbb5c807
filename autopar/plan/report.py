"""Text reports of a Plan: ``plan.summary()``, one screen per model however deep.

Rows are runs of consecutive graph nodes in one layer (nodes outside every layer form rows of
their own); consecutive layers ``x.3``, ``x.4``, … whose nodes, weights and stage are planned
identically merge into one row ``x.3-4`` (xN 2) whose figures are *per layer*. Each row shows the
predicted seconds (compute, communication, pipeline bubble), the memory per device (parameters,
gradients, optimizer state, activations kept for backward), the MFU, and under it the sharding
of its weights (grouped by placement, one placement per mesh axis) and of its output activation.

A pipelined plan adds one header line per stage (ranks, stage mesh, layers, time per
micro-batch, peak memory); its rows carry their stage, their weights' placements on that
stage's mesh, and '-' for figures the plan records per stage only.

:func:`layer_groups` is the same table as data (``render`` draws it).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

from autopar.plan.formatting import GiB, fmt_bytes, fmt_placements, fmt_time, fmt_time_short, fold_numbered

WIDTH = 100


# ----------------------------------------------------------------------------- pipeline stages


def plan_stages(plan) -> tuple:
    """The plan's pipeline stages (empty for one program on the whole mesh)."""
    return tuple(getattr(plan, "stages", None) or ())


def stage_index(plan) -> dict[str, int]:
    """Graph node name -> pipeline stage, from each stage's ``nodes`` (or, lacking those, its
    ``layers``); empty for a plan without stages."""
    out: dict[str, int] = {}
    stages = plan_stages(plan)
    for k, st in enumerate(stages):
        for name in getattr(st, "nodes", None) or ():
            out.setdefault(name, k)
    if not out and stages:
        by_layer = {layer: k for k, st in enumerate(stages) for layer in getattr(st, "layers", None) or ()}
        out = {n.node: by_layer[n.layer] for n in plan.nodes if n.layer in by_layer}
    return out


def stage_of(plan, node, index: dict | None = None) -> int | None:
    """The pipeline stage a NodeChoice runs in, or None for a plan without stages (pass
    ``index=stage_index(plan)`` when asking for many nodes)."""
    if not plan_stages(plan):
        return None
    return (stage_index(plan) if index is None else index).get(node.node)


def weight_placements(plan) -> dict[str, dict]:
    """FQN -> {stage (None without stages): placements}. A pipelined plan keeps each stage's
    parameters on that stage's mesh; a weight used by two stages (tied embeddings) has two."""
    out: dict[str, dict] = {k: {None: tuple(v)} for k, v in plan.parameter_placements.items()}
    for k, st in enumerate(plan_stages(plan)):
        for fqn, pl in (getattr(st, "parameter_placements", None) or {}).items():
            out.setdefault(fqn, {})[k] = tuple(pl)
    return out


def num_stages(plan) -> int:
    return max(1, len(getattr(plan, "stages", None) or ()))


def num_micro_batches(plan) -> int:
    return max(1, int(getattr(plan, "micro_batches", 1) or 1))


# ----------------------------------------------------------------------------- the layer table


def _layer_key(layer: str | None) -> tuple[str, int] | None:
    m = re.match(r"^(.*)\.(\d+)$", layer or "")
    return (m.group(1), int(m.group(2))) if m else None


@dataclass
class LayerGroup:
    """One row of the summary; figures are per layer (multiply by ``count`` for the group)."""

    label: str
    layers: list  # layer names (a single None for nodes outside every layer)
    nodes: list  # NodeChoice of the first layer of the group
    weights: dict = field(default_factory=dict)  # name relative to the layer -> placements
    stage: int | None = None
    compute: float = 0.0
    communication: float = 0.0
    bubble: float = 0.0
    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    flops: float = 0.0

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def time(self) -> float:
        return self.compute + self.communication + self.bubble

    @property
    def activation_sharding(self) -> tuple[str, ...] | None:
        """The sharding of the group's output: the first output of its last node."""
        for n in reversed(self.nodes):
            if n.outputs:
                return tuple(n.outputs[0].split(","))
        return None

    def signature(self) -> tuple:
        return (tuple(n.strategy for n in self.nodes), tuple(sorted(self.weights.items())), self.stage)


def _runs(plan) -> list[tuple[str | None, list]]:
    """Consecutive nodes of one layer (or outside layers) as ``(layer, nodes)`` runs."""
    runs: list[tuple[str | None, list]] = []
    for n in plan.nodes:
        if runs and runs[-1][0] == n.layer:
            runs[-1][1].append(n)
        else:
            runs.append((n.layer, [n]))
    return runs


def _owner(fqn: str, runs, layer_names) -> int | None:
    """Index of the run that owns parameter ``fqn``: its layer's run, else the run whose nodes'
    module is the longest prefix of it."""
    for k, (layer, _) in enumerate(runs):
        if layer is not None and fqn.startswith(layer + "."):
            return k
    best, best_len = None, -1
    for k, (layer, nodes) in enumerate(runs):
        if layer is not None and layer in layer_names:
            continue
        for n in nodes:
            mod = n.module or ""
            if mod and fqn.startswith(mod + ".") and len(mod) > best_len:
                best, best_len = k, len(mod)
    return best


def layer_groups(plan) -> list[LayerGroup]:
    """The summary's rows as data (see the module docstring)."""
    runs = _runs(plan)
    layer_names = {layer for layer, _ in runs if layer is not None}
    index = stage_index(plan)
    groups: list[LayerGroup] = []
    seen_layer = False
    for k, (layer, nodes) in enumerate(runs):
        if layer is None:
            position = "after layers" if seen_layer and not any(r[0] for r in runs[k:]) else (
                "between layers" if seen_layer else "before layers")
            label = f"({position})"
        else:
            seen_layer = True
            label = layer
        stages = {stage_of(plan, n, index) for n in nodes}
        g = LayerGroup(label=label, layers=[layer], nodes=nodes,
                       stage=stages.pop() if len(stages) == 1 else None)
        g.compute = sum(n.compute_time for n in nodes)
        g.communication = sum(n.communication_time for n in nodes)
        g.activations = sum(n.activation_memory for n in nodes)
        g.flops = sum(n.flops for n in nodes)
        groups.append(g)
    for fqn, by_stage in weight_placements(plan).items():
        k = _owner(fqn, runs, layer_names)
        if k is None:
            k = 0
        g, layer = groups[k], runs[k][0]
        name = fqn[len(layer) + 1:] if layer is not None and fqn.startswith(layer + ".") else fqn
        placements = by_stage.get(g.stage, next(iter(by_stage.values())))
        g.weights[name] = tuple(placements)
        p, gr, o = plan.parameter_memory.get(fqn, (0.0, 0.0, 0.0))
        g.parameters, g.gradients, g.optimizer = g.parameters + p, g.gradients + gr, g.optimizer + o
    state = _buffer_bytes(plan)
    if state:
        groups.append(LayerGroup(label="(buffers, constants)", layers=[None], nodes=[], parameters=state))
    _share_bubble(plan, groups)
    return _merge_repeats(groups)


def _buffer_bytes(plan) -> float:
    """The model state per device beside the parameters (buffers, lifted constants): the plan's
    parameter memory less its weights'. A pipelined plan's memory is its worst stage's: not split."""
    if plan_stages(plan) or not plan.parameter_memory:
        return 0.0
    rest = plan.memory.parameters - sum(p for p, _, _ in plan.parameter_memory.values())
    return rest if rest > 1e-9 * plan.memory.parameters else 0.0


def _share_bubble(plan, groups) -> None:
    """Bubble per row: with stage times, each stage idles ``step − micro_batches · stage time``
    in a step, shared over that stage's rows in proportion to their time; otherwise the plan's
    bubble is shared over all rows that way."""
    stages = plan_stages(plan)
    times = [getattr(st, "time", None) for st in stages]
    if stages and all(isinstance(t, (int, float)) for t in times):
        idle = [max(0.0, plan.time.total - num_micro_batches(plan) * t) for t in times]
        for k, bubble in enumerate(idle):
            mine = [g for g in groups if g.stage == k]
            work = sum(g.compute + g.communication for g in mine) or 1.0
            for g in mine:
                g.bubble = bubble * (g.compute + g.communication) / work
        return
    total = plan.time.bubble
    if total <= 0:
        return
    work = sum(g.compute + g.communication for g in groups) or 1.0
    for g in groups:
        g.bubble = total * (g.compute + g.communication) / work


def _merge_repeats(groups: list[LayerGroup]) -> list[LayerGroup]:
    merged: list[LayerGroup] = []
    for g in groups:
        key = _layer_key(g.layers[0])
        if merged and key is not None:
            prev = merged[-1]
            pkey = _layer_key(prev.layers[-1])
            if pkey and pkey[0] == key[0] and pkey[1] + 1 == key[1] and prev.signature() == g.signature():
                _accumulate(prev, g)
                continue
        merged.append(g)
    for g in merged:
        if g.count > 1:
            a, b = _layer_key(g.layers[0]), _layer_key(g.layers[-1])
            g.label = f"{a[0]}.{a[1]}-{b[1]}"
            n = g.count
            for attr in ("compute", "communication", "bubble", "parameters", "gradients",
                         "optimizer", "activations", "flops"):
                setattr(g, attr, getattr(g, attr) / n)
    return merged


def _accumulate(into: LayerGroup, g: LayerGroup) -> None:
    into.layers.extend(g.layers)
    for attr in ("compute", "communication", "bubble", "parameters", "gradients", "optimizer",
                 "activations", "flops"):
        setattr(into, attr, getattr(into, attr) + getattr(g, attr))


# ----------------------------------------------------------------------------- the summary text


def _weights_text(weights: dict) -> str:
    """``R,S(0): q_proj k_proj | R,S(1): o_proj``: weights grouped by placement; ``.weight`` is
    dropped, a module whose parameters are all placed alike is named once, and numbered modules
    placed alike fold (``block.0-5.attn``)."""
    modules: dict[str, dict[str, tuple]] = {}
    for name, pl in sorted(weights.items()):
        mod, _, leaf = name.rpartition(".")
        modules.setdefault(mod, {})[leaf] = pl
    by_placement: dict[tuple, list[str]] = {}
    for mod, leaves in modules.items():
        if len(set(leaves.values())) == 1:
            by_placement.setdefault(next(iter(leaves.values())), []).append(mod or next(iter(leaves)))
            continue
        for leaf, pl in leaves.items():
            full = f"{mod}.{leaf}" if mod else leaf
            by_placement.setdefault(pl, []).append(full[:-len(".weight")] if full.endswith(".weight") else full)
    parts = [f"{fmt_placements(pl)}: {' '.join(fold_numbered(names))}" for pl, names in by_placement.items()]
    return " | ".join(parts)


def _wrap(prefix: str, text: str, *, indent: int | None = None) -> list[str]:
    rest = " " * (len(prefix) if indent is None else indent)
    return textwrap.wrap(text, width=WIDTH, initial_indent=prefix, subsequent_indent=rest,
                         break_on_hyphens=False) or [prefix.rstrip()]


def _header(plan) -> list[str]:
    cluster = plan.cluster
    stages = num_stages(plan)
    where = f" ({cluster.name})" if cluster.name else ""
    pipe = (f"{stages} pipeline stages x {num_micro_batches(plan)} micro-batches"
            f" ({getattr(plan, 'schedule', '?')})" if stages > 1 else "one stage (no pipeline)")
    t, m = plan.time, plan.memory
    sentences = [
        f"plan {plan.name!r}: mesh {tuple(plan.mesh_shape)} = {cluster.num_devices} x"
        f" {cluster.device_spec.name}{where}, {pipe}, {plan.options.optimizer} optimizer"
        f"{', mixed precision' if plan.options.mixed_precision else ''}",
        f"predicted step time {fmt_time(t.total)} = compute {fmt_time(t.compute)} + communication"
        f" {fmt_time(t.communication)} + resharding {fmt_time(t.resharding)} + bubble {fmt_time(t.bubble)}"
        + (f" + offload {fmt_time(t.offload)}" if getattr(t, "offload", 0) else ""),
        f"predicted peak memory {m.total / GiB:.2f} GiB per device (limit {memory_limit(plan) / GiB:.1f} GiB)"
        f" = parameters {m.parameters / GiB:.2f} + gradients {m.gradients / GiB:.2f}"
        f" + optimizer {m.optimizer / GiB:.2f} + activations {m.activations / GiB:.2f}",
        f"MFU {plan.mfu * 100:.1f}% ({plan.flops_per_step / 1e12:.3g} TFLOP per step at"
        f" {plan.peak_flops / 1e12:.4g} TFLOP/s peak); solver {plan.solver.method}: {plan.solver.status},"
        f" {plan.solver.graph_nodes} nodes -> {plan.solver.solver_nodes} decisions in"
        f" {plan.solver.solve_time_s:.2f} s, gap {plan.solver.gap:.2%}",
    ]
    if plan.input_placements:
        sentences.append("inputs: " + " ".join(f"{k}={fmt_placements(v)}" for k, v in plan.input_placements.items()))
    sentences += [_stage_text(k, st) for k, st in enumerate(plan_stages(plan))]
    sentences += _decisions(plan)
    lines = []
    for text in sentences:
        lines += _wrap("", text, indent=4)
    return lines


def _decisions(plan) -> list[str]:
    """One sentence per memory decision of a one-program plan: what it does, why the planner made
    it (``plan.why``) or that it was asked for."""
    why = tuple(getattr(plan, "why", ()))
    out = []
    if getattr(plan, "zero", 0):
        what = "optimizer state and gradients" if plan.zero == 2 else "optimizer state"
        out.append(f"ZeRO-{plan.zero}: the {what} of parameters stored whole on data-parallel axes sharded over"
                   f" them ({_reason(why, f'ZeRO-{plan.zero}') or 'asked for'})")
    if getattr(plan, "offload_parameters", False):
        out.append(f"parameters offloaded to the host (ZeRO-Infinity): each layer's fetched before use with the next"
                   f" one's prefetched, fetched again in backward, gradients sent to the host as made; the optimizer"
                   f" steps there; {plan.host_memory / GiB:.2f} GiB of the host per device,"
                   f" {fmt_time(plan.time.offload)} per step for the fetches not hidden behind compute, gradients down"
                   f" and the CPU step;"
                   f" {_reason(why, 'parameters offloaded') or 'asked for (Options(offload=parameters))'}")
    for node, k in getattr(plan, "tiles", {}).items():
        out.append(f"{node} runs as {k} tiles of its weight's rows, each fetched from the host (the next one"
                   f" prefetched) and its gradient sent back before the next: the device holds two tiles and a"
                   f" tile's gradient, not the weight and its gradient; {_reason(why, 'tiled') or 'asked for'}")
    if getattr(plan, "offload", False) and not getattr(plan, "offload_parameters", False):
        out.append(f"optimizer offloaded to the host (ZeRO-Offload): {plan.host_memory / GiB:.2f} GiB of the host"
                   f" per device, {fmt_time(plan.time.offload)} per step for gradients down, parameters up and the"
                   f" CPU step; {_reason(why, 'optimizer offloaded') or 'asked for (Options(offload=True))'}")
    if getattr(plan, "recompute", False) == "selective":
        out.append("selective recompute: in backward every repeated layer runs again the cheap ops between its"
                   " matmuls and attention, keeping what those make;"
                   f" {_reason(why, 'recompute') or 'asked for (Options(recompute=selective))'}")
    elif getattr(plan, "recompute", False):
        out.append("recompute: every repeated layer runs its forward again in backward, keeping only its inputs;"
                   f" {_reason(why, 'recompute') or 'asked for (Options(recompute=True))'}")
    if getattr(plan, "offload_activations", False):
        out.append("checkpoints offloaded: the layers' inputs kept for recomputation wait on the host between"
                   " forward and backward (moved down and up on the compute stream, in the offload seconds);"
                   f" {_reason(why, 'checkpoints offloaded') or 'asked for'}")
    return out


def _reason(why, decision: str) -> str | None:
    """The reason in ``why`` for ``decision`` (a sentence whose head, before its first colon, names
    it), without its head."""
    return next((w.split(": ", 1)[1] for w in why if decision in w.split(": ", 1)[0]), None)


def _span(items) -> str:
    """``[x.3, x.4, x.5]`` -> ``x.3-5``; other lists joined with commas."""
    keys = [_layer_key(i) for i in items]
    if keys and all(keys) and len({k[0] for k in keys}) == 1 and \
            [k[1] for k in keys] == list(range(keys[0][1], keys[0][1] + len(keys))):
        return items[0] if len(items) == 1 else f"{keys[0][0]}.{keys[0][1]}-{keys[-1][1]}"
    return ", ".join(items)


def _stage_text(k: int, st) -> str:
    ranks = tuple(getattr(st, "ranks", ()) or ())
    parts = []
    if getattr(st, "has_pre", False):
        parts.append("(before layers)")
    if getattr(st, "layers", None):
        parts.append(_span([x for x in st.layers if x]))
    if getattr(st, "has_post", False):
        parts.append("(after layers)")
    text = f"stage {k}:"
    if ranks:
        text += f" ranks {ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) else f" ranks {ranks}"
    if getattr(st, "mesh_shape", None):
        text += f" as mesh {tuple(st.mesh_shape)}"
    text += f", {' + '.join(parts) or 'no layers'}"
    if getattr(st, "zero", 0):
        text += f", ZeRO-{st.zero}"
    if getattr(st, "recompute", False):
        text += ", recompute"
    if isinstance(getattr(st, "time", None), (int, float)):
        text += f"; {fmt_time(st.time)} per micro-batch"
    if isinstance(getattr(st, "memory", None), (int, float)):
        text += f", peak {st.memory / GiB:.2f} GiB"
        if getattr(st, "breakdown", None) is not None:
            b = st.breakdown
            text += (f" = parameters {b.parameters / GiB:.2f} + gradients {b.gradients / GiB:.2f} + optimizer"
                     f" {b.optimizer / GiB:.2f} + activations {b.activations / GiB:.2f} + temporaries"
                     f" {b.temporaries / GiB:.2f} + communication {b.communication / GiB:.2f}")
    if getattr(st, "in_flight", None):
        text += f", {st.in_flight} micro-batch(es) in flight"
    return text


def memory_limit(plan) -> float:
    """Bytes per device the plan was allowed: device memory times ``memory_fraction``."""
    return plan.cluster.memory_per_device * plan.options.memory_fraction


_COLS = (f"{'layer (figures per layer)':26s} {'xN':>4s} {'stg':>3s} {'compute':>8s} {'comm':>8s}"
         f" {'bubble':>8s} {'param':>6s} {'grad':>6s} {'optim':>6s} {'activ':>6s} {'MFU':>5s}")


def _row(plan, label, count, stage, compute, comm, bubble, p, g, o, a, flops, *, known=(True, True, True)) -> str:
    """One table row; ``known``: whether the plan records (parameter memory, activation memory,
    FLOPs) per node/weight ('-' where it does not, e.g. pipelined plans)."""
    t = compute + comm + bubble
    mfu = f"{flops / t / plan.peak_flops * 100:4.1f}%" if t > 0 and plan.peak_flops > 0 and known[2] else "-"
    p, g, o = ((fmt_bytes(x) if known[0] else "-") for x in (p, g, o))
    a = fmt_bytes(a) if known[1] else "-"
    label = label if len(label) <= 26 else "..." + label[-23:]
    return (f"{label:26s} {count:>4} {'-' if stage is None else stage:>3} {fmt_time_short(compute):>8s}"
            f" {fmt_time_short(comm):>8s} {fmt_time_short(bubble) if bubble else '-':>8s}"
            f" {p:>6s} {g:>6s} {o:>6s} {a:>6s} {mfu:>5s}")


def summarize(plan) -> str:
    """The plan as text, at most 100 columns wide (see the module docstring)."""
    lines = _header(plan) + ["", _COLS, "-" * len(_COLS)]
    known = (bool(plan.parameter_memory) or not weight_placements(plan),
             any(n.activation_memory for n in plan.nodes) or not plan.memory.activations,
             any(n.flops for n in plan.nodes) or not plan.flops_per_step)
    for g in layer_groups(plan):
        lines.append(_row(plan, g.label, g.count, g.stage, g.compute, g.communication, g.bubble,
                          g.parameters, g.gradients, g.optimizer, g.activations, g.flops, known=known))
        if g.weights:
            lines += _wrap("    weights ", _weights_text(g.weights))
        act = g.activation_sharding
        if act is not None:
            lines.append(f"    output  {fmt_placements(act)}")
    t, m = plan.time, plan.memory
    lines += ["-" * len(_COLS),
              _row(plan, "total (step, worst device)", "", None, t.compute,
                   t.communication + t.resharding, t.bubble, m.parameters, m.gradients, m.optimizer,
                   m.activations, plan.flops_per_step),
              "  (the total's activations include the example inputs; its comm includes resharding)"]
    if plan_stages(plan):
        lines.append("  (pipelined: rows are per step over all micro-batches; the total is the slowest stage's)")
    if not all(known):
        lines.append("  (-: not recorded per layer by this plan; see the per-stage peaks above)")
    lines += _collective_table(plan)
    return "\n".join(lines)


def _collective_table(plan) -> list[str]:
    """The plan's collectives by kind and mesh axes, forward and backward side by side, with a total
    equal to the header's communication + resharding: what the plan does not itemise is named as such."""
    communication = plan.time.communication + plan.time.resharding
    by_kind: dict = {}
    for c in plan.collectives():
        key = (c.kind, c.phase, c.axes)
        cnt, b, t = by_kind.get(key, (0, 0.0, 0.0))
        by_kind[key] = (cnt + 1, b + c.nbytes, t + c.time)
    if not by_kind:
        if communication <= 0:
            return ["", "collectives: none"]
        what = ("tensor-parallel collectives, gradient synchronisation over dp"
                + (" and sends between stages" if len(plan_stages(plan)) > 1 else "") if plan_stages(plan) else "collectives")
        return [""] + _wrap("", f"collectives: {fmt_time(communication)} per step ({what}), not itemised by this"
                            " plan: each stage's time above includes them", indent=4)
    rows: dict = {}  # (kind, axes) -> {phase: (count, bytes)}, time
    for (kind, phase, axes), (cnt, b, t) in by_kind.items():
        per_phase, time = rows.get((kind, axes), ({}, 0.0))
        per_phase[phase] = (cnt, b)
        rows[(kind, axes)] = (per_phase, time + t)
    header = (f"{'collective':15s} {'mesh axes':>9s} {'fwd count':>9s} {'fwd bytes':>9s} {'bwd count':>9s}"
              f" {'bwd bytes':>9s} {'time':>9s}")
    lines = ["", header]

    def cells(per_phase, phase):
        cnt, b = per_phase.get(phase, (0, 0.0))
        return f"{cnt:9d} {fmt_bytes(b):>9s}" if cnt else f"{'-':>9s} {'-':>9s}"

    for (kind, axes), (per_phase, t) in sorted(rows.items()):
        lines.append(f"{kind:15s} {','.join(map(str, axes)):>9s} {cells(per_phase, 'forward')}"
                     f" {cells(per_phase, 'backward')} {fmt_time(t):>9s}")
    listed = sum(t for _, _, t in by_kind.values())
    if communication - listed > 1e-9 * max(communication, 1e-30):
        lines.append(f"{'the loss and buffers made replicated (not itemised)':65s}"
                     f" {fmt_time(communication - listed):>9s}")
    count = sum(c for c, _, _ in by_kind.values())
    lines += ["-" * len(header),
              f"{'total':15s} {'':>9s} {f'{count} collectives, {fmt_bytes(sum(b for _, b, _ in by_kind.values()))}':>39s}"
              f" {fmt_time(communication):>9s}"]
    return lines


__all__ = ["LayerGroup", "layer_groups", "summarize"]
