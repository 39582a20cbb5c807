"""The profiler: measure the devices at hand and calibrate the cost models with the results.

It times matmuls, convolutions and attention over a sweep of shapes, streaming ops (copy,
add, softmax, layer norm, sum) over sizes, and the fixed cost of one op (on a GPU on one rank;
CPU ranks on every rank at once, samples started together, as a step runs them); then, on
``world_size`` processes through ``torch.distributed`` (gloo on CPU, NCCL on GPUs), every
collective on every mesh axis over a sweep of sizes. Each measurement is the median of repeats
(the slowest rank's time per repeat, for collectives) summarised by their lower quartile:
other processes only ever slow a measurement down, and on a loaded machine more than half of
the repeats can be slowed, which moves the median; the lower quartile stays put. Fits (:mod:`autopar.cost_models.calibration`)
give a calibrated :class:`~autopar.cost_models.devices.DeviceSpec` and alpha/beta per collective;
both are stored in the profile database, which ``Cluster.local`` reads::

    cluster = profile(autopar.Cluster.local(world_size=2))   # or: autopar profile --world-size 2

On a CPU the analytic peak FLOP/s and bandwidth are placeholders, so they are replaced by the
measured matmul rate and copy bandwidth; on a GPU the datasheet numbers stay and the profiler
fits the efficiencies.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.errors import ClusterError
from autopar.core.ir import spec_of_call
from autopar.core.layout import axis_lines
from autopar.cost_models import compute
from autopar.cost_models.calibration import (
    Calibration,
    entry_key,
    fit_alpha_beta,
    fit_nonnegative,
    gpu_device_key,
    local_device_key,
    write_entry,
)
from autopar.cost_models.cluster import Cluster
from autopar.cost_models.communication import CollectiveFit
from autopar.cost_models.devices import DeviceSpec, device_spec

aten = torch.ops.aten
KiB, MiB = 1024, 1024 * 1024
# Quantile of repeated timings reported as "the" time (see the module docstring).
ROBUST_QUANTILE = 0.25
COLLECTIVE_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
QUICK_COLLECTIVE_SIZES = (16 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)


def _sync(device: str) -> None:
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
    (e.g. a barrier's ``wait``) is called before every sample: processes timing the same calls
    then run each sample together."""
    iters = []
    for fn in fns:
        fn()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        iters.append(max(1, int(min_sample / max(time.perf_counter() - start, 1e-7))))
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, n, out in zip(fns, iters, samples):
            _sync(device)
            if sync is not None:
                sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(device)
            out.append((time.perf_counter() - start) / n)
    return [robust_time(s) for s in samples]


def time_call(fn, *, repeats: int = 7, min_sample: float = 2e-3, device: str = "cpu", sync=None) -> float:
    """:func:`time_calls` of one callable."""
    return time_calls([fn], repeats=repeats, min_sample=min_sample, device=device, sync=sync)[0]


# --- compute sweeps ------------------------------------------------------------------------------

def _cases(device: str, dtype, quick: bool):
    """``{class: [(label, op, args, kwargs), ...]}`` of micro-benchmarks on ``device``; GPU sizes
    are large enough that the GPU, not the Python launch path, sets the time."""
    gpu = device.startswith("cuda")

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    if gpu:
        mm = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
              (16384, 8192, 128), (16384, 128, 8192), (8192, 16384, 256), (8192, 8192, 1024)]
        conv = [(128, 16, 64, 16, 3), (128, 64, 64, 64, 3), (64, 128, 32, 128, 3),
                (64, 256, 16, 512, 1), (64, 3, 224, 64, 7)]
        attn = [(8, 16, 1024, 64), (4, 16, 2048, 128), (2, 32, 4096, 64)]
        numels = (2**25, 2**27, 2**28)
    else:
        mm = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (2048, 512, 32),
              (4096, 32, 512), (512, 2048, 64), (1024, 1024, 128)]
        if not quick:
            mm += [(1024, 1024, 1024), (256, 4096, 256)]
        conv = [(8, 16, 32, 16, 3), (8, 32, 32, 64, 3), (4, 64, 16, 128, 3), (4, 128, 8, 256, 1),
                (8, 3, 64, 32, 7), (2, 16, 8, 32, 1), (2, 32, 4, 32, 3)]  # the last two: set-up bound
        attn = [(2, 4, 128, 32), (2, 8, 256, 64), (1, 12, 512, 64)]
        numels = (2**16, 2**18, 2**20, 2**22) if not quick else (2**17, 2**20, 2**22)
    out = {
        "matmul": [(f"mm {m}x{k}x{n}", aten.mm.default, (r(m, k), r(k, n)), {}) for m, k, n in mm],
        "conv": [(f"conv2d n{b} c{ci}->{co} {hw}x{hw} k{k}", aten.conv2d.default,
                  (r(b, ci, hw, hw), r(co, ci, k, k), None, [1, 1], [k // 2, k // 2]), {})
                 for b, ci, hw, co, k in conv],
        "attention": [(f"sdpa {b}x{h}x{L}x{e}", aten.scaled_dot_product_attention.default,
                       (r(b, h, L, e), r(b, h, L, e), r(b, h, L, e)), {"is_causal": True})
                      for b, h, L, e in attn],
        "copy": [(f"clone {n}", aten.clone.default, (r(n),), {}) for n in numels],
        "elementwise": [(f"add {n}", aten.add.Tensor, (r(n), r(n)), {}) for n in numels],
        "softmax": [(f"softmax {n // 512}x512", aten._softmax.default, (r(n // 512, 512), -1, False), {})
                    for n in numels],
        "normalization": [(f"layer_norm {n // 1024}x1024", aten.layer_norm.default, (r(n // 1024, 1024), [1024]), {})
                          for n in numels],
        "reduction": [(f"sum {n // 256}x256", aten.sum.dim_IntList, (r(n // 256, 256), [-1]), {})
                      for n in numels],
    }
    return out


def measure_compute(*, device: str = "cpu", threads: int = 1, dtype=torch.float32, quick: bool = False,
                    repeats: int = 7, progress=print, extra=(), sync=None) -> dict:
    """Time the micro-benchmarks; ``{"overhead": s, "cases": [{class, label, flops, bytes, min_dim,
    seconds}, ...]}``. Runs with ``threads`` intra-op threads (restored afterwards). ``extra``:
    more callables timed in the same interleaved rounds as each class, so that load from other
    processes hits them alike; their seconds (the mean over the rounds of classes) come back
    under ``"extra"``. ``sync``: see :func:`time_calls`."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    extra = list(extra)
    extra_times = []
    try:
        with torch.no_grad():
            tiny = torch.ones(1, device=device)
            overhead = time_call(lambda: torch.add(tiny, tiny), repeats=repeats, device=device, sync=sync)
            cases = _cases(device, dtype, quick)
            rows = []
            for cls, items in cases.items():
                fns = [lambda op=op, a=args, k=kwargs: op(*a, **k) for _, op, args, kwargs in items]
                times = time_calls(fns + extra, repeats=repeats, device=device, sync=sync)
                times, others = times[:len(fns)], times[len(fns):]
                extra_times.append(others)
                for (label, op, args, kwargs), seconds in zip(items, times):
                    spec = spec_of_call(op, args, kwargs, op(*args, **kwargs))
                    dims = compute.gemm_dims(spec)
                    rows.append({"class": cls, "label": label, "flops": compute.node_flops(spec)[0],
                                 "bytes": compute.node_bytes(spec)[0],
                                 "min_dim": min(dims[1:]) if dims else None, "seconds": seconds})
                progress(f"  compute {len(rows)}/{sum(len(v) for v in cases.values())}: {cls}: "
                         + ", ".join(f"{label} {t * 1e3:.3g} ms" for (label, *_), t in zip(items, times)))
    finally:
        torch.set_num_threads(old)
    out = {"overhead": overhead, "cases": rows, "device": device, "threads": threads, "dtype": str(dtype)}
    if extra:
        out["extra"] = [float(np.mean(col)) for col in zip(*extra_times)]
    return out


def merge_compute(per_rank: list[dict]) -> dict:
    """One :func:`measure_compute` result from several ranks' (same cases, same order): per
    case, and for the per-op overhead, the slowest rank's seconds (it sets a step's pace)."""
    if not per_rank:
        raise ClusterError("no compute measurements to merge")
    first = per_rank[0]
    for other in per_rank[1:]:
        if [r["label"] for r in other["cases"]] != [r["label"] for r in first["cases"]]:
            raise ClusterError("ranks measured different compute cases; profile again")
    cases = [dict(row, seconds=max(m["cases"][i]["seconds"] for m in per_rank))
             for i, row in enumerate(first["cases"])]
    return dict(first, overhead=max(m["overhead"] for m in per_rank), cases=cases, ranks=len(per_rank))


def _compute_worker(rank, barrier, kwargs, out_dir):
    # every sample starts on all ranks together: each rank computes while the others do
    measured = measure_compute(**kwargs, progress=lambda *_: None, sync=barrier.wait)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(measured))


def measure_compute_concurrently(*, ranks: int, timeout: float = 900, progress=print, **kwargs) -> dict:
    """:func:`measure_compute` on ``ranks`` CPU processes at once, merged by :func:`merge_compute`.

    CPU ranks of one machine share its cores' execution units (SMT siblings, or a VM's vCPUs
    on them), caches and memory bandwidth: during a training step every rank computes at the
    same time, and a rank measured alone can be much faster than it will be then (here: big
    single-thread matmuls on 2 vCPUs ran 2-3x slower with both ranks busy).
    """
    if ranks <= 1:
        return measure_compute(progress=progress, **kwargs)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        barrier = ctx.Barrier(ranks)
        procs = [ctx.Process(target=_compute_worker, args=(r, barrier, kwargs, tmp)) for r in range(ranks)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        if any(proc.exitcode != 0 for proc in procs):
            for proc in procs:
                proc.kill()
            raise ClusterError(f"compute profiling on {ranks} concurrent ranks failed or took over {timeout:.0f} s")
        merged = merge_compute([json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)])
    classes: dict = {}
    for row in merged["cases"]:
        classes.setdefault(row["class"], []).append(row)
    done = 0
    for cls, rows in classes.items():
        done += len(rows)
        progress(f"  compute {done}/{len(merged['cases'])}: {cls}: "
                 + ", ".join(f"{r['label']} {r['seconds'] * 1e3:.3g} ms" for r in rows))
    return merged


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


# --- collectives ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_collective(kind, nbytes, group, members, rank, device):
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


def _collective_worker(rank, world_size, port, mesh_shape, kinds, sizes, repeats, backend, threads,
                       out_path, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    results = []
    try:
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
                fns = [_run_collective(kind, nbytes, group, members, rank, device) for nbytes in sizes]
                for fn in fns:
                    fn(), fn()
                times = [[] for _ in sizes]
                for _ in range(repeats):
                    for i, fn in enumerate(fns):
                        dist.barrier(group=group)
                        _sync(device)
                        start = time.perf_counter()
                        fn()
                        _sync(device)
                        times[i].append(time.perf_counter() - start)
                slowest = torch.tensor(times, dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                if rank == 0:
                    for nbytes, samples in zip(sizes, slowest.tolist()):
                        seconds = robust_time(samples)
                        results.append({"axis": axis, "kind": kind, "group_size": n, "nbytes": nbytes,
                                        "seconds": seconds, "median": statistics.median(samples),
                                        "samples": samples})
                        queue.put(f"  axis {axis} {kind} {nbytes / KiB:.0f} KiB: {seconds * 1e6:.0f} us")
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "collectives.json")
        args = (world_size, free_port(), tuple(mesh_shape), tuple(kinds), tuple(sizes), repeats,
                backend, threads, out_path, queue)
        procs = mp.start_processes(_collective_worker, args=args, nprocs=world_size, join=False,
                                   start_method="spawn")
        deadline = time.monotonic() + timeout
        while not procs.join(timeout=0.2):
            while not queue.empty():
                progress(queue.get())
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                raise ClusterError(f"collective profiling did not finish in {timeout:.0f} s")
        while not queue.empty():
            progress(queue.get())
        return json.loads(Path(out_path).read_text())


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


# --- the whole profile -------------------------------------------------------------------------

def profile(cluster, *, cache_dir=None, quick: bool = False, progress=print) -> Cluster:
    """Measure this machine for ``cluster`` (matmul, memory, collectives per mesh axis), store the
    results in the profile database and return ``cluster`` calibrated with them."""
    return cluster.with_calibration(profile_cluster(cluster, cache_dir=cache_dir, quick=quick, progress=progress))


def profile_cluster(cluster, *, cache_dir=None, quick: bool = False, progress=print,
                    kinds=COLLECTIVE_KINDS) -> Calibration:
    """Profile the devices ``cluster`` describes on this machine; store and return the result."""
    spec = cluster.device if isinstance(cluster.device, DeviceSpec) else device_spec(cluster.device)
    if spec.kind == "cpu":
        device, backend, key = "cpu", "gloo", local_device_key(spec.threads)
        dtype = torch.float32
    else:
        if not torch.cuda.is_available():
            raise ClusterError(f"cannot profile {spec.name} here: no CUDA device. Profile on the"
                               " GPU machine, or use Cluster.local(...) for this CPU")
        device, backend, key, dtype = "cuda", "nccl", gpu_device_key(spec.name), torch.bfloat16
    world = cluster.num_devices
    where = torch.cuda.get_device_name(0) if device == "cuda" else key
    progress(f"autopar profile: {spec.name} x {world} on mesh {cluster.mesh_shape} ({where}, {backend})")
    progress("compute (one rank):" if device != "cpu" or world == 1 else
             f"compute ({world} ranks at once, the slowest rank per case):")
    # CPU ranks share the machine: measure them all at once, as a training step runs them
    measured = measure_compute_concurrently(
        ranks=world if device == "cpu" else 1, device=device, threads=spec.threads, dtype=dtype,
        quick=quick, repeats=5 if quick else 9, progress=progress)
    calibrated = calibrate_device(spec, measured)
    results = []
    if world > 1 and (backend == "gloo" or torch.cuda.device_count() >= world):
        progress(f"collectives ({backend}, {world} ranks):")
        results = measure_collectives(
            mesh_shape=cluster.mesh_shape, kinds=kinds,
            sizes=QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES, repeats=25 if quick else 40,
            backend=backend, threads=spec.threads, progress=progress)
    elif world > 1:
        progress(f"collectives skipped: {world} ranks need {world} local GPUs")

    def level(axis):
        local, nodes = cluster.axis_span(axis)
        return "intra" if nodes == 1 else ("inter" if local == 1 else None)

    calibration = Calibration(key=entry_key(key, world), device=calibrated,
                              collectives=tuple(fit_collectives(results, level)))
    entry = {"calibration": calibration.to_dict(), "compute": measured, "collectives": results,
             "mesh_shape": list(cluster.mesh_shape), "created": datetime.datetime.now().isoformat(),
             "torch": torch.__version__}
    path = write_entry(calibration.key, entry, cache_dir)
    progress(f"saved {calibration.key} to {path}")
    return calibration


def add_profile_arguments(parser) -> None:
    """Options of ``autopar profile``."""
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks to profile (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="threads per CPU rank (default: cores / ranks)")
    parser.add_argument("--preset", default=None, help="profile a GPU preset's device on this machine's GPUs instead")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the preset (default 1)")
    parser.add_argument("--cache-dir", default=None, help="profile database directory (default ~/.cache/autopar)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")


def run_profile_command(args) -> int:
    """``autopar profile``: measure, store, print the calibrated cluster."""
    if args.preset:
        cluster = Cluster.preset(args.preset, nodes=args.nodes, use_profile=False)
    else:
        cluster = Cluster.local(world_size=args.world_size, threads_per_rank=args.threads, use_profile=False)
    calibrated = profile(cluster, cache_dir=args.cache_dir, quick=args.quick)
    spec = calibrated.device_spec
    print(calibrated.describe())
    print(f"  {spec.name}: peak {spec.peak('bf16' if spec.kind == 'gpu' else 'fp32') / 1e9:.4g} GFLOP/s,"
          f" memory {spec.memory_bandwidth / 1e9:.3g} GB/s, overhead {spec.op_overhead * 1e6:.3g} us,"
          f" matmul half-dim {spec.matmul_half_dim:.3g}")
    print("  efficiency: " + ", ".join(f"{k} {v:.2f}" for k, v in spec.efficiency))
    if spec.class_overhead:
        print("  set-up per kernel: " + ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in spec.class_overhead))
    for fit in calibrated.calibration.collectives:
        print(f"  {fit.kind} over {fit.group_size} ({fit.level}): alpha {fit.alpha * 1e6:.0f} us,"
              f" {1 / fit.beta / 1e9:.3g} GB/s algbw")
    return 0


__all__ = [
    "add_profile_arguments",
    "calibrate_device",
    "fit_collectives",
    "measure_collectives",
    "measure_compute",
    "measure_compute_concurrently",
    "merge_compute",
    "profile_cluster",
    "robust_time",
    "run_profile_command",
    "time_call",
    "time_calls",
]
