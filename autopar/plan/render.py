"""``plan.render(path)``: draw a plan as one self-contained HTML file (inline SVG and CSS, no
scripts or fonts fetched) or as a PNG (matplotlib, imported only here).

Three pictures:

- **schedule**: a Gantt chart, one row per pipeline stage, one forward and one backward bar per
  micro-batch (GPipe or 1F1B order). A bar's darker tail is its communication. Bar lengths are
  each stage's predicted seconds (forward: forward compute and forward collectives; backward:
  the rest), scaled so the schedule spans the predicted step time.
- **memory per device**: stacked bars (parameters, gradients, optimizer state, activations) per
  stage, with the allowed limit.
- **sharding map**: every weight (repeated layers once) against the mesh axes, one placement
  per cell.

``render`` returns the path it wrote.
"""

from __future__ import annotations

import html
import math
import os
import tempfile
from dataclasses import dataclass

from autopar.core.errors import AutoparError, PlanError
from autopar.plan.report import (
    GiB,
    fmt_bytes,
    fmt_time,
    layer_groups,
    memory_limit,
    num_micro_batches,
    num_stages,
    plan_stages,
    stage_index,
    summarize,
)

PNG_SIZE = (1200, 900)  # pixels
MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations")
COLORS = {"forward": "#4c78a8", "backward": "#f58518", "comm": "#222222", "parameters": "#4c78a8",
          "gradients": "#72b7b2", "optimizer": "#f58518", "activations": "#e45756", "total": "#9e9e9e"}
PLACEMENT_COLORS = {"R": "#e0e0e0", "P": "#e45756"}
SHARD_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#eeca3b", "#9d755d")
MAX_MAP_ROWS = 40


class RenderError(AutoparError, ValueError):
    """A plan cannot be drawn to the requested path (format, or matplotlib missing)."""


# ----------------------------------------------------------------------------- the data drawn


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
            raise PlanError(f"the {kind} schedule of {stages} stages deadlocked; this is a bug in autopar.plan.render")
    span = max(r[4] for r in raw) if raw else 0.0
    scale = plan.predicted_step_time / span if span > 0 else 0.0
    return [Bar(s, m, k, a * scale, b * scale, c * scale) for s, m, k, a, b, c in raw]


def stage_memory(plan) -> list[dict]:
    """Bytes per device of each stage as ``{part: bytes}`` over MEMORY_PARTS, or ``{"total":
    bytes}`` for a stage whose split the plan does not record. One stage: the plan's worst-device
    breakdown. Stages: the one at the plan's peak gets that breakdown, the others their peak."""
    split = {p: getattr(plan.memory, p) for p in MEMORY_PARTS}
    stages = plan_stages(plan)
    if not stages:
        return [split]
    peaks = [getattr(st, "memory", None) for st in stages]
    if not all(isinstance(m, (int, float)) for m in peaks):
        return [split] + [{"total": 0.0} for _ in stages[1:]]
    worst = max(range(len(peaks)), key=lambda k: peaks[k])
    return [split if k == worst else {"total": float(m)} for k, m in enumerate(peaks)]


def sharding_rows(plan) -> list[tuple[str, tuple[str, ...]]]:
    """``(label, placements)`` per weight, repeated layers once (``layers.0-79/q_proj.weight``);
    in a pipelined plan labels start with the stage (``s1 ``) and placements are on its mesh."""
    rows = []
    stages = plan_stages(plan)
    for g in layer_groups(plan):
        for name, pl in sorted(g.weights.items()):
            prefix = g.label + "/" if g.layers[0] is not None else ""
            stage = ""
            if stages and g.stage is not None:
                mesh = getattr(stages[g.stage], "mesh_shape", None)
                stage = f"s{g.stage}" + (f"[{'x'.join(map(str, mesh))}] " if mesh else " ")
            rows.append((stage + prefix + name, tuple(pl)))
    return rows


def axis_labels(plan) -> list[str]:
    """Column heads of the sharding map: the plan's mesh axes, or (pipelined) each stage's."""
    if plan_stages(plan):
        return [f"axis {a} (stage mesh)" for a in range(len(plan.mesh_shape))]
    return [f"axis {a} ({n})" for a, n in enumerate(plan.mesh_shape)]


def placement_color(p: str) -> str:
    if p.startswith("S("):
        return SHARD_COLORS[int(p[2:-1]) % len(SHARD_COLORS)]
    return PLACEMENT_COLORS.get(p[:1], "#cccccc")


# ----------------------------------------------------------------------------- HTML


def _ticks(span: float, n: int = 6) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def _gantt_svg(plan, bars: list[Bar]) -> str:
    stages = num_stages(plan)
    left, top, row_h, width = 90, 24, 34, 1000
    span = plan.predicted_step_time or 1.0
    x = lambda t: left + (width - left - 20) * t / span  # noqa: E731
    height = top + stages * row_h + 34
    out = [f'<svg class="gantt" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
           f' viewBox="0 0 {width} {height}">']
    for s in range(stages):
        y = top + s * row_h
        out.append(f'<text x="8" y="{y + row_h / 2 + 4}" class="lbl">stage {s}</text>')
    for b in bars:
        y = top + b.stage * row_h + 4
        x0, x1 = x(b.start), x(b.end)
        w = max(x1 - x0, 0.5)
        title = (f"stage {b.stage}, micro-batch {b.micro_batch}, {b.kind}: {fmt_time(b.end - b.start)}"
                 f" ({fmt_time(b.communication)} communication)")
        out.append(f'<g class="gantt-bar" data-stage="{b.stage}" data-micro-batch="{b.micro_batch}"'
                   f' data-kind="{b.kind}"><title>{html.escape(title)}</title>'
                   f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 8}"'
                   f' fill="{COLORS[b.kind]}" stroke="#fff" stroke-width="0.5"/>')
        if b.communication > 0:
            cw = w * b.communication / max(b.end - b.start, 1e-30)
            out.append(f'<rect class="gantt-comm" x="{x0 + w - cw:.2f}" y="{y}" width="{cw:.2f}"'
                       f' height="{row_h - 8}" fill="{COLORS["comm"]}" fill-opacity="0.45"/>')
        if w > 26:
            out.append(f'<text x="{x0 + 3:.2f}" y="{y + row_h / 2}" class="barlbl">'
                       f'{"F" if b.kind == "forward" else "B"}{b.micro_batch}</text>')
        out.append("</g>")
    axis_y = top + stages * row_h + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{x(span):.2f}" y2="{axis_y}" stroke="#555"/>')
    for t in _ticks(span):
        out.append(f'<line x1="{x(t):.2f}" y1="{axis_y}" x2="{x(t):.2f}" y2="{axis_y + 4}" stroke="#555"/>'
                   f'<text x="{x(t):.2f}" y="{axis_y + 16}" class="tick">{fmt_time(t)}</text>')
    out.append("</svg>")
    return "".join(out)


def _memory_svg(plan, mem: list[dict], limit: float) -> str:
    width, height, left, bottom, top = 520, 300, 60, 40, 16
    highest = max(max(sum(m.values()) for m in mem), 1.0)
    most = max(highest, limit) if limit <= 4 * highest else highest  # a far-off limit is only named
    y = lambda b: height - bottom - (height - bottom - top) * b / most  # noqa: E731
    bw = min(80, (width - left - 20) / len(mem) * 0.6)
    out = [f'<svg class="memory" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
           f' viewBox="0 0 {width} {height}">']
    for i, m in enumerate(mem):
        x0 = left + (width - left - 20) * (i + 0.5) / len(mem) - bw / 2
        base = 0.0
        for part in MEMORY_PARTS + ("total",):
            v = m.get(part, 0.0)
            if v > 0:
                out.append(f'<rect class="mem-{part}" data-stage="{i}" x="{x0:.2f}" y="{y(base + v):.2f}" width="{bw:.2f}"'
                           f' height="{y(base) - y(base + v):.2f}" fill="{COLORS[part]}">'
                           f'<title>{part if part != "total" else "peak (split not recorded)"}:'
                           f' {fmt_bytes(v)}</title></rect>')
            base += v
        label = f"stage {i}" if len(mem) > 1 else "every device"
        out.append(f'<text x="{x0 + bw / 2:.2f}" y="{height - bottom + 16}" class="tick">{label}</text>'
                   f'<text x="{x0 + bw / 2:.2f}" y="{y(base) - 4:.2f}" class="tick">{base / GiB:.2f} GiB</text>')
    if limit <= most:
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(limit):.2f}" y2="{y(limit):.2f}" stroke="#c00"'
                   f' stroke-dasharray="4 3"/><text x="{width - 12}" y="{y(limit) - 4:.2f}" class="tick"'
                   f' text-anchor="end">limit {limit / GiB:.1f} GiB</text>')
    else:
        out.append(f'<text x="{width - 12}" y="{top + 12}" class="tick" text-anchor="end">limit'
                   f' {limit / GiB:.1f} GiB (off scale)</text>')
    legend = MEMORY_PARTS + (("total",) if any("total" in m for m in mem) else ())
    for i, part in enumerate(legend):
        out.append(f'<rect x="{left + i * 92}" y="2" width="10" height="10" fill="{COLORS[part]}"/>'
                   f'<text x="{left + i * 92 + 14}" y="11" class="lbl">{part if part != "total" else "peak"}</text>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#555"/>')
    out.append("</svg>")
    return "".join(out)


def _sharding_table(plan, rows) -> str:
    axes = "".join(f"<th>{html.escape(label)}</th>" for label in axis_labels(plan))
    body = []
    for name, pl in rows:
        cells = "".join(f'<td style="background:{placement_color(p)}">{html.escape(p)}</td>' for p in pl)
        body.append(f'<tr class="shard-row"><td class="wname">{html.escape(name)}</td>{cells}</tr>')
    return f'<table class="shard"><tr><th>weight</th>{axes}</tr>{"".join(body)}</table>'


_CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:18px;color:#222}
h1{font-size:18px;margin:0 0 6px} h2{font-size:15px;margin:22px 0 6px}
.lbl{font-size:12px} .tick{font-size:10px;text-anchor:middle;fill:#444} .barlbl{font-size:10px;fill:#fff}
.row{display:flex;gap:28px;flex-wrap:wrap;align-items:flex-start}
table.shard{border-collapse:collapse;font:12px monospace} table.shard td,table.shard th{border:1px solid #fff;padding:2px 8px}
table.shard th{background:#f4f4f4} td.wname{background:#fafafa}
pre{font:12px/1.3 monospace;background:#f7f7f7;padding:10px;overflow:auto}
"""


def to_html(plan) -> str:
    """The plan as one self-contained HTML document (see the module docstring)."""
    bars = schedule_bars(plan)
    limit = memory_limit(plan)
    t = plan.time
    stages, micro = num_stages(plan), num_micro_batches(plan)
    sched = f"{stages} stages x {micro} micro-batches, {schedule_kind(plan)} order" if stages > 1 else (
        f"one stage, {micro} micro-batch{'es' if micro > 1 else ''}")
    return "".join([
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>autopar plan {html.escape(plan.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>autopar plan {html.escape(plan.name)} &mdash; mesh {tuple(plan.mesh_shape)}</h1>",
        f"<p>predicted step time <b>{fmt_time(t.total)}</b> (compute {fmt_time(t.compute)}, communication"
        f" {fmt_time(t.communication)}, resharding {fmt_time(t.resharding)}, bubble {fmt_time(t.bubble)});"
        f" peak memory <b>{plan.predicted_peak_memory / GiB:.2f} GiB</b> per device; MFU"
        f" <b>{plan.mfu * 100:.1f}%</b></p>",
        f"<h2>Schedule ({sched}; dark tail = communication)</h2>",
        _gantt_svg(plan, bars),
        "<div class='row'><div><h2>Memory per device</h2>", _memory_svg(plan, stage_memory(plan), limit),
        "</div><div><h2>Sharding map (placement per mesh axis)</h2>",
        _sharding_table(plan, sharding_rows(plan)), "</div></div>",
        "<h2>Summary</h2><details open><summary>text summary</summary><pre>",
        html.escape(summarize(plan)), "</pre></details></body></html>",
    ])


# ----------------------------------------------------------------------------- PNG


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RenderError("drawing a PNG needs matplotlib: pip install matplotlib (or the 'dev' extra),"
                          " or render to .html instead") from exc
    return plt


def to_png(plan, path) -> None:
    """Draw the three pictures with matplotlib into a PNG_SIZE image at ``path``."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    dpi = 100
    fig = plt.figure(figsize=(PNG_SIZE[0] / dpi, PNG_SIZE[1] / dpi), dpi=dpi)
    try:
        grid = fig.add_gridspec(2, 2, height_ratios=(0.75, 1.25), width_ratios=(1, 1.9), hspace=0.35,
                                wspace=0.12, left=0.07, right=0.97, top=0.94, bottom=0.05)
        gantt, memory, table = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
        stages = num_stages(plan)
        for b in schedule_bars(plan):
            gantt.barh(b.stage, b.end - b.start, left=b.start, height=0.6, color=COLORS[b.kind], edgecolor="white")
            if b.communication > 0:
                gantt.barh(b.stage, b.communication, left=b.end - b.communication, height=0.6,
                           color=COLORS["comm"], alpha=0.45)
        gantt.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        gantt.set_ylim(stages - 0.5, -0.5 - (0.6 if stages == 1 else 0))
        gantt.set_xlim(0, plan.predicted_step_time or 1.0)
        gantt.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_time(v) if v else "0"))
        gantt.set_title(f"plan {plan.name}: schedule, {num_micro_batches(plan)} micro-batch(es),"
                        f" predicted step {fmt_time(plan.predicted_step_time)}", fontsize=11, loc="left")
        gantt.legend(handles=[Patch(color=COLORS["forward"], label="forward"),
                              Patch(color=COLORS["backward"], label="backward"),
                              Patch(color=COLORS["comm"], alpha=0.45, label="communication")],
                     loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=3, frameon=False)
        mem = stage_memory(plan)
        base = [0.0] * len(mem)
        for part in MEMORY_PARTS + ("total",):
            vals = [m.get(part, 0.0) / GiB for m in mem]
            if any(vals):
                memory.bar(range(len(mem)), vals, bottom=base, color=COLORS[part], width=0.5,
                           label=part if part != "total" else "peak (split not recorded)")
            base = [a + b for a, b in zip(base, vals)]
        limit = memory_limit(plan) / GiB
        on_scale = limit <= 4 * max(base + [1e-9])
        if on_scale:
            memory.axhline(limit, color="#c00", linestyle="--", label=f"limit {limit:.1f} GiB")
        memory.set_xticks(range(len(mem)), [f"stage {i}" for i in range(len(mem))] if len(mem) > 1 else ["every device"])
        memory.set_xlim(-0.75, len(mem) - 0.25 + 0.6)
        memory.set_ylabel("GiB per device")
        memory.set_title("memory per device" + ("" if on_scale else f" (limit {limit:.1f} GiB off scale)"),
                         fontsize=11)
        memory.legend(fontsize=7, loc="upper right")
        rows = sharding_rows(plan)
        shown = rows[:MAX_MAP_ROWS]
        table.axis("off")
        if shown:
            axes = len(plan.mesh_shape)
            tab = table.table(cellText=[[n[-60:], *pl] for n, pl in shown],
                              colLabels=["weight", *axis_labels(plan)],
                              cellColours=[["#fafafa", *(placement_color(p) for p in pl)] for _, pl in shown],
                              colWidths=[0.64, *([0.36 / axes] * axes)], bbox=[0, 0, 1, 1], cellLoc="center")
            tab.auto_set_font_size(False)
            tab.set_fontsize(7)
            for (r, c), cell in tab.get_celld().items():
                if c == 0 and r > 0:
                    cell.set_text_props(ha="left")
        more = f" (first {MAX_MAP_ROWS} of {len(rows)})" if len(rows) > MAX_MAP_ROWS else ""
        table.set_title(f"sharding map{more}", fontsize=11)
        fig.savefig(path, dpi=dpi, format="png")
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------- entry point


def render(plan, path) -> str:
    """Write ``plan`` to ``path``: ``.html`` (self-contained) or ``.png`` (matplotlib). The file
    is replaced atomically. Returns ``path`` as a string."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".html", ".htm", ".png"):
        raise RenderError(f"cannot render to {path!r}: use a .html or .png file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise RenderError(f"cannot render to {path!r}: the folder {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".render-", suffix=ext, dir=directory)
    os.close(fd)
    try:
        if ext == ".png":
            to_png(plan, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(to_html(plan))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


__all__ = ["Bar", "RenderError", "render", "schedule_bars", "sharding_rows", "stage_memory", "to_html"]
