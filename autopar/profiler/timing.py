"""Timing calls robustly on a shared machine.

Each measurement is the :data:`ROBUST_QUANTILE` (the lower quartile) of repeated samples: other
processes only ever slow a measurement down, and on a loaded machine more than half of the
repeats can be slowed, which moves the median; the lower quartile stays put.
"""

from __future__ import annotations

import time

import numpy as np
import torch

# Quantile of repeated timings reported as "the" time (see the module docstring).
ROBUST_QUANTILE = 0.25


def synchronize(device: str) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def robust_time(samples) -> float:
    """The :data:`ROBUST_QUANTILE` of timing samples."""
    return float(np.quantile(np.asarray(samples, dtype=float), ROBUST_QUANTILE))


def time_calls(fns, *, repeats: int = 7, min_sample: float = 2e-3, device: str = "cpu",
               sync=None) -> list[float]:
    """Seconds of one call of each of ``fns``: :func:`robust_time` of ``repeats`` samples, each
    at least ``min_sample`` long (short calls are looped). The calls are interleaved, one sample
    of each per round, so a burst of load from other processes hits them all alike. ``sync``
    (e.g. a barrier) is called before every sample: processes timing the same calls then run
    each sample together."""
    iters = []
    for fn in fns:
        fn()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        iters.append(max(1, int(min_sample / max(time.perf_counter() - start, 1e-7))))
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, n, out in zip(fns, iters, samples):
            synchronize(device)
            if sync is not None:
                sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            synchronize(device)
            out.append((time.perf_counter() - start) / n)
    return [robust_time(s) for s in samples]


def time_call(fn, *, repeats: int = 7, min_sample: float = 2e-3, device: str = "cpu", sync=None) -> float:
    """:func:`time_calls` of one callable."""
    return time_calls([fn], repeats=repeats, min_sample=min_sample, device=device, sync=sync)[0]


__all__ = ["ROBUST_QUANTILE", "robust_time", "synchronize", "time_call", "time_calls"]
