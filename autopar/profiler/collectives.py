"""Collective micro-benchmarks: every collective on every mesh axis over a sweep of sizes, on
``prod(mesh_shape)`` local ranks (gloo on CPU, NCCL on GPUs). Each size's time is the
:func:`~autopar.profiler.timing.robust_time` of the slowest rank's time per repeat.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.errors import ClusterError
from autopar.core.layout import axis_lines
from autopar.profiler.timing import robust_time, synchronize
from autopar.runtime.launch import LaunchError, run_on_ranks

KiB, MiB = 1024, 1024 * 1024
COLLECTIVE_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
QUICK_COLLECTIVE_SIZES = (16 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)


def _collective_call(kind, nbytes, group, members, rank, device):
    """A callable running collective ``kind`` of ``nbytes`` (nccl-tests size) over ``group``."""
    n = len(members)
    elems = max(n, int(nbytes) // 4 // n * n)
    if kind == "all_reduce":
        buf = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":  # *_single from torch 2.13, *_tensor before
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out, inp = torch.empty(elems, device=device), torch.ones(elems // n, device=device)
        return lambda: gather(out, inp, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        out, inp = torch.empty(elems // n, device=device), torch.ones(elems, device=device)
        return lambda: scatter(out, inp, group=group)
    if kind == "all_to_all":
        out, inp = torch.empty(elems, device=device), torch.ones(elems, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if kind == "broadcast":
        buf = torch.ones(elems, device=device)
        return lambda: dist.broadcast(buf, src=members[0], group=group)
    me = members.index(rank)
    send, recv = torch.ones(elems, device=device), torch.empty(elems, device=device)
    ops = [dist.P2POp(dist.isend, send, members[(me + 1) % n], group),
           dist.P2POp(dist.irecv, recv, members[(me - 1) % n], group)]
    return lambda: [w.wait() for w in dist.batch_isend_irecv(ops)]


def _collective_rank(mesh_shape, kinds, sizes, repeats, lines) -> list[dict] | None:
    """One rank's part of :func:`measure_collectives`; rank 0 returns the rows and puts a
    progress line per row on ``lines``."""
    rank = dist.get_rank()
    device = f"cuda:{rank}" if dist.get_backend() == "nccl" else "cpu"
    results = []
    for axis, n in enumerate(mesh_shape):
        mine = None
        for members in axis_lines(mesh_shape, axis):  # every rank creates every group
            group = dist.new_group(members)
            if rank in members:
                mine = (group, members)
        if n == 1:
            continue
        group, members = mine
        for kind in kinds:
            # Interleave the sizes, one of each per round, so that load from other processes
            # falls on all sizes alike instead of on whichever size ran during a burst.
            fns = [_collective_call(kind, nbytes, group, members, rank, device) for nbytes in sizes]
            for fn in fns:
                fn(), fn()
            times = [[] for _ in sizes]
            for _ in range(repeats):
                for i, fn in enumerate(fns):
                    dist.barrier(group=group)
                    synchronize(device)
                    start = time.perf_counter()
                    fn()
                    synchronize(device)
                    times[i].append(time.perf_counter() - start)
            slowest = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            if rank == 0:
                for nbytes, samples in zip(sizes, slowest.tolist()):
                    seconds = robust_time(samples)
                    results.append({"axis": axis, "kind": kind, "group_size": n, "nbytes": nbytes,
                                    "seconds": seconds, "median": statistics.median(samples),
                                    "samples": samples})
                    lines.put(f"  axis {axis} {kind} {nbytes / KiB:.0f} KiB: {seconds * 1e6:.0f} us")
    return results if rank == 0 else None


def measure_collectives(*, mesh_shape=(2,), kinds=COLLECTIVE_KINDS, sizes=COLLECTIVE_SIZES,
                        repeats: int = 40, backend: str = "gloo", threads: int = 1,
                        progress=print, timeout: float = 600) -> list[dict]:
    """Time ``kinds`` at ``sizes`` (nccl-tests size, bytes) on every mesh axis, on
    ``prod(mesh_shape)`` local processes; a list of ``{axis, kind, group_size, nbytes, seconds}``."""
    world_size = math.prod(mesh_shape)
    if world_size < 2:
        return []
    for kind in kinds:
        if kind not in COLLECTIVE_KINDS:
            raise ClusterError(f"unknown collective {kind!r}; use {COLLECTIVE_KINDS}")
    lines = mp.get_context("spawn").Queue()

    def show():
        while not lines.empty():
            progress(lines.get())

    args = (tuple(mesh_shape), tuple(kinds), tuple(sizes), repeats, lines)
    try:
        per_rank = run_on_ranks(_collective_rank, world_size=world_size, args=args, timeout=timeout,
                                backend=backend, threads=threads, meanwhile=show)
    except LaunchError as exc:
        raise ClusterError(f"collective profiling failed: {exc}") from None
    return per_rank[0]


__all__ = ["COLLECTIVE_SIZES", "QUICK_COLLECTIVE_SIZES", "measure_collectives"]
