"""What a plan's pictures show, as data (``render`` draws it as HTML or PNG).

- **schedule**: one forward and one backward :class:`Bar` per pipeline stage and micro-batch
  (GPipe or 1F1B order); a bar's tail is its communication. Bar lengths are each stage's
  predicted seconds (forward: forward compute and forward collectives; backward: the rest),
  scaled so the schedule spans the predicted step time.
- **memory per device**: each stage's peak split into parameters, gradients, optimizer state
  and activations, against the allowed limit.
- **sharding map**: every weight's placement per mesh axis, grouped as the summary's rows
  (repeated layers folded: ``model.layers.1-79``), numbered modules placed alike folded
  (``block.0-5.attn.q.weight``), in natural order (``block.2`` before ``block.10``).

Colours: the phases (forward, backward, communication), the memory parts and the placements
each have their own, so no colour means two things.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.errors import PlanError
from autopar.plan.formatting import fold_numbered, natural_key
from autopar.plan.report import layer_groups, num_micro_batches, num_stages, plan_stages, stage_index

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication")
PHASE_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "communication": "#3b3b3b"}
MEMORY_COLORS = {"parameters": "#7b4f9d", "gradients": "#b39ddb", "optimizer": "#8c6d31",
                 "activations": "#d6604d", "temporaries": "#f4a582", "communication": "#92c5de",
                 "total": "#a0a0a0"}
PLACEMENT_COLORS = {"R": "#ececec", "P": "#fbb4ae"}
SHARD_COLORS = ("#b3de69", "#bebada", "#ffed6f", "#8dd3c7", "#fccde5", "#bc80bd")  # S(0), S(1), ...


# ----------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Bar:
    """One forward or backward pass of one micro-batch on one stage (seconds)."""

    stage: int
    micro_batch: int
    kind: str  # "forward" | "backward"
    start: float
    end: float
    communication: float  # seconds of the bar that are communication (drawn as its tail)


def _stage_work(plan) -> list[dict]:
    """Per stage: forward and backward seconds per step and their communication. Forward is
    forward compute plus forward-phase collectives; the rest is backward (communication of no
    recorded phase included). A stage with its own ``time`` per micro-batch is scaled to it."""
    forward_comm: dict[str, float] = {}
    for c in plan.collective_records:
        if c.phase == "forward":
            forward_comm[c.node] = forward_comm.get(c.node, 0.0) + c.time
    index = stage_index(plan)
    work = [dict(f=0.0, fc=0.0, b=0.0, bc=0.0) for _ in range(num_stages(plan))]
    for n in plan.nodes:
        w = work[index.get(n.node, 0)]
        fwd_compute = n.forward_compute_time if n.forward_compute_time > 0 else n.compute_time / 3
        fc = min(forward_comm.get(n.node, 0.0), n.communication_time)
        w["f"] += fwd_compute + fc
        w["fc"] += fc
        w["b"] += n.compute_time - fwd_compute + n.communication_time - fc
        w["bc"] += n.communication_time - fc
    for st, w in zip(plan_stages(plan), work):
        t = getattr(st, "time", None)
        total = w["f"] + w["b"]
        if isinstance(t, (int, float)) and t > 0 and total > 0:
            scale = t * num_micro_batches(plan) / total
            for key in w:
                w[key] *= scale
    return work


def _order(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("forward", m) for m in range(micro)] + [("backward", m) for m in range(micro)]
    warm = min(stages - stage - 1, micro)
    order = [("forward", m) for m in range(warm)]
    for i in range(micro - warm):
        order += [("forward", warm + i), ("backward", i)]
    return order + [("backward", m) for m in range(micro - warm, micro)]


def schedule_kind(plan) -> str:
    """``"gpipe"`` or ``"1f1b"``: how the Gantt chart orders micro-batches."""
    s = str(getattr(plan, "schedule", "") or "").lower().replace("-", "").replace("_", "")
    return "gpipe" if s in ("gpipe", "") else "1f1b"


def schedule_bars(plan) -> list[Bar]:
    """The Gantt chart's bars (see the module docstring), simulated in schedule order: a forward
    waits for the previous stage's forward of its micro-batch, a backward for the next stage's
    backward, and each stage runs one pass at a time."""
    stages, micro = num_stages(plan), num_micro_batches(plan)
    work = _stage_work(plan)
    kind = schedule_kind(plan)
    orders = [_order(kind, s, stages, micro) for s in range(stages)]
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * stages
    pos = [0] * stages
    raw: list[tuple] = []
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] >= len(orders[s]):
                continue
            k, m = orders[s][pos[s]]
            dep = (s - 1, "forward", m) if k == "forward" else (s + 1, "backward", m)
            if (k == "forward" and s == 0) or (k == "backward" and s == stages - 1):
                ready = done.get((s, "forward", m), 0.0) if k == "backward" else 0.0
            elif dep in done:
                ready = done[dep]
            else:
                continue
            w = work[s]
            dur, comm = (w["f"], w["fc"]) if k == "forward" else (w["b"], w["bc"])
            start = max(free[s], ready)
            end = start + dur / micro
            done[(s, k, m)] = free[s] = end
            raw.append((s, m, k, start, end, comm / micro))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise PlanError(f"the {kind} schedule of {stages} stages deadlocked; this is a bug in autopar.plan.picture")
    span = max(r[4] for r in raw) if raw else 0.0
    scale = plan.predicted_step_time / span if span > 0 else 0.0
    return [Bar(s, m, k, a * scale, b * scale, c * scale) for s, m, k, a, b, c in raw]


# ----------------------------------------------------------------------------- memory


def stage_memory(plan) -> list[dict]:
    """Bytes per device of each stage as ``{part: bytes}`` over MEMORY_PARTS. One stage: the
    plan's worst-device breakdown; stages: each stage's recorded breakdown. A plan saved before
    stages recorded theirs splits only the stage at its peak; the others are ``{"total": peak}``."""
    split = {p: getattr(plan.memory, p) for p in MEMORY_PARTS}
    stages = plan_stages(plan)
    if not stages:
        return [split]
    if all(st.breakdown is not None for st in stages):
        return [{p: getattr(st.breakdown, p) for p in MEMORY_PARTS} for st in stages]
    worst = max(range(len(stages)), key=lambda k: stages[k].memory)
    return [split if k == worst else {"total": float(st.memory)} for k, st in enumerate(stages)]


# ----------------------------------------------------------------------------- sharding map


@dataclass(frozen=True)
class MapGroup:
    """The sharding map's rows under one heading (a row of the summary): ``(weight name relative
    to the group, placements)`` per row."""

    title: str
    rows: tuple[tuple[str, tuple[str, ...]], ...]


def sharding_map(plan) -> list[MapGroup]:
    """The sharding map (module docstring); in a pipelined plan each heading names its stage and
    the placements are on that stage's mesh."""
    stages = plan_stages(plan)
    out = []
    for g in layer_groups(plan):
        if not g.weights:
            continue
        by_placement: dict[tuple, list[str]] = {}
        for name, pl in g.weights.items():
            by_placement.setdefault(tuple(pl), []).append(name)
        rows = sorted(((label, pl) for pl, names in by_placement.items() for label in fold_numbered(names)),
                      key=lambda row: natural_key(row[0]))
        title = g.label + (f" (x{g.count})" if g.count > 1 else "")
        if stages and g.stage is not None:
            title = f"stage {g.stage}, mesh {'x'.join(map(str, stages[g.stage].mesh_shape))}: {title}"
        out.append(MapGroup(title, tuple(rows)))
    return out


def axis_labels(plan) -> list[str]:
    """Column heads of the sharding map: the plan's mesh axes with their sizes, or (pipelined)
    each stage's mesh axes ``(dp, tp)``."""
    if plan_stages(plan):
        return [f"axis {a} ({name})" for a, name in enumerate(("dp", "tp"))]
    return [f"axis {a} ({n})" for a, n in enumerate(plan.mesh_shape)]


def placement_color(p: str) -> str:
    if p.startswith("S("):
        return SHARD_COLORS[int(p[2:-1]) % len(SHARD_COLORS)]
    return PLACEMENT_COLORS.get(p[:1], "#cccccc")


__all__ = ["MEMORY_COLORS", "MEMORY_PARTS", "PHASE_COLORS", "Bar", "MapGroup", "axis_labels", "placement_color",
           "schedule_bars", "schedule_kind", "sharding_map", "stage_memory"]
