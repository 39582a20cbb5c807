"""Interleaved step timing on torch.distributed ranks, for benchmarks on a noisy shared machine.

Runners are timed in rounds, one step of each per round, in an order that rotates from round to
round, each step started together on every rank (a barrier) and counted as the slowest rank's
time. A burst of load from other processes then hits every runner alike, and comparing the
runners round by round (the paired ratio) cancels slow drifts of the machine's load::

    times = interleaved({"autopar": step_a, "ddp": step_b}, warmup=3, rounds=20)   # on each rank
    print(summary(times["autopar"]), ratios(times["autopar"], times["ddp"]))
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def interleaved(runners: dict, *, warmup: int, rounds: int) -> dict[str, list[float]]:
    """``{name: [seconds of round r, ...]}``: the slowest rank's time of one call of each runner
    per round (collective: call on every rank with the same names)."""
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    local = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            local[name].append(time.perf_counter() - start)
    table = torch.tensor([local[name] for name in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {name: table[i].tolist() for i, name in enumerate(names)}


def lower_quartile(xs) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def summary(xs) -> tuple[float, float]:
    """``(median, lower quartile)`` in seconds."""
    return statistics.median(xs), lower_quartile(xs)


def ratios(a, b) -> tuple[float, float, float]:
    """``a`` against ``b``: ratio of medians, of lower quartiles, and the median of the per-round
    ratios (paired)."""
    return (statistics.median(a) / statistics.median(b), lower_quartile(a) / lower_quartile(b),
            statistics.median(x / y for x, y in zip(a, b)))


__all__ = ["interleaved", "lower_quartile", "ratios", "summary"]
