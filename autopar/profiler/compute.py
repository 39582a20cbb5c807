"""Compute micro-benchmarks: matmuls, convolutions and attention over a sweep of shapes,
streaming ops (copy, add, softmax, layer norm, sum) over sizes, and the fixed cost of one op;
on one rank, or on every CPU rank at once with samples started together, as a step runs them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from autopar.core.errors import ClusterError
from autopar.core.ir import spec_of_call
from autopar.cost_models import compute
from autopar.profiler.timing import time_call, time_calls
from autopar.runtime.launch import LaunchError, run_on_ranks

aten = torch.ops.aten


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


def _line(done: int, total: int, cls: str, timed) -> str:
    """A progress line: how many cases are done and the seconds of one class's ``(label, s)``."""
    return f"  compute {done}/{total}: {cls}: " + ", ".join(f"{label} {t * 1e3:.3g} ms" for label, t in timed)


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
                progress(_line(len(rows), sum(len(v) for v in cases.values()), cls,
                               [(label, t) for (label, *_), t in zip(items, times)]))
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


def _compute_rank(kwargs) -> dict:
    """One rank's :func:`measure_compute`; every sample starts on all ranks together (a barrier
    before each), so each rank computes while the others do."""
    return measure_compute(**kwargs, progress=lambda *_: None, sync=dist.barrier)


def measure_compute_concurrently(*, ranks: int, timeout: float = 900, progress=print, **kwargs) -> dict:
    """:func:`measure_compute` on ``ranks`` CPU processes at once, merged by :func:`merge_compute`.

    CPU ranks of one machine share its cores' execution units (SMT siblings, or a VM's vCPUs
    on them), caches and memory bandwidth: during a training step every rank computes at the
    same time, and a rank measured alone can be much faster than it will be then (here: big
    single-thread matmuls on 2 vCPUs ran 2-3x slower with both ranks busy).
    """
    if ranks <= 1:
        return measure_compute(progress=progress, **kwargs)
    try:
        per_rank = run_on_ranks(_compute_rank, world_size=ranks, args=(kwargs,), timeout=timeout)
    except LaunchError as exc:
        raise ClusterError(f"compute profiling on {ranks} concurrent ranks failed: {exc}") from None
    merged = merge_compute(per_rank)
    classes: dict = {}
    for row in merged["cases"]:
        classes.setdefault(row["class"], []).append(row)
    done = 0
    for cls, rows in classes.items():
        done += len(rows)
        progress(_line(done, len(merged["cases"]), cls, [(r["label"], r["seconds"]) for r in rows]))
    return merged


__all__ = ["measure_compute", "measure_compute_concurrently", "merge_compute"]
