"""Capture LLaMA-2-70B on the meta device and report wall time, peak RSS and graph size.

Capture stamps the repeated layers by default (3 of the 80 decoder layers traced, the rest copied;
see autopar.passes.capture.stamp); ``--full`` traces all 80 layers instead (``stamp_layers=False``).
Targets: capture ≤ 60 s and peak RSS ≤ 4 GiB on a laptop-class CPU. Peak RSS is the process's
``ru_maxrss`` from ``resource.getrusage(RUSAGE_SELF)`` (Linux reports KiB), read in this same
process after each phase, so it includes Python, torch and transformers themselves. Model
construction (transformers on ``torch.device("meta")``) is timed separately from capture; capture
also reports its CPU time, which shared machines disturb less than wall time.

    python benchmarks/capture_70b.py [--seq 4096] [--batch 1] [--full]
"""

from __future__ import annotations

import argparse
import resource
import time


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--full", action="store_true",
                        help="trace every layer (stamp_layers=False) instead of stamping")
    opts = parser.parse_args(argv)

    t0 = time.perf_counter()
    import torch

    from autopar import zoo
    from autopar.passes.capture import capture, distinct_ops

    t_import = time.perf_counter() - t0
    rss_import = peak_rss_gib()

    t0 = time.perf_counter()
    model, (args, kwargs) = zoo.llama(config=zoo.llama2_70b_config(), seq=opts.seq,
                                      batch=opts.batch, dtype=torch.bfloat16, device="meta")
    t_build = time.perf_counter() - t0
    rss_build = peak_rss_gib()

    t0, c0 = time.perf_counter(), time.process_time()
    cap = capture(model, args, kwargs=kwargs, stamp_layers=not opts.full)
    t_capture, c_capture = time.perf_counter() - t0, time.process_time() - c0
    rss_capture = peak_rss_gib()

    nodes = len(cap.graph_module.graph.nodes)
    result = {
        "import_s": t_import, "build_s": t_build, "capture_s": t_capture, "capture_cpu_s": c_capture,
        "peak_rss_gib": rss_capture, "nodes": nodes, "parameters": cap.num_parameters,
        "layers": len(cap.layers), "distinct_ops": len(distinct_ops(cap)),
        "stamped": cap.stamped,
    }
    print(f"LLaMA-2-70B, batch {opts.batch} × seq {opts.seq}, bf16 on meta")
    print(f"  import torch+autopar : {t_import:6.1f} s   peak RSS {rss_import:.2f} GiB")
    print(f"  build model (meta)   : {t_build:6.1f} s   peak RSS {rss_build:.2f} GiB")
    print(f"  capture              : {t_capture:6.1f} s   peak RSS {rss_capture:.2f} GiB"
          f"   (CPU time {c_capture:.1f} s)")
    how = ("traced in full" if opts.full else
           f"stamped {', '.join(cap.stamped)}" if cap.stamped else "stamping fell back to full")
    print(f"  layers {how}")
    print(f"  graph: {nodes} nodes, {len(cap.layers)} layers, {result['distinct_ops']} distinct "
          f"ATen ops, {cap.num_parameters / 1e9:.2f} B parameters")
    print("  (peak RSS = resource.getrusage(RUSAGE_SELF).ru_maxrss of this process)")
    return result


if __name__ == "__main__":
    main()
