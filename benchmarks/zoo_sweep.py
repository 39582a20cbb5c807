"""Train every transformers architecture autopar can build, tiny, on 2 gloo ranks against one process.

For each model class of transformers' auto mappings (causal LM, masked LM, seq2seq, image
classification, audio classification, CTC, speech seq2seq, contrastive; :mod:`autopar.zoo_hf`)
the sweep builds the class from its config shrunk to 2 layers and small widths (random init,
nothing downloaded), then per plan (``auto``: ``autopar.compile`` on ``Cluster.local(2)``;
``fsdp``; ``tp``: Megatron tp=2 under a memory limit that makes it split weights, halfway from
its free peak to FSDP's or the smallest peak tp reaches):

    build -> capture -> plan -> train 2 SGD steps on 2 ranks -> compare with one process

and prints one line per architecture: ``ok`` or the stage that failed and why, plus the ops
that ran replicated for want of a rule. Losses and parameters must equal the one-process fp32
run (rtol 1e-5, atol 1e-6). Mixture-of-experts models are counted separately, built with 8
experts of 512 features on batches of 8 x 64 tokens (:func:`autopar.zoo_hf.with_experts`: sizes
at which 2 ranks plan expert parallelism), planned with the dense dispatch
(``Options(moe_dispatch="dense")``: under "auto" their sorted experts win at these sizes), and
tagged ``EP`` where autopar's plan shards their experts over a mesh axis
(:func:`autopar.plan.experts.expert_parallel_axes`). The ranks are
spawned once per ``--chunk`` models (one spawn trains every plan of those models).

    python benchmarks/zoo_sweep.py                          # everything (about an hour here)
    python benchmarks/zoo_sweep.py --only llama gpt2 --plans auto
    python benchmarks/zoo_sweep.py --tasks image-classification --chunk 10
    python benchmarks/zoo_sweep.py --every 5                # a fifth of them, spread over the tasks
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from autopar import Cluster, baselines
from autopar.compile import compile as autopar_compile
from autopar.core.errors import InfeasibleError, UnsupportedOpWarning
from autopar.core.options import Options
from autopar.plan.experts import expert_parallel_axes
from autopar.testing import run_programs, run_reference
from autopar.zoo_hf import EP_BATCH, EP_SEQ, TASKS, architectures, build, is_moe

PLANS = ("auto", "fsdp", "tp")
STEPS, LR = 2, 0.01
MOE = Options(moe_dispatch="dense")  # expert parallelism on offer (at these sizes "auto" keeps the sorted experts)
RTOL, ATOL = 1e-5, 1e-6


@dataclass
class Result:
    """What happened to one architecture: ``stage`` is ``"ok"`` or the stage that failed."""

    name: str
    moe: bool = False
    expert_parallel: bool = False  # autopar's plan shards the experts over a mesh axis
    stage: str = "ok"
    why: str = ""
    replicated: list[str] = field(default_factory=list)  # ops without a rule
    seconds: float = 0.0

    def line(self) -> str:
        tag = (" [MoE, EP]" if self.expert_parallel else " [MoE]") if self.moe else ""
        ops = f"  replicated: {', '.join(self.replicated)}" if self.replicated else ""
        why = f": {self.why}" if self.why else ""
        return f"{self.name:72s} {self.stage}{why}{tag}{ops} ({self.seconds:.0f}s)"


def plans_of(model, inputs, plans, world: int, options: Options | None = None) -> dict:
    """The compiled models of ``plans`` on ``world`` local ranks, by plan name (``auto`` with
    ``options``)."""
    local = Cluster.local(world_size=world)
    out = {}
    if "auto" in plans:
        out["auto"] = autopar_compile(model, local, example_inputs=inputs, options=options)
    if "fsdp" in plans or "tp" in plans:
        fsdp = baselines.fsdp(model, local, example_inputs=inputs)
        if "fsdp" in plans:
            out["fsdp"] = autopar_compile(model, local, example_inputs=inputs, plan=fsdp)
    if "tp" in plans:
        free = baselines.megatron(model, local, tp=world, example_inputs=inputs)
        tp = _tight_megatron(model, inputs, local, world,
                             (free.predicted_peak_memory + fsdp.predicted_peak_memory) / 2)
        out["tp"] = autopar_compile(model, local.with_mesh(tp.mesh_shape), example_inputs=inputs, plan=tp)
    return out


def _tight_megatron(model, inputs, local, world: int, limit: float):
    """Megatron tp=``world`` under ``limit`` bytes per device, or under the smallest peak any
    tp plan reaches where that is above ``limit`` (the tightest tp plan splits the most)."""
    def under(limit):
        return baselines.megatron(model, dataclasses.replace(local, device_memory=limit), tp=world,
                                  example_inputs=inputs, options=Options(memory_fraction=1.0))
    try:
        return under(limit)
    except InfeasibleError as exc:
        if exc.smallest_peak is None or not exc.smallest_peak > limit:
            raise
        return under(exc.smallest_peak * (1 + 1e-6) + 1)


def mismatch(losses, params, ref_losses, ref_params) -> str:
    """Why a run differs from the one-process run ('' when it does not)."""
    got, want = torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return f"losses {losses} vs one process {ref_losses}"
    for fqn, want in ref_params.items():
        have = params.get(fqn)
        if have is None:
            return f"{fqn} missing"
        if want.is_floating_point():
            if not torch.allclose(have.double(), want.double(), rtol=RTOL, atol=ATOL):
                return f"{fqn} differs by {float((have.double() - want.double()).abs().max()):.1e}"
        elif not torch.equal(have, want):
            return f"{fqn} differs"
    return ""


def prepare(arch, plans, world):
    """(Result, {plan: compiled}, inputs, reference) for one architecture; stops at the first
    failing stage."""
    res = Result(arch.name)
    start = time.perf_counter()
    stage = "build"
    try:
        model, inputs = build(arch)
        res.moe = is_moe(model.config)
        if res.moe:
            model, inputs = build(arch, experts=True, batch=EP_BATCH, seq=EP_SEQ)
        stage = "plan"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnsupportedOpWarning)
            compiled = plans_of(model, inputs, plans, world, MOE if res.moe else None)
        res.expert_parallel = "auto" in compiled and bool(expert_parallel_axes(compiled["auto"].plan))
        res.replicated = sorted({str(w.message).split()[4].rstrip(";") for w in caught
                                 if issubclass(w.category, UnsupportedOpWarning)})
        stage = "codegen"
        for c in compiled.values():
            c.program.code(0)
        stage = "reference"
        reference = run_reference(model, inputs=inputs, steps=STEPS, lr=LR, return_parameters=True)
    except Exception as exc:  # the line says which stage and why
        res.stage, res.why = f"{stage} failed", f"{type(exc).__name__}: {_first_line(exc)}"
        compiled, inputs, reference = {}, None, None
    res.seconds = time.perf_counter() - start
    return res, compiled, inputs, reference


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:240]


def train_chunk(chunk, world):
    """Train every prepared plan of ``chunk`` in one spawn and judge each architecture; when a
    rank fails, each architecture of the chunk is trained again in a spawn of its own, so one
    failure names its own architecture only."""
    runs = {f"{i}/{p}": (c, inputs, None) for i, (res, compiled, inputs, _) in enumerate(chunk)
            for p, c in compiled.items()}
    if not runs:
        return
    start = time.perf_counter()
    try:
        results = run_programs(runs, steps=STEPS, lr=LR, return_parameters=True, timeout=1800)
    except Exception as exc:
        if len(chunk) == 1:
            res = chunk[0][0]
            res.stage, res.why = "train failed", f"{type(exc).__name__}: {_last_line(exc)}"
            res.seconds += time.perf_counter() - start
            return
        for one in chunk:
            train_chunk([one], world)
        return
    per = (time.perf_counter() - start) / len(chunk)
    for i, (res, compiled, _, reference) in enumerate(chunk):
        res.seconds += per
        for plan in compiled:
            losses, params = results[f"{i}/{plan}"]
            why = mismatch(losses, params, *reference)
            if why:
                res.stage, res.why = f"differs ({plan})", why
                break


def _last_line(exc: BaseException) -> str:
    """A rank's failure ends with the exception it raised."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1][:240] if lines else ""


def summary(results: list[Result]) -> str:
    lines = []
    for moe in (False, True):
        group = [r for r in results if r.moe == moe]
        built = [r for r in group if r.stage != "build failed"]
        ok = [r for r in built if r.stage == "ok"]
        kind = "MoE" if moe else "dense"
        if group:
            pct = 100 * len(ok) / max(len(built), 1)
            lines.append(f"{kind}: {len(ok)}/{len(built)} built architectures train like one process"
                         f" ({pct:.1f} %); {len(group) - len(built)} did not build")
            if moe:
                lines.append(f"    {sum(r.expert_parallel for r in ok)} of them under a plan with expert parallelism")
        causes = Counter(r.stage + ": " + r.why.split(":")[0] for r in built if r.stage != "ok")
        lines += [f"    {n:3d} x {cause}" for cause, n in causes.most_common()]
    ops = Counter(op for r in results for op in r.replicated)
    if ops:
        lines.append("ops run replicated (no rule): " + ", ".join(f"{op} x{n}" for op, n in ops.most_common()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="*", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--only", nargs="*", default=[], help="architectures whose name contains one of these")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {PLANS}")
    parser.add_argument("--chunk", type=int, default=8, help="architectures trained per spawn")
    parser.add_argument("--every", type=int, default=1, help="sample: every N-th architecture of the list")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    plans = tuple(p for p in args.plans.split(",") if p)
    archs = [a for a in architectures(tuple(args.tasks))
             if not args.only or any(o.lower() in a.name.lower() for o in args.only)][::args.every]
    results = []
    for at in range(0, len(archs), args.chunk):
        chunk = [prepare(a, plans, args.world) for a in archs[at:at + args.chunk]]
        train_chunk(chunk, args.world)
        for res, *_ in chunk:
            print(res.line(), flush=True)
            results.append(res)
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
