"""``autopar demo``: plan a GPT-2-style model for a DGX A100, compare with the baselines, save
the plan, then run the same shardings scaled down on 2 local CPU ranks against one process."""

from __future__ import annotations

import dataclasses
import math
import os
import time

from autopar import baselines, zoo
from autopar.compile import CompiledModel
from autopar.core.options import Options
from autopar.cost_models.cluster import Cluster
from autopar.passes.capture.training import capture_for_training
from autopar.planner.intra import plan_intra
from autopar.planner.transfer import transfer_plan
from autopar.testing import run_distributed, run_reference

GiB = 1024**3
BATCH = 32  # GPT-2 small (zoo.gpt2_small): 1,024-token sequences, trained with mixed precision Adam
# The scaled-down copy: same layers and ops, tiny widths, 2 CPU ranks.
SMALL = dict(layers=zoo.GPT2_SMALL["layers"], hidden=32, heads=4, vocab=128, seq=16, batch=4)


def _example(model, args, kwargs):
    names = ["input_ids"]
    return {**dict(zip(names, args)), **kwargs}


def _say(start, text):
    print(f"[{time.perf_counter() - start:6.1f}s] {text}", flush=True)


def run(out_dir: str = "autopar-demo", *, world_size: int = 2, steps: int = 3) -> int:
    """Returns 0 when the 2-rank run matches one process, 1 otherwise."""
    start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    cluster = Cluster.preset("dgx-a100", nodes=1)
    options = Options(mixed_precision=True)
    _say(start, f"building GPT-2 small ({zoo.GPT2_SMALL['layers']} layers, hidden {zoo.GPT2_SMALL['hidden']},"
                f" batch {BATCH}) on the meta device")
    model, (args, kwargs) = zoo.gpt2_small(batch=BATCH)
    example = _example(model, args, kwargs)
    _say(start, "capturing the training graph (torch.export on fake tensors)")
    captured = capture_for_training(model, example_inputs=example)
    _say(start, f"planning for {cluster.describe().splitlines()[0]}")
    plan = plan_intra(captured, cluster, options)
    print(plan.summary())
    _say(start, "costing the baselines on the same model")
    rows = [("autopar", plan)]
    allow = {"data parallel": baselines.data_rule(cluster.mesh_shape), "fsdp": baselines.fsdp_rule(cluster.mesh_shape)}
    for label, rule in allow.items():
        rows.append((label, plan_intra(captured, cluster, options, allow=rule, name=label)))
    rows.append(("best Megatron (grid)", baselines.grid_on(captured, cluster, options=options)))
    print(f"\n{'plan':34s} {'step time':>10s} {'peak memory':>12s} {'MFU':>6s}  vs autopar")
    for label, p in rows:
        name = p.name if label.startswith("best") else label
        print(f"{name[:34]:34s} {p.predicted_step_time * 1e3:8.1f}ms {p.predicted_peak_memory / GiB:10.2f}GiB"
              f" {p.mfu * 100:5.1f}%  {p.predicted_step_time / plan.predicted_step_time:6.2f}x")
    path = os.path.join(out_dir, "plan.json")
    plan.save(path)
    _say(start, f"wrote {path}")
    try:
        for ext in ("html", "png"):
            plan.render(os.path.join(out_dir, f"plan.{ext}"))
            _say(start, f"wrote {os.path.join(out_dir, 'plan.' + ext)}")
    except (AttributeError, ImportError) as exc:
        _say(start, f"pictures skipped: {exc}")

    _say(start, f"scaling down: the same shardings on a tiny GPT-2 over {world_size} CPU ranks")
    small_model, (sargs, skwargs) = zoo.gpt2(**SMALL)
    small_example = _example(small_model, sargs, skwargs)
    small_captured = capture_for_training(small_model, example_inputs=small_example)
    local = Cluster.local(world_size=world_size).with_mesh(
        tuple(world_size if n > 1 else 1 for n in plan.mesh_shape))
    # in fp32: the check below is fp32's 1e-5 (mixed precision has its own policy and noise)
    small_plan = transfer_plan(plan, small_captured, local, dataclasses.replace(options, mixed_precision=False),
                               name="autopar (scaled down)")
    compiled = CompiledModel(small_model, local, small_captured, small_plan)
    reference = run_reference(small_model, inputs=small_example, steps=steps, optimizer="adamw", lr=1e-3)
    got = run_distributed(compiled, inputs=small_example, steps=steps, world_size=world_size,
                          optimizer="adamw", lr=1e-3)
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, got))
    print(f"\n{'step':>4s} {'one process':>14s} {f'{world_size} ranks':>14s}")
    for i, (a, b) in enumerate(zip(reference, got)):
        print(f"{i:4d} {a:14.8f} {b:14.8f}")
    ok = worst <= 1e-5 and all(math.isfinite(x) for x in got)
    _say(start, f"{'MATCH' if ok else 'MISMATCH'}: largest relative loss difference {worst:.2e}"
                " (tolerance 1e-5)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run())
