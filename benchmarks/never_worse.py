"""autopar against every baseline on the same cost model: full-size zoo configs, planning only.

Each row builds one model on the meta device (bf16 or fp32), plans it with ``autopar.compile``'s
search (:func:`autopar.compile.search_plan`) and with each baseline of :mod:`autopar.baselines`
(data parallel, FSDP, the Megatron grid without pipelining and, where the pipeline planner runs,
with it) on a DGX A100 cluster of 1 or 2 nodes, and prints predicted step time and peak memory
per device of each. A baseline that does not fit prints "-". It checks that autopar's step time
is never above a baseline's, and that autopar finds a plan whenever a baseline does. With
``--verify`` it also runs ``verify`` on autopar's plan of each row (one fake step of every distinct
rank program) and prints its worst rank's predicted/measured peak, whether the collectives are
equal and the FLOPs ratio; a row whose prediction verify does not confirm counts as a failure.

    python benchmarks/never_worse.py                          # every row
    python benchmarks/never_worse.py --models gpt2-xl phi3    # models whose name contains these
    python benchmarks/never_worse.py --nodes 2 --dtypes bf16
    python benchmarks/never_worse.py --verify                 # and verify autopar's plans
    python benchmarks/never_worse.py --zoo --every 10 --verify  # every 10th zoo class, full size

With ``--zoo`` the rows are the classes of transformers' auto mappings at full size (as
``planning_time.py --zoo`` builds them: bf16, global batch 32 of up to 1,024 tokens), one process
per row, cut off after ``--timeout`` seconds; autopar's plan is ``autopar.compile``'s (routed
experts captured and searched both ways). A row that fails before planning says why and does not
count against autopar.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections import Counter

import torch
from planning_time import BATCH as ZOO_BATCH
from planning_time import SEQ as ZOO_SEQ
from planning_time import blaming_defaults, run_row, zoo_rows

from autopar import baselines, zoo
from autopar.compile import compile, search_plan
from autopar.core.errors import InfeasibleError
from autopar.core.options import Options
from autopar.cost_models.cluster import Cluster
from autopar.passes.capture.training import capture_for_training
from autopar.runtime.verify.memory import KINDS
from autopar.zoo_hf import TASKS, architectures, build_full

SEQ, BATCH = 1024, 16  # global batch of 16 sequences: one per device on 2x8 A100


def _llama3_8b(dtype):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    return zoo.llama(config=config, seq=SEQ, batch=BATCH, dtype=dtype, device="meta")


MODELS = {
    "gpt2-small (124M)": lambda dtype: zoo.gpt2_small(seq=SEQ, batch=BATCH, dtype=dtype),
    "gpt2-xl (1.5B)": lambda dtype: zoo.gpt2(layers=48, hidden=1600, heads=25, vocab=50304, seq=SEQ,
                                             batch=BATCH, dtype=dtype, device="meta"),
    "llama3-8b (GQA)": _llama3_8b,
    "bert-large": lambda dtype: zoo.bert(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522,
                                         seq=512, batch=BATCH * 4, dtype=dtype, device="meta"),
    "vit-large/16": lambda dtype: zoo.vit(layers=24, hidden=1024, heads=16, ffn=4096, image=224,
                                          patch=16, classes=1000, batch=BATCH * 16, dtype=dtype,
                                          device="meta"),
    "resnet-50": lambda dtype: zoo.resnet(widths=(256, 512, 1024, 2048), depths=(3, 4, 6, 3),
                                          layer_type="bottleneck", image=224, classes=1000,
                                          batch=BATCH * 16, dtype=dtype, device="meta"),
    "phi3-mini (3.8B)": lambda dtype: zoo.phi3_mini(seq=SEQ, batch=BATCH, dtype=dtype),
    "mistral-7b": lambda dtype: zoo.mistral_7b(seq=SEQ, batch=BATCH, dtype=dtype),
    "bart-large": lambda dtype: zoo.bart_large(seq=SEQ, batch=BATCH, dtype=dtype),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _example(model, args, kwargs) -> dict:
    names = list(inspect.signature(model.forward).parameters)
    return {**dict(zip(names, args)), **kwargs}


def baseline_plans(model, example, cluster) -> dict:
    """Every baseline's plan (None where it does not fit), by name."""
    runs = {"dp": (baselines.data_parallel, None), "fsdp": (baselines.fsdp, None),
            "grid": (baselines.grid, Options(pipeline=False)), "grid+pp": (baselines.grid, Options())}
    plans = {}
    for name, (baseline, options) in runs.items():
        try:
            plans[name] = baseline(model, cluster, example_inputs=example, options=options)
        except (InfeasibleError, baselines.BaselineError):
            plans[name] = None
    return plans


def row(model_name: str, dtype: str, nodes: int, *, check: bool = False) -> tuple[dict, float, str]:
    """autopar's plan and every baseline's for one model, dtype and cluster; the planning seconds;
    with ``check``, what verify says of autopar's plan (else "")."""
    model, (args, kwargs) = MODELS[model_name](DTYPES[dtype])
    example = _example(model, args, kwargs)
    cluster = Cluster.preset("dgx-a100", nodes=nodes)
    start = time.perf_counter()
    captured = capture_for_training(model, example_inputs=example)
    try:
        auto = search_plan(captured, cluster, Options())
    except InfeasibleError:
        auto = None
    seconds = time.perf_counter() - start
    checked = _verified(model, example, cluster, auto) if check and auto is not None else ""
    return {"autopar": auto, **baseline_plans(model, example, cluster)}, seconds, checked


def _verified(model, example, cluster, plan) -> str:
    """verify of ``plan``: :func:`_report`."""
    return _report(compile(model, cluster, example_inputs=example, plan=plan).verify())


def _report(report) -> str:
    """A verify report's worst rank's peak ratio, collectives, FLOPs ratio (``!``: a problem)."""
    worst = max(report.ranks, key=lambda r: abs(r.peak_ratio - 1))
    equal = all(r.collective_diff() in (None, (Counter(), Counter())) for r in report.ranks)
    flops = max((abs(r.flops_ratio - 1), r.flops_ratio) for r in report.ranks if r.flops_ratio is not None)[1]
    problems = [p for r in report.ranks for p in r.problems() if not p.startswith(tuple(KINDS))]
    return (f"peak {worst.peak_ratio:.3f} coll {'=' if equal else '!='} flops {flops:.3f}"
            + (" !" if problems else ""))


HEADS = ["autopar", "dp", "fsdp", "grid", "grid+pp"]


def zoo_row(class_name: str, nodes: int, *, check: bool) -> dict:
    """One zoo class at full size: autopar's plan (``autopar.compile``) and every baseline's, as
    ``{name: [step ms, peak GiB] or None}``, the planning seconds, autopar's plan name, verify's."""
    arch = next(a for a in architectures() if a.class_name == class_name)
    model, inputs = build_full(arch, batch=ZOO_BATCH, seq=ZOO_SEQ)
    cluster = Cluster.preset("dgx-a100", nodes=nodes)
    start = time.perf_counter()
    try:
        with blaming_defaults(model, inputs):
            compiled = compile(model, cluster, example_inputs=inputs)
    except InfeasibleError:
        compiled = None
    seconds = time.perf_counter() - start
    auto = compiled.plan if compiled is not None else None
    checked = _report(compiled.verify()) if check and compiled is not None else ""
    plans = {"autopar": auto, **baseline_plans(model, inputs, cluster)}
    cells = {k: None if p is None else [p.predicted_step_time * 1e3, p.predicted_peak_memory / 2**30]
             for k, p in plans.items()}
    return {"cells": cells, "seconds": seconds, "plan": auto.name if auto else "no plan fits", "checked": checked}


def _cell(plan) -> str:
    if plan is None:
        return f"{'-':>17}"
    return f"{plan.predicted_step_time * 1e3:8.1f} {plan.predicted_peak_memory / 2**30:5.1f}G"


class _Cell:  # a zoo row's [ms, GiB] as the table and worse_than read a plan
    def __init__(self, ms_gib):
        self.predicted_step_time, self.predicted_peak_memory = ms_gib[0] / 1e3, ms_gib[1] * 2**30


def worse_than(plans: dict) -> list[str]:
    """The baselines that beat autopar (or fit where it does not)."""
    auto = plans["autopar"]
    return [name for name, plan in plans.items() if name != "autopar" and plan is not None
            and (auto is None or auto.predicted_step_time > plan.predicted_step_time * (1 + 1e-9))]


def _print_row(name: str, nodes: int, dtype: str, plans: dict, seconds: float, plan_name: str, checked: str) -> list[str]:
    """Print one row; its failures (a baseline faster than autopar, a verify that disagrees)."""
    print(f"{name[:28]:28} {nodes}x8  {dtype:5} " + " ".join(_cell(plans[h]) for h in HEADS)
          + f"  {seconds:6.1f}  {plan_name}  {checked}", flush=True)
    failures = [f"{name} {nodes}x8 {dtype}: {b}" for b in worse_than(plans)]
    return failures + ([f"{name} {nodes}x8 {dtype}: verify {checked}"] if checked.endswith("!") else [])


def _zoo(a) -> list[str]:
    """Every zoo row, each in a process of its own; the failures, and a count of rows that fail before planning."""
    failures, before = [], Counter()
    for name in zoo_rows(a.tasks, a.every, a.start):
        if a.models and not any(m in name for m in a.models):
            continue
        for nodes in a.nodes:
            command = [sys.executable, __file__, "--zoo-row", name, "--nodes", str(nodes)] + ["--verify"] * a.verify
            r, why, _ = run_row(command, a.timeout)
            if why == "cut off":
                print(f"{name[:28]:28} {nodes}x8  cut off after {a.timeout:.0f} s", flush=True)
                before["cut off"] += 1
                continue
            if why is not None:
                print(f"{name[:28]:28} {nodes}x8  fails before planning: {why[:200]}", flush=True)
                before[why.split(":")[0].rsplit(".", 1)[-1]] += 1
                continue
            plans = {k: None if v is None else _Cell(v) for k, v in r["cells"].items()}
            failures += _print_row(name, nodes, "bf16", plans, r["seconds"], r["plan"], r["checked"])
    if before:
        print("not compared: " + ", ".join(f"{k} x{v}" for k, v in before.most_common()))
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=[], help="substrings of model names")
    parser.add_argument("--nodes", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--verify", action="store_true", help="verify autopar's plan of each row")
    parser.add_argument("--zoo", action="store_true", help="rows: the zoo's classes at full size, bf16")
    parser.add_argument("--every", type=int, default=1, help="with --zoo: every N-th class")
    parser.add_argument("--start", help="with --zoo: begin at this class (resume a sweep, or sample others)")
    parser.add_argument("--tasks", nargs="*", choices=TASKS, default=list(TASKS), help="with --zoo: these tasks' classes")
    parser.add_argument("--timeout", type=float, default=600.0, help="with --zoo: seconds before a row is cut off")
    parser.add_argument("--zoo-row", help=argparse.SUPPRESS)  # one zoo row here (the child process)
    a = parser.parse_args()
    if a.zoo_row:
        print(json.dumps(zoo_row(a.zoo_row, a.nodes[0], check=a.verify)))
        return
    print(f"{'model':28} {'A100':>4} {'dtype':5} " + " ".join(f"{h + ' ms / peak':>17}" for h in HEADS)
          + "  plan s  autopar's plan")
    if a.zoo:
        failures = _zoo(a)
    else:
        failures = []
        for name in [m for m in MODELS if not a.models or any(s in m for s in a.models)]:
            for nodes in a.nodes:
                for dtype in a.dtypes:
                    plans, seconds, checked = row(name, dtype, nodes, check=a.verify)
                    auto = plans["autopar"]
                    failures += _print_row(name, nodes, dtype, plans, seconds,
                                           auto.name if auto else "no plan fits", checked)
    print("autopar <= every baseline on every row" if not failures
          else "autopar slower than: " + "; ".join(failures))


if __name__ == "__main__":
    main()
