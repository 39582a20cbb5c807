"""Predicted vs measured step time on one GPU: a LLaMA-shape model planned for the GPU this runs
on, its emitted program timed against the plan and against plain eager PyTorch on the same GPU.

    python benchmarks/gpu_step_time.py                     # needs a CUDA device
    python benchmarks/gpu_step_time.py --layers 4 --batch 2

The cluster is one device of the kind found (``H100-80GB`` or ``H200-141GB`` by name, else
A100-80GB's figures), uncalibrated: the analytic cost model. Times are medians over ``--steps``
steps after 3 warm-up steps, synchronised; "forward+backward" is ``program.step`` (and eager
``loss.backward()``), "+AdamW" adds the optimizer's step and ``zero_grad``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from autopar import Cluster, zoo
from autopar.compile import compile
from autopar.core.options import Options
from autopar.testing import run_on_ranks


def _device_kind() -> str:
    name = torch.cuda.get_device_name()
    return "H200-141GB" if "H200" in name else "H100-80GB" if "H100" in name else "A100-80GB"


def _timed(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(args, kind):
    torch.manual_seed(0)
    model, (a, kw) = zoo.llama(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                               ffn=args.ffn, vocab=args.vocab, seq=args.seq, batch=args.batch, device="cuda")
    inputs = {"input_ids": a[0], **kw}
    cluster = Cluster(mesh_shape=(1,), device=kind)
    compiled = compile(model, cluster, example_inputs=inputs, options=Options(pipeline=False))
    plan = compiled.plan
    program = compiled.program.start()
    opt = torch.optim.AdamW(program.parameters(), lr=1e-4)

    def step_only():
        program.step(inputs)

    def step_adam():
        program.step(inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def eager_step():
        out = model(**inputs)
        (out.loss if hasattr(out, "loss") else out).backward()

    def eager_adam():
        eager_step()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    measured = {"autopar forward+backward": _timed(step_only, args.steps),
                "autopar +AdamW": _timed(step_adam, args.steps)}
    peak = torch.cuda.max_memory_allocated()  # the model's own tensors included
    measured.update({"eager forward+backward": _timed(eager_step, args.steps),
                     "eager +AdamW": _timed(eager_adam, args.steps)})
    return {"plan": plan.name, "predicted": plan.predicted_step_time, "time": dataclasses.asdict(plan.time),
            "predicted_peak": plan.predicted_peak_memory, "measured": measured, "max_allocated": peak,
            "device": torch.cuda.get_device_name(), "params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to time")
        return 0
    r = run_on_ranks(_rank, world_size=1, args=(args, _device_kind()), backend="nccl", timeout=600)[0]
    print(f"{r['device']}: LLaMA shape, {r['params'] / 1e9:.2f} B parameters, fp32, batch {args.batch} x {args.seq}")
    print(f"plan {r['plan']}: predicted {r['predicted'] * 1e3:.1f} ms ({r['time']}),"
          f" peak {r['predicted_peak'] / 2**30:.2f} GiB; measured max allocated {r['max_allocated'] / 2**30:.2f} GiB")
    for name, secs in r["measured"].items():
        print(f"  {name:26} {secs * 1e3:8.1f} ms   predicted/measured {r['predicted'] / secs:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
