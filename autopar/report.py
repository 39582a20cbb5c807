"""Text reports of a Plan: the summary table users print."""

from __future__ import annotations

import re
from collections import OrderedDict

GiB = 1024**3


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _layer_key(layer: str | None) -> tuple[str, int] | None:
    if not layer:
        return None
    m = re.match(r"^(.*)\.(\d+)$", layer)
    return (m.group(1), int(m.group(2))) if m else (layer, 0)


def _layer_rows(plan):
    """(label, weight placements, time, node count) per layer; identical layers merged."""
    per_layer: "OrderedDict[str, list]" = OrderedDict()
    for n in plan.nodes:
        per_layer.setdefault(n.layer or "(outside layers)", []).append(n)
    weights: dict[str, list] = {}
    for fqn, placements in plan.parameter_placements.items():
        for layer in per_layer:
            if fqn.startswith(layer + "."):
                short = fqn[len(layer) + 1:]
                weights.setdefault(layer, []).append(f"{short}={','.join(placements)}")
                break
    rows = []
    for layer, nodes in per_layer.items():
        signature = tuple(n.strategy for n in nodes)
        t = sum(n.compute_time + n.communication_time for n in nodes)
        rows.append([layer, signature, " ".join(weights.get(layer, [])[:4]), t, len(nodes)])
    merged = []
    for row in rows:
        key = _layer_key(row[0])
        if merged and key is not None:
            prev = merged[-1]
            pkey = _layer_key(prev["last"])
            if pkey and pkey[0] == key[0] and pkey[1] + 1 == key[1] and prev["sig"] == row[1]:
                prev["last"] = row[0]
                prev["count"] += 1
                continue
        merged.append({"first": row[0], "last": row[0], "sig": row[1], "w": row[2], "t": row[3], "n": row[4], "count": 1})
    out = []
    for m in merged:
        if m["count"] > 1:
            a, b = _layer_key(m["first"]), _layer_key(m["last"])
            label = f"{a[0]}.{a[1]}-{b[1]} (x{m['count']})"
        else:
            label = m["first"]
        out.append((label, m["w"], m["t"], m["n"], m["count"]))
    return out


def summarize(plan) -> str:
    """The plan as a table: per layer weights' placements and time, then totals."""
    lines = [
        f"plan {plan.name!r}: mesh {plan.mesh_shape} of {plan.cluster.get('device', '?')}",
        f"predicted step time {_fmt_time(plan.predicted_step_time)}"
        f"  (compute {_fmt_time(plan.time.compute)}, communication {_fmt_time(plan.time.communication)},"
        f" resharding {_fmt_time(plan.time.resharding)}, bubble {_fmt_time(plan.time.bubble)})",
        f"predicted peak memory {plan.predicted_peak_memory / GiB:.2f} GiB per device"
        f"  (parameters {plan.memory.parameters / GiB:.2f}, gradients {plan.memory.gradients / GiB:.2f},"
        f" optimizer {plan.memory.optimizer / GiB:.2f}, activations {plan.memory.activations / GiB:.2f})",
        f"MFU {plan.mfu * 100:.1f}%   solver: {plan.solver.method} {plan.solver.status},"
        f" {plan.solver.graph_nodes} graph nodes -> {plan.solver.solver_nodes} solver nodes,"
        f" {plan.solver.solve_time_s:.2f} s, gap {plan.solver.gap:.2%}",
        "",
        f"{'layer':40s} {'time/layer':>12s}  weights (placement per mesh axis)",
    ]
    for label, weights, t, _, _ in _layer_rows(plan):
        lines.append(f"{label[:40]:40s} {_fmt_time(t):>12s}  {weights}")
    by_kind: dict = {}
    for c in plan.collectives():
        key = (c.kind, c.phase)
        cnt, b, t = by_kind.get(key, (0, 0.0, 0.0))
        by_kind[key] = (cnt + 1, b + c.nbytes, t + c.time)
    if by_kind:
        lines += ["", f"{'collective':16s} {'phase':9s} {'count':>6s} {'bytes':>12s} {'time':>10s}"]
        for (kind, phase), (cnt, b, t) in sorted(by_kind.items()):
            lines.append(f"{kind:16s} {phase:9s} {cnt:6d} {b / 1e6:10.1f}MB {_fmt_time(t):>10s}")
    return "\n".join(lines)
