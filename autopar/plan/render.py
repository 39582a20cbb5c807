"""``plan.render(path)``: draw a plan as one self-contained HTML file (inline SVG and CSS, no
scripts or fonts fetched) or as a PNG (:mod:`autopar.plan.render_png`, matplotlib).

Three pictures, whose data :mod:`autopar.plan.picture` computes: the schedule (a Gantt chart of
every stage's forward and backward passes per micro-batch, communication as each bar's dark
tail), the memory per device (each stage's peak split into its parts, with the limit) and the
sharding map (every weight's placement per mesh axis, grouped as the summary's rows).

``render`` returns the path it wrote; the file is replaced atomically and gets the permissions
of any new file.
"""

from __future__ import annotations

import html
import math
import os

from autopar.core.errors import AutoparError
from autopar.plan.files import replacing
from autopar.plan.formatting import GiB, fmt_bytes, fmt_time
from autopar.plan.picture import (
    MEMORY_COLORS,
    MEMORY_PARTS,
    PHASE_COLORS,
    Bar,
    axis_labels,
    placement_color,
    schedule_bars,
    schedule_kind,
    sharding_map,
    stage_memory,
)
from autopar.plan.render_png import to_png
from autopar.plan.report import memory_limit, num_micro_batches, num_stages, summarize


class RenderError(AutoparError, ValueError):
    """A plan cannot be drawn to the requested path (format, or matplotlib missing)."""


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
                   f' fill="{PHASE_COLORS[b.kind]}" stroke="#fff" stroke-width="0.5"/>')
        if b.communication > 0:
            cw = w * b.communication / max(b.end - b.start, 1e-30)
            out.append(f'<rect class="gantt-comm" x="{x0 + w - cw:.2f}" y="{y}" width="{cw:.2f}"'
                       f' height="{row_h - 8}" fill="{PHASE_COLORS["communication"]}"/>')
        if w > 26:
            out.append(f'<text x="{x0 + 3:.2f}" y="{y + row_h / 2}" class="barlbl">'
                       f'{"F" if b.kind == "forward" else "B"}{b.micro_batch}</text>')
        out.append("</g>")
    axis_y = top + stages * row_h + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{x(span):.2f}" y2="{axis_y}" stroke="#555"/>')
    for t in _ticks(span):
        out.append(f'<line x1="{x(t):.2f}" y1="{axis_y}" x2="{x(t):.2f}" y2="{axis_y + 4}" stroke="#555"/>'
                   f'<text x="{x(t):.2f}" y="{axis_y + 16}" class="tick">{fmt_time(t)}</text>')
    for i, (kind, color) in enumerate(PHASE_COLORS.items()):
        out.append(f'<rect x="{left + i * 120}" y="4" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + i * 120 + 14}" y="13" class="lbl">{kind}</text>')
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
                           f' height="{y(base) - y(base + v):.2f}" fill="{MEMORY_COLORS[part]}">'
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
        out.append(f'<rect x="{left + i * 92}" y="2" width="10" height="10" fill="{MEMORY_COLORS[part]}"/>'
                   f'<text x="{left + i * 92 + 14}" y="11" class="lbl">{part if part != "total" else "peak"}</text>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#555"/>')
    out.append("</svg>")
    return "".join(out)


def _sharding_table(plan, groups) -> str:
    labels = axis_labels(plan)
    axes = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
    body = []
    for group in groups:
        body.append(f'<tr class="shard-group"><td colspan="{len(labels) + 1}">'
                    f'{html.escape(group.title)}</td></tr>')
        for name, pl in group.rows:
            cells = "".join(f'<td style="background:{placement_color(p)}">{html.escape(p)}</td>' for p in pl)
            body.append(f'<tr class="shard-row"><td class="wname">{html.escape(name)}</td>{cells}</tr>')
    return f'<table class="shard"><tr><th>weight</th>{axes}</tr>{"".join(body)}</table>'


_CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:18px;color:#222}
h1{font-size:18px;margin:0 0 6px} h2{font-size:15px;margin:22px 0 6px}
.lbl{font-size:12px} .tick{font-size:10px;text-anchor:middle;fill:#444} .barlbl{font-size:10px;fill:#fff}
.row{display:flex;gap:28px;flex-wrap:wrap;align-items:flex-start}
table.shard{border-collapse:collapse;font:12px monospace} table.shard td,table.shard th{border:1px solid #fff;padding:2px 8px}
table.shard th{background:#f4f4f4} td.wname{background:#fafafa;padding-left:18px}
tr.shard-group td{background:#f0f0f0;font-weight:bold}
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
        f"<h2>Schedule ({sched})</h2>",
        _gantt_svg(plan, bars),
        "<div class='row'><div><h2>Memory per device</h2>", _memory_svg(plan, stage_memory(plan), limit),
        "</div><div><h2>Sharding map (placement per mesh axis)</h2>",
        _sharding_table(plan, sharding_map(plan)), "</div></div>",
        "<h2>Summary</h2><details open><summary>text summary</summary><pre>",
        html.escape(summarize(plan)), "</pre></details></body></html>",
    ])


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
    try:
        with replacing(path, suffix=ext) as tmp:
            if ext == ".png":
                to_png(plan, tmp)
            else:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(to_html(plan))
    except ImportError as exc:  # to_png imports matplotlib, an optional dependency, when it draws
        raise RenderError("drawing a PNG needs matplotlib: pip install matplotlib (or the 'dev' extra),"
                          " or render to .html instead") from exc
    return path


__all__ = ["Bar", "RenderError", "render", "schedule_bars", "sharding_map", "stage_memory", "to_html"]
