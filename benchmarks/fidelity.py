"""The plan is what runs: predicted vs measured peak memory, collective bytes and FLOPs of full-size
(model, cluster, plan) triples, each plan's programs run by ``verify`` for one training step on fake
tensors under a fake process group (models on the meta device: no real memory).

Per row: predicted / measured peak memory of the worst verified rank and its ratio, collective
bytes per step summed over the verified ranks (one per distinct program: a pipelined plan's one
per stage; predicted records / issued) and whether each rank's records equal what it issued (kind,
axis, bytes, count, phase), FLOPs per device (predicted / executed by FlopCounterMode) and their
ratio, the predicted MFU (at most 100 %: Plan validates it), the seconds verify took and the
process's peak RSS so far.

    python benchmarks/fidelity.py [--only SUBSTRING ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from autopar import Cluster, Options, baselines, zoo
from autopar.compile import compile

BF16 = torch.bfloat16


def _llama_70b(batch, seq):
    return zoo.llama(config=zoo.llama2_70b_config(), seq=seq, batch=batch, dtype=BF16, device="meta")


def _llama(layers, hidden, heads, kv, ffn, vocab, batch, seq, dtype=torch.float32):
    return zoo.llama(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, seq=seq,
                     batch=batch, dtype=dtype, device="meta")


def _hf(class_name, batch, seq, dtype=BF16):
    """A transformers architecture at its config class's full size (:mod:`autopar.zoo_hf`)."""
    from autopar.zoo_hf import architectures, build

    arch = next(a for a in architectures() if a.class_name == class_name)
    model, inputs = build(arch, size="full", batch=batch, seq=seq, device="meta")
    return model.to(dtype), ((), inputs)


def _gpt(layers, hidden, heads, vocab, batch, seq, dtype=torch.float32):
    return zoo.gpt2(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, batch=batch, dtype=dtype,
                    device="meta")


MODELS = {
    "llama 2L h1024 (issue 15)": lambda: _llama(2, 1024, 16, 4, 2816, 32000, 8, 1024),
    "gpt2-xl 1.5B bf16": lambda: _gpt(48, 1600, 25, 50304, 16, 1024, BF16),
    "llama-7B-shape 4L bf16": lambda: _llama(4, 4096, 32, 32, 11008, 32000, 8, 2048, BF16),
    "bert-large": lambda: zoo.bert(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30528, seq=512, batch=32,
                                   device="meta"),
    "vit-large": lambda: zoo.vit(layers=24, hidden=1024, heads=16, ffn=4096, image=224, patch=16, batch=64,
                                 device="meta"),
    "resnet-50-ish": lambda: zoo.resnet(widths=(256, 512, 1024, 2048), depths=(3, 4, 6, 3), layer_type="bottleneck",
                                        image=224, batch=64, device="meta"),
    "moe 8x": lambda: zoo.moe(d_model=2048, ffn=8192, experts=8, top_k=2, layers=2, seq=1024, batch=8,
                              device="meta"),
    "llama-2-70B": lambda: _llama_70b(16, 512),
    "llama-2-7B seq 4096": lambda: zoo.llama(config=zoo.llama2_7b_config(), seq=4096, batch=32, device="meta"),
    "gpt3-175B": lambda: _gpt(96, 12288, 96, 50304, 1024, 512, BF16),
    "mamba-130m bf16 (scan)": lambda: _hf("MambaForCausalLM", 32, 1024),
}
A100 = lambda nodes: Cluster.preset("dgx-a100", nodes=nodes, use_profile=False)
H100 = lambda nodes: Cluster.preset("dgx-h100", nodes=nodes, use_profile=False)


def _plan(kind: str):
    """A function (model, cluster, inputs) -> Plan for plan ``kind``."""
    if kind == "autopar":
        return lambda m, c, i: compile(m, c, example_inputs=i, options=Options(pipeline=False)).plan
    if kind == "autopar pp":
        return lambda m, c, i: compile(m, c, example_inputs=i, options=Options(pipeline=True, shard_parameters=False)).plan
    if kind == "dp":
        return lambda m, c, i: baselines.data_parallel(m, c, example_inputs=i)
    if kind == "fsdp":
        return lambda m, c, i: baselines.fsdp(m, c, example_inputs=i)
    if kind == "dp zero=1 bf16 recompute":  # issue 16's Done-when row
        return lambda m, c, i: baselines.data_parallel(m, c, example_inputs=i, zero=1,
                                                       options=Options(mixed_precision=True, recompute=True))
    tp = int(kind.split("=")[1].split(",")[0])
    if kind.startswith("tp=") and "pp=" not in kind:
        zero = int(kind.split("zero=")[1]) if "zero=" in kind else 0
        return lambda m, c, i: baselines.megatron(m, c, example_inputs=i, tp=tp, zero=zero)
    pp = int(kind.split("pp=")[1])
    return lambda m, c, i: baselines.megatron(m, c, example_inputs=i, tp=tp, pp=pp, micro_batches=4,
                                              options=Options(pipeline=True))


ROWS = [  # (model, cluster, nodes, plan)
    ("llama 2L h1024 (issue 15)", A100, 1, "dp"),
    ("llama 2L h1024 (issue 15)", A100, 1, "fsdp"),
    ("llama 2L h1024 (issue 15)", A100, 1, "tp=8"),
    ("llama 2L h1024 (issue 15)", A100, 1, "autopar"),
    ("gpt2-xl 1.5B bf16", A100, 2, "fsdp"),
    ("gpt2-xl 1.5B bf16", A100, 2, "autopar"),
    ("llama-7B-shape 4L bf16", A100, 1, "tp=8"),
    ("llama-7B-shape 4L bf16", A100, 1, "fsdp"),
    ("llama-7B-shape 4L bf16", A100, 2, "tp=4,pp=2"),
    ("llama-7B-shape 4L bf16", A100, 2, "autopar pp"),
    ("gpt2-xl 1.5B bf16", A100, 2, "tp=2,pp=4"),
    ("bert-large", A100, 1, "dp"),
    ("bert-large", A100, 1, "autopar"),
    ("vit-large", A100, 1, "dp"),
    ("vit-large", A100, 1, "autopar"),
    ("resnet-50-ish", A100, 1, "dp"),
    ("moe 8x", A100, 1, "autopar"),
    ("moe 8x", A100, 1, "fsdp"),
    ("llama-2-7B seq 4096", A100, 1, "dp zero=1 bf16 recompute"),
    ("llama-2-70B", H100, 2, "fsdp"),
    ("llama-2-70B", H100, 2, "tp=8,zero=3"),
    ("llama-2-70B", H100, 2, "autopar"),
    ("mamba-130m bf16 (scan)", A100, 2, "autopar"),
    ("mamba-130m bf16 (scan)", A100, 2, "tp=8"),
    ("gpt3-175B", A100, 128, "fsdp"),
    ("gpt3-175B", A100, 128, "tp=8,zero=3"),
]


def run_row(name, cluster_of, nodes, kind) -> dict:
    model, example = MODELS[name]()
    cluster = cluster_of(nodes)
    args, kwargs = example
    inputs = args if not kwargs else {**dict(zip(_arg_names(model, len(args)), args)), **kwargs}
    start = time.perf_counter()
    plan = _plan(kind)(model, cluster, inputs)
    planned = time.perf_counter() - start
    compiled = compile(model, cluster, example_inputs=inputs, plan=plan)
    start = time.perf_counter()
    report = compiled.verify()
    seconds = time.perf_counter() - start
    worst = max(report.ranks, key=lambda r: r.measured.peak)
    pred_bytes = sum(r.predicted.collectives and sum(c[2] for c in r.predicted.collectives) or 0 for r in report.ranks)
    meas_bytes = sum(sum(c.nbytes for c in r.measured.collectives) for r in report.ranks)
    diffs = [r.collective_diff() for r in report.ranks]
    equal = None if any(d is None for d in diffs) else all(not a and not b for a, b in diffs)
    return {"model": name, "cluster": f"{nodes}x{cluster.devices_per_node} {cluster.device}", "plan": kind,
            "precision": plan.precision, "predicted_peak": worst.predicted.peak, "measured_peak": worst.measured.peak,
            "peak_ratio": worst.peak_ratio, "predicted_collective_bytes": pred_bytes,
            "measured_collective_bytes": meas_bytes, "collectives_equal": equal,
            "predicted_flops": worst.predicted.flops, "measured_flops": worst.measured.flops,
            "flops_ratio": worst.flops_ratio, "mfu": plan.mfu, "plan_seconds": planned, "verify_seconds": seconds,
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _arg_names(model, n):
    import inspect

    return list(inspect.signature(model.forward).parameters)[:n]


def _fmt(row) -> str:
    if "error" in row:
        return f"{row['model']:26s} {row['cluster']:14s} {row['plan']:10s} ERROR {row['error'][:90]}"
    g = 2**30
    flops = "-" if row["flops_ratio"] is None else f"{row['flops_ratio']:.3f}"
    equal = {None: "-", True: "yes", False: "no"}[row["collectives_equal"]]
    return (f"{row['model']:26s} {row['cluster']:14s} {row['plan']:10s} {row['predicted_peak'] / g:8.2f}"
            f" {row['measured_peak'] / g:8.2f} {row['peak_ratio']:6.3f} {row['predicted_collective_bytes'] / g:8.2f}"
            f" {row['measured_collective_bytes'] / g:8.2f} {equal:>5s} {flops:>6s} {row['mfu'] * 100:5.1f}%"
            f" {row['verify_seconds']:7.1f} {row['rss_gib']:5.2f}")


HEADER = (f"{'model':26s} {'cluster':14s} {'plan':10s} {'peak GiB':>8s} {'measured':>8s} {'ratio':>6s}"
          f" {'coll GiB':>8s} {'issued':>8s} {'equal':>5s} {'FLOPs':>6s} {'MFU':>6s} {'verify s':>7s} {'RSS':>5s}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="rows whose model or plan contains one of these")
    parser.add_argument("--json", help="also write the rows here")
    opts = parser.parse_args(argv)
    print(HEADER, flush=True)
    rows = []
    for name, cluster_of, nodes, kind in ROWS:
        if opts.only and not any(s in name or s == kind for s in opts.only):
            continue
        try:
            row = run_row(name, cluster_of, nodes, kind)
        except Exception as exc:  # noqa: BLE001  (a row that fails is reported, the others still run)
            row = {"model": name, "cluster": f"{nodes} nodes", "plan": kind, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(_fmt(row), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
