"""Planning time and memory of full-size zoo architectures: capture on meta, plan on 2x8 A100.

Each row builds one transformers architecture at its full size (its config class's defaults,
or the sizes named below; dropout-like probabilities at 0: :func:`autopar.zoo_hf.without_randomness`) on the meta device with fake inputs (global batch 32 of 1024 tokens or the
model's longest sequence, or images/audio of the config's size), in bf16, and times
``autopar.compile`` on it for a DGX A100 cluster of 2 nodes, as a user would call it: capture,
the one-stage and pipeline searches, and for routed experts both dispatches where both may win
("auto"); nothing runs on a device. Each row runs in a process of its own, which prints its
seconds (capture and in all) and its resident-set peak (``VmHWM``); a row over ``--timeout`` seconds is cut off.

    python benchmarks/planning_time.py                    # every row
    python benchmarks/planning_time.py --models mamba llama-70b
    python benchmarks/planning_time.py --zoo --timeout 120  # every class of the auto mappings, full size

With ``--zoo`` the rows are every model class of :func:`autopar.zoo_hf.architectures` (362 with
this transformers), each at its config class's defaults, named by class; a row that cannot be
built or captured says why, and the totals count rows within the limits, over them and failed.
A search that ends in "no plan fits" is an answer, timed like a plan.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import math
import re
import subprocess
import sys
import time
from collections import Counter

import autopar
from autopar.core.errors import AutoparError, InfeasibleError
from autopar.cost_models.cluster import Cluster
from autopar.zoo_hf import TASKS, BuildError, architectures, build_full, fails_by_itself

GiB = 2**30
BATCH, SEQ = 32, 1024
LIMIT_S, LIMIT_GIB = 60.0, 4.0  # what every row must stay within (issue 17)

ROWS = {  # name -> (config model_type, model class, config overrides[, sequence length])
    "llama-7b": ("llama", "LlamaForCausalLM", {}),
    "llama-70b": ("llama", "LlamaForCausalLM", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)),
    "mistral-7b": ("mistral", "MistralForCausalLM", {}),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", {}),
    "gpt2": ("gpt2", "GPT2LMHeadModel", {}),
    "bert-base": ("bert", "BertForMaskedLM", {}),
    "roberta-base": ("roberta", "RobertaForMaskedLM", {}),
    "t5-small": ("t5", "T5ForConditionalGeneration", {}),
    "vit-base": ("vit", "ViTForImageClassification", {}),
    "bart-base": ("bart", "BartForConditionalGeneration", {}),
    "whisper": ("whisper", "WhisperForConditionalGeneration", {}, 448),  # its decoder's longest sequence
    "convnext": ("convnext", "ConvNextForImageClassification", {}),
    "swin": ("swin", "SwinForImageClassification", {}),
    "clip": ("clip", "CLIPModel", {}),
    "mamba-130m": ("mamba", "MambaForCausalLM", {}),
    "mamba-130m/128": ("mamba", "MambaForCausalLM", {}, 128),  # its time-step loop unrolled: graph ~ layers x seq
    "falcon-mamba": ("falcon_mamba", "FalconMambaForCausalLM", {}),
    "mamba2": ("mamba2", "Mamba2ForCausalLM", {}),
    "jamba": ("jamba", "JambaForCausalLM", {}),
    "zamba": ("zamba", "ZambaForCausalLM", {}),
    "recurrent-gemma": ("recurrent_gemma", "RecurrentGemmaForCausalLM", {}),
    "rwkv": ("rwkv", "RwkvForCausalLM", {}),
    "xlstm": ("xlstm", "xLSTMForCausalLM", {"mode": "train"}),  # its default, "inference", fails in bf16 (fp32 states)
    "mixtral-8x7b": ("mixtral", "MixtralForCausalLM", {}),
    "qwen2-moe": ("qwen2_moe", "Qwen2MoeForCausalLM", {}),
    "olmoe": ("olmoe", "OlmoeForCausalLM", {}),
    "qwen3-next": ("qwen3_next", "Qwen3NextForCausalLM", {}),
}


PHASES = {  # phase -> (module, function) whose outermost calls it times
    "capture": ("autopar.passes.capture.training", "capture_for_training"),
    "trace": ("autopar.passes.capture.trace", "trace"),
    "saved tensors": ("autopar.passes.capture.saved", "saved_tensors_pass"),
    "one-stage search": ("autopar.planner.intra", "plan_intra_best_mesh"),
    "pipeline search": ("autopar.planner.inter", "plan_inter"),
    "cost graph": ("autopar.planner.costgraph", "build_cost_graph"),
    "simplify": ("autopar.planner.simplify", "simplify"),
    "ILP": ("autopar.solver.ilp", "solve_ilp"),
    "build plan": ("autopar.planner.intra", "build_plan"),
}


def _time_phases(seconds: dict[str, float]) -> None:
    """Wrap every :data:`PHASES` function, in every loaded module that imported it, so that its
    outermost calls add their wall time to ``seconds[phase]``."""
    for phase, (module_name, function_name) in PHASES.items():
        original = getattr(importlib.import_module(module_name), function_name)
        depth = [0]

        @functools.wraps(original)
        def timed(*args, _phase=phase, _original=original, _depth=depth, **kwargs):
            _depth[0] += 1
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _depth[0] -= 1
                if not _depth[0]:
                    seconds[_phase] = seconds.get(_phase, 0.0) + time.perf_counter() - start
                    print(f"{_phase}: {seconds[_phase]:.1f} s so far", file=sys.stderr, flush=True)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("autopar") and getattr(module, function_name, None) is original:
                setattr(module, function_name, timed)


def _peak_gib() -> float:
    """This process's resident-set peak (VmHWM)."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib * 1024 / GiB


def _row_spec(name: str):
    """``(architecture, config overrides, [sequence length])`` of a :data:`ROWS` row or a class name."""
    if name not in ROWS:
        return next(a for a in architectures() if a.class_name == name), {}, []
    model_type, class_name, overrides, *seq = ROWS[name]
    # the class's task from the auto mappings, the config of model_type (a class may serve several)
    arch = dataclasses.replace(next(a for a in architectures() if a.class_name == class_name), model_type=model_type)
    return arch, overrides, seq


def one_row(name: str) -> dict:
    """Build one row on meta and ``autopar.compile`` it in this process; its figures and seconds per phase."""
    seconds: dict[str, float] = {}
    _time_phases(seconds)
    arch, overrides, seq = _row_spec(name)
    start = time.perf_counter()
    model, inputs = build_full(arch, batch=BATCH, seq=seq[0] if seq else SEQ, overrides=overrides)
    nodes = None
    try:
        with blaming_defaults(model, inputs):
            compiled = autopar.compile(model, Cluster.preset("dgx-a100", nodes=2), example_inputs=inputs)
        answer, step_ms = compiled.plan.name, compiled.plan.predicted_step_time * 1e3
        nodes = len(compiled.captured.graph_module.graph.nodes)
    except InfeasibleError as exc:  # an answer too: the search ended and says why
        answer, step_ms = f"no plan fits: {str(exc).split(': ', 2)[-1]}", float("nan")
    return {"nodes": nodes, "capture_s": seconds.get("capture", 0.0),
            "total_s": time.perf_counter() - start, "peak_gib": _peak_gib(), "plan": answer,
            "step_ms": step_ms,
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "phases": seconds}


@contextlib.contextmanager
def blaming_defaults(model, inputs):
    """Raise a failure of autopar's that the model's own eager forward repeats (the zoo builds
    it from its config class's defaults, which some classes leave unrunnable) as a BuildError
    saying so: such a row is not compared."""
    try:
        yield
    except AutoparError as exc:
        why = None if isinstance(exc, InfeasibleError) else fails_by_itself(model, inputs, exc)
        if why is None:
            raise
        raise BuildError(f"the model's own forward fails the same way (the zoo's config defaults or example inputs): {why}") from exc


def failure(stderr: str) -> str:
    """The child's error: its last exception line, with what the tracer said where it says so."""
    lines = stderr.strip().splitlines() or ["?"]
    errors = [i for i, line in enumerate(lines) if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", line)]
    if not errors:
        return lines[-1].strip()
    said = [line.strip() for line in lines[errors[-1] + 1:] if line.strip().startswith("tracer said:")]
    return " ".join([lines[errors[-1]]] + said)


def run_row(command: list[str], timeout: float) -> tuple[dict | None, str | None, dict]:
    """Run one row's child process ``command``: ``(its last stdout line as JSON, None, {})``, or
    ``(None, why, phases)`` where it failed (``why``: :func:`failure`) or ran past ``timeout``
    (``why``: "cut off"; ``phases``: those it finished, from its ``... s so far`` lines)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as cut:
        err = cut.stderr or b""  # bytes, even under text=True
        lines = (err.decode(errors="replace") if isinstance(err, bytes) else err).splitlines()
        return None, "cut off", dict(line[:-len(" s so far")].rsplit(": ", 1) for line in lines
                                     if line.endswith(" s so far"))
    if done.returncode:
        return None, failure(done.stderr), {}
    return json.loads(done.stdout.strip().splitlines()[-1]), None, {}


def zoo_rows(tasks=TASKS, every: int = 1, start: str | None = None) -> list[str]:
    """The class names of ``tasks``' zoo architectures from ``start`` on (any class: another
    sample, or where a sweep stopped), every ``every``-th."""
    names = [a.class_name for a in architectures(tasks)]
    return names[names.index(start) if start else 0::every]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=[], help="substrings of row names")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a row is cut off")
    parser.add_argument("--phases", action="store_true", help="also print seconds per phase")
    parser.add_argument("--zoo", action="store_true", help="rows: every class of the auto mappings, full size")
    parser.add_argument("--every", type=int, default=1, help="with --zoo: every N-th class")
    parser.add_argument("--start", help="with --zoo: begin at this class (resume a sweep, or sample others)")
    parser.add_argument("--tasks", nargs="*", choices=TASKS, default=list(TASKS), help="with --zoo: these tasks' classes")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # run one row here (the child process)
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(one_row(args.row)))
        return 0
    names = zoo_rows(args.tasks, args.every, args.start) if args.zoo else list(ROWS)
    names = [n for n in names if not args.models or any(m in n for m in args.models)]
    print(f"{'model':14} {'params':>7} {'nodes':>6} {'capture s':>9} {'total s':>8} {'peak GiB':>8}  plan")
    over, failed, slowest = [], Counter(), (0.0, "")
    for name in names:
        start = time.perf_counter()
        r, why, done_phases = run_row([sys.executable, __file__, "--row", name] + ["--phases"] * args.phases,
                                      args.timeout)
        if why == "cut off":
            print(f"{name:14} cut off after {args.timeout:.0f} s"
                  + "".join(f"; {k} {v} s" for k, v in done_phases.items()), flush=True)
            over.append(name)
            continue
        if why is not None:
            print(f"{name:14} failed after {time.perf_counter() - start:.0f} s: {why[:300]}", flush=True)
            failed[why.split(":")[0].rsplit(".", 1)[-1]] += 1
            continue
        step = f" ({r['step_ms']:.1f} ms)" if math.isfinite(r["step_ms"]) else ""  # none where no plan fits
        print(f"{name:14} {r['params_b']:6.2f}B {r['nodes'] or '-':>6} {r['capture_s']:9.1f} {r['total_s']:8.1f} "
              f"{r['peak_gib']:8.2f}  {r['plan']}{step}", flush=True)
        if args.phases:
            print(" " * 15 + ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items()), flush=True)
        if r["total_s"] > LIMIT_S or r["peak_gib"] > LIMIT_GIB:
            over.append(name)
        else:
            slowest = max(slowest, (r["total_s"], name))
    planned = len(names) - sum(failed.values())
    print(f"{len(names)} rows: {planned - len(over)} planned within {LIMIT_S:.0f} s and {LIMIT_GIB:.0f} GiB"
          f" (slowest {slowest[1] or '-'}, {slowest[0]:.1f} s), {len(over)} over or cut off"
          f"{': ' + ', '.join(over) if over else ''}, {sum(failed.values())} failed"
          f"{' (' + ', '.join(f'{k} x{v}' for k, v in failed.most_common()) + ')' if failed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
