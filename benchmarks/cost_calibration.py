"""Cost models against references and measurements, side by side.

1. FLOPs of GPT-2 training graphs vs the Megatron-LM paper's formula (Eq. 3 without recompute).
2. Model-state memory of a 7.5B model on 64 devices under ZeRO 0-3 vs the ZeRO paper's Figure 1.
3. gloo collectives on 2 local ranks: alpha-beta fitted on some sizes, predicted vs measured on
   held-out sizes.
4. Forward time of the matmul / conv / softmax nodes of captured HF models on one CPU rank (or,
   with ``--device cuda``, one GPU in bf16): predicted by the roofline calibrated with the
   profiler's micro-benchmarks vs measured.

    python benchmarks/cost_calibration.py            # all four (a few minutes on 2 cores)
    python benchmarks/cost_calibration.py --quick    # 2-layer GPT configs, fewer repeats
    python benchmarks/cost_calibration.py --only nodes --device cuda --gpu H100-80GB
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.utils import _pytree as pytree

from autopar import zoo
from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.ir import TensorMeta, spec_of_node
from autopar.cost_models.calibration import fit_alpha_beta
from autopar.cost_models.compute import compute_time, graph_flops, op_class, spec_key
from autopar.cost_models.devices import cpu_spec, device_spec
from autopar.cost_models.memory import model_state_bytes
from autopar.passes.capture import capture
from autopar.profiler import calibrate_device, measure_collectives, measure_compute

KiB = 1024
GPT2_CONFIGS = [("GPT-2 small", 768, 12, 12), ("GPT-2 medium", 1024, 16, 24),
                ("GPT-2 large", 1280, 20, 36), ("GPT-2 XL", 1600, 25, 48)]


def flops_vs_megatron(quick: bool) -> None:
    print("\n== 1. Training FLOPs vs Megatron-LM Eq. 3 (no recompute): 72 B s l h^2 (1 + s/6h + V/12lh)")
    B, s, V = 1, 1024, 50257
    print(f"{'config':14s} {'layers':>6s} {'counted':>12s} {'formula':>12s} {'ratio':>7s} {'bwd/fwd':>7s} {'time':>6s}")
    for name, h, heads, layers in GPT2_CONFIGS:
        layers = 2 if quick else layers
        model, ((ids,), kwargs) = zoo.gpt2(layers=layers, hidden=h, heads=heads, vocab=V, seq=s,
                                           batch=B, device="meta")
        start = time.perf_counter()
        cap = capture(model, (ids,), kwargs=kwargs)
        fwd, bwd = graph_flops(cap.graph_module)
        formula = 72 * B * s * layers * h * h * (1 + s / (6 * h) + V / (12 * layers * h))
        print(f"{name:14s} {layers:6d} {(fwd + bwd) / 1e12:11.3f}T {formula / 1e12:11.3f}T"
              f" {(fwd + bwd) / formula:7.4f} {bwd / fwd:7.3f} {time.perf_counter() - start:5.1f}s")


def zero_memory() -> None:
    print("\n== 2. Model states of a 7.5B model, mixed-precision Adam, 64 devices (ZeRO Fig. 1)")
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage in range(4):
        got = model_state_bytes(7.5e9, precision="mixed", zero_stage=stage, dp_degree=64).total / 1e9
        print(f"  stage {stage}: {got:8.3f} GB   paper {paper[stage]:6.1f} GB   diff {got / paper[stage] - 1:+.2%}")


def collectives(repeats: int) -> None:
    print("\n== 3. gloo collectives, 2 ranks on 127.0.0.1 (lower quartile of interleaved repeats)")
    fit_sizes, held = (16 * KiB, 64 * KiB, 512 * KiB, 2048 * KiB), (256 * KiB, 1024 * KiB)
    rows = measure_collectives(mesh_shape=(2,), kinds=COLLECTIVE_KINDS, sizes=fit_sizes + held,
                               repeats=repeats, progress=lambda line: None)
    print(f"{'kind':15s} {'alpha':>8s} {'algbw':>9s}   held-out size: predicted / measured (error)")
    for kind in COLLECTIVE_KINDS:
        m = {r["nbytes"]: r["seconds"] for r in rows if r["kind"] == kind}
        alpha, beta = fit_alpha_beta(fit_sizes, [m[x] for x in fit_sizes])
        cells = [f"{x // KiB}K: {(alpha + beta * x) * 1e6:.0f}/{m[x] * 1e6:.0f} us"
                 f" ({(alpha + beta * x) / m[x] - 1:+.0%})" for x in held]
        print(f"{kind:15s} {alpha * 1e6:6.0f}us {1 / beta / 1e9:6.2f}GB/s   " + "   ".join(cells))


def _materialise(spec, device, dtype):
    def real(x):
        if isinstance(x, TensorMeta):
            if x.dtype.is_floating_point:
                return torch.randn(x.shape, dtype=dtype or x.dtype, device=device)
            return torch.zeros(x.shape, dtype=x.dtype, device=device)
        return x

    return pytree.tree_map(real, (spec.args, spec.kwargs))


def _eager(build, **kw):
    model, example = build(device="meta", **kw)
    model.config._attn_implementation = "eager"   # softmax nodes instead of fused SDPA
    return model, example


CPU_MODELS = [
    ("gpt2", lambda: _eager(zoo.gpt2, layers=2, hidden=256, heads=4, vocab=2048, seq=128, batch=4)),
    ("bert", lambda: _eager(zoo.bert, layers=2, hidden=256, heads=4, ffn=1024, vocab=2048, seq=128, batch=4)),
    ("vit", lambda: _eager(zoo.vit, layers=2, hidden=192, heads=3, ffn=768, image=64, patch=8, batch=8)),
    ("resnet", lambda: zoo.resnet(widths=(32, 64, 128), depths=(1, 1, 1), image=64, batch=4, device="meta")),
]
GPU_MODELS = [
    ("gpt2", lambda: _eager(zoo.gpt2, layers=2, hidden=1024, heads=16, vocab=16384, seq=1024, batch=8)),
    ("bert", lambda: _eager(zoo.bert, layers=2, hidden=1024, heads=16, ffn=4096, vocab=16384, seq=512, batch=16)),
    ("vit", lambda: _eager(zoo.vit, layers=2, hidden=768, heads=12, ffn=3072, image=224, patch=16, batch=64)),
    ("resnet", lambda: zoo.resnet(widths=(64, 128, 256, 512), depths=(1, 1, 1, 1), image=224, batch=64,
                                  device="meta")),
]
CLASSES = ("matmul", "conv", "softmax")


def _distinct_nodes(models) -> list:
    """(model name, spec) of the distinct matmul / conv / softmax nodes of ``models``."""
    seen, out = set(), []
    for name, build in models:
        model, (args, kwargs) = build()
        cap = capture(model, args, kwargs=kwargs)
        for node in cap.graph_module.graph.nodes:
            if node.op == "call_function" and op_class(node.target) in CLASSES:
                spec = spec_of_node(node)
                if spec_key(spec) not in seen:
                    seen.add(spec_key(spec))
                    out.append((name, spec))
    return out


def node_times(threads: int, quick: bool, device: str = "cpu", gpu: str = "H100-80GB") -> None:
    on_gpu = device == "cuda"
    dtype = torch.bfloat16 if on_gpu else None
    where = f"one {torch.cuda.get_device_name(0)} in bf16" if on_gpu else f"one CPU rank ({threads} thread(s))"
    print(f"\n== 4. Node forward times on {where}: calibrated roofline vs measured"
          "\n   (nodes timed in the same interleaved rounds as the calibration micro-benchmarks)")
    nodes = _distinct_nodes(GPU_MODELS if on_gpu else CPU_MODELS)
    inputs = [_materialise(spec, device, dtype) for _, spec in nodes]
    fns = [lambda op=spec.op, a=a, k=k: op(*a, **k) for (_, spec), (a, k) in zip(nodes, inputs)]
    start = time.perf_counter()
    measured = measure_compute(device=device, threads=threads, quick=quick, repeats=5 if quick else 9,
                               dtype=dtype or torch.float32, progress=lambda line: None, extra=fns)
    del inputs, fns
    base = device_spec(gpu) if on_gpu else cpu_spec(threads=threads, memory_bytes=2**30)
    spec_dev = calibrate_device(base, measured)
    peak = spec_dev.peak("bf16" if on_gpu else "fp32")
    print(f"calibration + nodes ({time.perf_counter() - start:.0f} s): peak {peak / 1e12:.3g} TFLOP/s,"
          f" half-dim {spec_dev.matmul_half_dim:.0f}, memory {spec_dev.memory_bandwidth / 1e9:.4g} GB/s,"
          f" overhead {spec_dev.op_overhead * 1e6:.1f} us; efficiency "
          + ", ".join(f"{k} {v:.2f}" for k, v in spec_dev.efficiency if k in CLASSES + ("copy",)))
    if spec_dev.class_overhead:
        print("set-up per kernel: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in spec_dev.class_overhead))
    errors: dict = {c: [] for c in CLASSES}
    print(f"{'model':7s} {'op':28s} {'shapes':42s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for (name, spec), t in zip(nodes, measured["extra"]):
        p = compute_time(spec, None, (1,), spec_dev, dtype=dtype)[0]
        errors[op_class(spec.op)].append(abs(p / t - 1))
        shapes = " ".join("x".join(map(str, m.shape)) for m in spec.inputs)
        print(f"{name:7s} {str(spec.op):28s} {shapes[:42]:42s} {t * 1e3:8.3f}ms {p * 1e3:8.3f}ms {p / t - 1:+7.0%}")
    every = [e for c in CLASSES for e in errors[c]]
    for c in CLASSES:
        if errors[c]:
            print(f"median |error| {c:8s}: {statistics.median(errors[c]):.0%} over {len(errors[c])} distinct nodes")
    print(f"median |error| all     : {statistics.median(every):.0%} over {len(every)} distinct nodes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="threads of the CPU rank (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to time nodes")
    parser.add_argument("--gpu", default="H100-80GB", help="device spec to calibrate with --device cuda")
    parser.add_argument("--only", choices=["flops", "zero", "collectives", "nodes"], action="append")
    args = parser.parse_args()
    only = set(args.only or ["flops", "zero", "collectives", "nodes"])
    warnings.filterwarnings("ignore")
    if "flops" in only:
        flops_vs_megatron(args.quick)
    if "zero" in only:
        zero_memory()
    if "collectives" in only:
        collectives(25 if args.quick else 60)
    if "nodes" in only:
        node_times(args.threads, args.quick, args.device, args.gpu)


if __name__ == "__main__":
    main()
