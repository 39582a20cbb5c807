"""Fits of measurements to the cost models' constants: a calibrated
:class:`~autopar.cost_models.devices.DeviceSpec` from compute measurements, and alpha-beta per
collective from collective measurements (the fitting primitives are in
:mod:`autopar.cost_models.calibration`).

On a CPU the analytic peak FLOP/s and bandwidth are placeholders, so they are replaced by the
measured matmul rate and copy bandwidth; on a GPU the datasheet numbers stay and the
efficiencies are fitted.
"""

from __future__ import annotations

import numpy as np

from autopar.core.errors import ClusterError
from autopar.cost_models.calibration import fit_alpha_beta, fit_nonnegative
from autopar.cost_models.communication import CollectiveFit
from autopar.cost_models.devices import DeviceSpec

HALF_DIM_GRID = (0, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def _fit_matmul(rows, seconds) -> tuple[float, float]:
    """``(rate, half_dim)`` with ``seconds ~ flops / rate * (1 + half_dim / min_dim)``: the best
    rate for each half-dim on :data:`HALF_DIM_GRID`, refined between the grid neighbours of the
    best (a free fit can explain everything by the size term and leave no rate)."""

    def fit(h):
        feature = np.array([[r["flops"] * (1 + h / r["min_dim"])] for r in rows])
        (c,) = fit_nonnegative(feature, seconds)
        return float(np.sum((feature[:, 0] * c / seconds - 1) ** 2)), c, float(h)

    grid = [fit(h) for h in HALF_DIM_GRID]
    i = min(range(len(grid)), key=lambda j: grid[j][0])
    lo, hi = HALF_DIM_GRID[max(i - 1, 0)], HALF_DIM_GRID[min(i + 1, len(grid) - 1)]
    err, c, h = min([grid[i]] + [fit(x) for x in np.linspace(lo, hi, 65)], key=lambda t: t[0])
    if c <= 0:
        raise ClusterError("matmul times did not grow with FLOPs; profile again on a quieter machine")
    return 1.0 / c, h


def calibrate_device(base: DeviceSpec, measured: dict) -> DeviceSpec:
    """``base`` with efficiencies (and, on a CPU, peak and bandwidth) fitted to ``measured``."""
    o = measured["overhead"]
    rows = {}
    for row in measured["cases"]:
        rows.setdefault(row["class"], []).append(row)
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[measured["dtype"]]

    def excess(rs):
        return np.maximum(np.array([r["seconds"] for r in rs]) - o, 1e-9)

    mm = rows["matmul"]
    rate, half_dim = _fit_matmul(mm, excess(mm))
    peak = rate if base.kind == "cpu" else base.peak(dtype)
    eff = {"matmul": rate / peak}
    fixed = {}
    for cls in ("conv", "attention"):
        rs = rows.get(cls, [])
        if rs:  # a rate, plus a fixed set-up per kernel when 4+ cases pin it (CPU convolutions)
            features = [[r["flops"] * (1 + half_dim / r["min_dim"])] + ([1.0] if len(rs) > 3 else [])
                        for r in rs]
            c, *setup = fit_nonnegative(features, excess(rs))
            if c <= 0:
                raise ClusterError(f"{cls} times did not grow with FLOPs; profile again on a quieter machine")
            eff[cls] = 1.0 / (c * peak)
            fixed.update({cls: setup[0]} if setup and setup[0] > 0 else {})
    (c,) = fit_nonnegative([[r["bytes"]] for r in rows["copy"]], excess(rows["copy"]))
    copy_bw = 1.0 / c
    bandwidth = copy_bw if base.kind == "cpu" else base.memory_bandwidth
    eff["copy"] = copy_bw / bandwidth
    for cls in ("elementwise", "softmax", "normalization", "reduction"):
        rs = rows.get(cls, [])
        if rs:
            (c,) = fit_nonnegative([[r["bytes"]] for r in rs], excess(rs))
            eff[cls] = 1.0 / (c * bandwidth)
    efficiency = dict(base.efficiency)
    efficiency.update({k: min(v, 1.5) for k, v in eff.items()})
    peaks = dict(base.peak_flops)
    if base.kind == "cpu":
        peaks[dtype] = peak
    return base.replace(
        name=f"{base.name} (profiled)", peak_flops=tuple(peaks.items()), memory_bandwidth=bandwidth,
        efficiency=tuple(efficiency.items()), matmul_half_dim=half_dim, op_overhead=o,
        class_overhead=tuple(fixed.items()),
        source=f"measured by autopar.profiler on {measured['device']}",
    )


def fit_collectives(results: list[dict], level_of_axis) -> list[CollectiveFit]:
    """One alpha-beta fit per (axis, kind) over the measured sizes."""
    fits, grouped = [], {}
    for row in results:
        grouped.setdefault((row["axis"], row["kind"], row["group_size"]), []).append(row)
    for (axis, kind, n), rows in sorted(grouped.items()):
        level = level_of_axis(axis)
        if level is None or len(rows) < 2:
            continue
        alpha, beta = fit_alpha_beta([r["nbytes"] for r in rows], [r["seconds"] for r in rows])
        fits.append(CollectiveFit(kind, n, level, alpha, beta))
    return fits


__all__ = ["calibrate_device", "fit_collectives"]
