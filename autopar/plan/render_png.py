"""The plan as a PNG: the schedule across the top, the memory per device and the sharding map
under it (the data: :mod:`autopar.plan.picture`).

The image is :data:`PNG_WIDTH` pixels wide and as tall as its sharding map needs (at least
:data:`MIN_HEIGHT`): every map row is drawn in :data:`MAP_FONT`-point type, up to
:data:`MAX_MAP_ROWS` rows (then the map says how many it leaves to the HTML page). matplotlib is
an optional dependency, imported when drawing: without it :func:`to_png` raises ImportError.
"""

from __future__ import annotations

from autopar.plan.formatting import GiB, fmt_time
from autopar.plan.picture import (
    MEMORY_COLORS,
    MEMORY_PARTS,
    PHASE_COLORS,
    axis_labels,
    placement_color,
    schedule_bars,
    sharding_map,
    stage_memory,
)
from autopar.plan.report import memory_limit, num_micro_batches, num_stages

DPI = 100
PNG_WIDTH = 1200  # pixels
MIN_HEIGHT = 900  # pixels
MAP_FONT = 9  # points
ROW = 0.2  # inches per sharding-map row
MAX_MAP_ROWS = 150
CHAR = 0.6 * MAP_FONT / 72  # inches per monospace character


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _map_lines(plan) -> tuple[list[tuple], int]:
    """The map's lines: ``("group", title, None)`` and ``("row", name, placements)``, at most
    MAX_MAP_ROWS, and how many lines were left out."""
    lines = []
    for group in sharding_map(plan):
        lines.append(("group", group.title, None))
        lines += [("row", name, pl) for name, pl in group.rows]
    return lines[:MAX_MAP_ROWS], max(0, len(lines) - MAX_MAP_ROWS)


def _gantt(ax, plan) -> None:
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    stages = num_stages(plan)
    for b in schedule_bars(plan):
        ax.barh(b.stage, b.end - b.start, left=b.start, height=0.6, color=PHASE_COLORS[b.kind], edgecolor="white")
        if b.communication > 0:
            ax.barh(b.stage, b.communication, left=b.end - b.communication, height=0.6,
                    color=PHASE_COLORS["communication"], edgecolor="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_xlim(0, plan.predicted_step_time or 1.0)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_time(v) if v else "0"))
    ax.set_title(f"plan {plan.name}: schedule, {num_micro_batches(plan)} micro-batch(es), predicted step"
                 f" {fmt_time(plan.predicted_step_time)}", fontsize=11, loc="left")
    ax.legend(handles=[Patch(color=color, label=kind) for kind, color in PHASE_COLORS.items()],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=9, ncol=3, frameon=False)


def _memory(ax, plan) -> None:
    mem = stage_memory(plan)
    base = [0.0] * len(mem)
    for part in MEMORY_PARTS + ("total",):
        vals = [m.get(part, 0.0) / GiB for m in mem]
        if any(vals):
            ax.bar(range(len(mem)), vals, bottom=base, color=MEMORY_COLORS[part], width=0.5,
                   label=part if part != "total" else "peak (split not recorded)")
        base = [a + b for a, b in zip(base, vals)]
    for i, top in enumerate(base):
        ax.text(i, top, f"{top:.2f}", ha="center", va="bottom", fontsize=8)
    limit = memory_limit(plan) / GiB
    on_scale = limit <= 4 * max(base + [1e-9])
    if on_scale:
        ax.axhline(limit, color="#c00", linestyle="--", label=f"limit {limit:.1f} GiB")
    ax.set_xticks(range(len(mem)), [f"stage {i}" for i in range(len(mem))] if len(mem) > 1 else ["every device"])
    ax.set_xlim(-0.75, len(mem) - 0.25 + 0.6)
    ax.set_ylabel("GiB per device")
    ax.set_title("memory per device" + ("" if on_scale else f" (limit {limit:.1f} GiB off scale)"), fontsize=11)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=2, frameon=False)


def _sharding(ax, plan, lines, left_out: int) -> None:
    from matplotlib.patches import Rectangle

    labels = axis_labels(plan)
    cell = min(0.16, 0.45 / len(labels))
    name_width = 1 - cell * len(labels)
    inches = ax.get_position().width * ax.figure.get_figwidth()
    chars = int((name_width - 0.03) * inches / CHAR)  # longer weight names keep their end
    ax.set_xlim(0, 1)
    ax.set_ylim(len(lines) + 1, 0)
    ax.axis("off")
    ax.text(0.005, 0.5, "weight", fontsize=MAP_FONT, weight="bold", va="center")
    for a, label in enumerate(labels):
        ax.text(name_width + (a + 0.5) * cell, 0.5, label, fontsize=MAP_FONT - 1, weight="bold",
                ha="center", va="center")
    for k, (kind, text, placements) in enumerate(lines, start=1):
        if kind == "group":
            ax.add_patch(Rectangle((0, k + 0.06), 1, 0.88, color="#e6e6e6", linewidth=0))
            ax.text(0.005, k + 0.5, text, fontsize=MAP_FONT, weight="bold", va="center")
            continue
        name = text if len(text) <= chars else "..." + text[3 - chars:]
        ax.text(0.025, k + 0.5, name, fontsize=MAP_FONT, family="monospace", va="center")
        for a, p in enumerate(placements):
            x = name_width + a * cell
            ax.add_patch(Rectangle((x + 0.004, k + 0.08), cell - 0.008, 0.84, color=placement_color(p), linewidth=0))
            ax.text(x + cell / 2, k + 0.5, p, fontsize=MAP_FONT, family="monospace", ha="center", va="center")
    more = f" ({left_out} more lines in the HTML rendering)" if left_out else ""
    ax.set_title(f"sharding map: placement per mesh axis{more}", fontsize=11, loc="left")


def to_png(plan, path) -> None:
    """Draw the plan into a PNG at ``path`` (see the module docstring)."""
    plt = _pyplot()
    lines, left_out = _map_lines(plan)
    width = PNG_WIDTH / DPI
    gantt_h = max(1.6, 0.45 * num_stages(plan) + 0.6)
    map_h = (len(lines) + 1) * ROW
    below = max(MIN_HEIGHT / DPI - gantt_h - 1.8, map_h + 0.2)
    height = gantt_h + below + 1.8  # inches: titles, the Gantt's axis and the gap between
    fig = plt.figure(figsize=(width, height), dpi=DPI)

    def box(left, top, w, h):  # inches from the top-left corner -> figure fractions
        return [left / width, 1 - (top + h) / height, w / width, h / height]

    try:
        _gantt(fig.add_axes(box(0.9, 0.55, width - 1.2, gantt_h)), plan)
        top = gantt_h + 1.35
        _memory(fig.add_axes(box(0.9, top, 3.3, min(below - 0.5, 5.2))), plan)
        _sharding(fig.add_axes(box(4.7, top, width - 4.9, map_h)), plan, lines, left_out)
        fig.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(fig)


__all__ = ["MAP_FONT", "MAX_MAP_ROWS", "MIN_HEIGHT", "PNG_WIDTH", "to_png"]
