"""The ``autopar`` command line: plan a model, show, diff, explain and draw saved plans.

    autopar plan autopar.zoo:gpt2_small --cluster dgx-a100 --nodes 2 --out plan.json
    autopar show plan.json
    autopar diff old.json new.json          # exit status 0: same plan, 1: different
    autopar explain plan.json transformer.h.0.mlp
    autopar render plan.json plan.html      # or plan.png
    autopar verify plan.json autopar.zoo:gpt2_small   # exit status 0: the plan is what runs

Factories are described in :mod:`autopar.factory`. Mistakes in what the user typed print one
``autopar: error: ...`` message and exit with status 2; output cut short by a closed pipe
(``autopar explain plan.json model | head``) ends quietly with the shell's SIGPIPE status, 141.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from autopar import baselines
from autopar.compile import compile
from autopar.core.errors import AutoparError, InfeasibleError, InputError
from autopar.core.options import Options
from autopar.cost_models.cluster import PRESETS, Cluster
from autopar.demo import run
from autopar.factory import build, parse_arg
from autopar.plan import Plan
from autopar.plan.formatting import GiB, fmt_time
from autopar.profiler import add_profile_arguments, run_profile_command
from autopar.regression import diff_plans

EXAMPLES = """examples:
  autopar plan autopar.zoo:gpt2_small --cluster dgx-a100 --nodes 2 --out plan.json
  autopar plan examples/custom_model.py:build --cluster dgx-h100 --mesh 2x4 --baselines
  autopar show plan.json
  autopar diff old.json new.json
  autopar explain plan.json transformer.h.0.mlp
  autopar render plan.json plan.html
  autopar verify plan.json autopar.zoo:gpt2_small --json
"""


class CLIError(AutoparError, ValueError):
    """A command-line argument is malformed."""


# ----------------------------------------------------------------------------- progress


class Progress(logging.Handler):
    """Prints phases with the seconds since the command started (to stderr)."""

    def __init__(self, stream=None):
        super().__init__(logging.INFO)
        self.start = time.perf_counter()
        self.stream = stream or sys.stderr
        self.capture_started: float | None = None

    def say(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", file=self.stream, flush=True)

    def capturing(self) -> None:
        self.capture_started = time.perf_counter()
        self.say("capturing the training graph (torch.export on fake tensors)")

    def emit(self, record) -> None:
        if self.capture_started is not None:
            self.say(f"captured in {time.perf_counter() - self.capture_started:.1f} s")
            self.capture_started = None
        self.say(record.getMessage())

    def planned(self, plan) -> None:
        """After compile: close the capture phase if no planner phase was logged, then the result."""
        if self.capture_started is not None:
            self.say(f"captured and planned in {time.perf_counter() - self.capture_started:.1f} s")
            self.capture_started = None
        self.say(f"plan ready: predicted step {plan.predicted_step_time * 1e3:.3f} ms,"
                 f" peak {plan.predicted_peak_memory / 2**30:.2f} GiB per device")

    def __enter__(self):
        log = logging.getLogger("autopar")
        log.addHandler(self)
        self._level = log.level
        log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        log = logging.getLogger("autopar")
        log.removeHandler(self)
        log.setLevel(self._level)


# ----------------------------------------------------------------------------- shared steps


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x8"`` -> ``(2, 8)``."""
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise CLIError(f"--mesh must look like 2x8 (positive sizes joined by x), got {text!r}")
    return shape


def make_cluster(args):
    if args.cluster == "local":
        cluster = Cluster.local(world_size=args.nodes)
    elif args.cluster in PRESETS:
        cluster = Cluster.preset(args.cluster, nodes=args.nodes, use_profile=not args.no_profile)
    else:
        raise CLIError(f"unknown --cluster {args.cluster!r}; use one of {', '.join(sorted(PRESETS))} or local")
    if args.mesh:
        cluster = cluster.with_mesh(parse_mesh(args.mesh))
    return cluster


def make_options(args):
    # --mesh asks for that logical mesh: no search over other views of the devices
    return Options(memory_fraction=args.memory_fraction, optimizer=args.optimizer,
                   mixed_precision=args.mixed_precision, time_limit_s=args.time_limit,
                   search_meshes=args.mesh is None,
                   offload={"auto": "auto", "yes": True, "no": False, "parameters": "parameters"}[args.offload])


def compare_baselines(spec, cluster, options, plan, progress: Progress) -> list[str]:
    """Plan data parallel, FSDP and the best Megatron grid point on the same cost model; the
    comparison table as lines."""
    rows = [(plan.name, plan)]
    for fn in (baselines.data_parallel, baselines.fsdp, baselines.grid):
        progress.say(f"baseline {fn.__name__}")
        try:
            rows.append((fn.__name__, fn(spec.model, cluster, options=options, **spec.compile_kwargs())))
        except InfeasibleError as exc:
            rows.append((fn.__name__, exc))
    labels = [name if isinstance(p, Exception) else p.name for name, p in rows]
    w = min(53, max(len(x) for x in labels))
    lines = [f"{'plan':{w}s} {'step time':>10s} {'peak memory':>12s} {'MFU':>6s} {'autopar speedup':>15s}"]
    for label, (_, p) in zip(labels, rows):
        label = label if len(label) <= w else label[:w - 3] + "..."
        if isinstance(p, Exception):
            peak = f"{p.smallest_peak / GiB:.1f} GiB" if p.smallest_peak else "?"
            lines.append(f"{label:{w}s} {'does not fit (smallest peak ' + peak + ')':>46s}")
            continue
        speedup = p.predicted_step_time / plan.predicted_step_time if plan.predicted_step_time else 0
        lines.append(f"{label:{w}s} {fmt_time(p.predicted_step_time):>10s}"
                     f" {p.predicted_peak_memory / GiB:>8.2f} GiB {p.mfu * 100:5.1f}% {speedup:>14.2f}x")
    return lines


# ----------------------------------------------------------------------------- commands


def _plan(args) -> int:
    kwargs = dict(parse_arg(a) for a in args.arg)
    with Progress() as progress:
        progress.say(f"building the model: {args.factory}" + (f" {kwargs}" if kwargs else ""))
        cluster = make_cluster(args)
        options = make_options(args)
        spec = build(args.factory, kwargs)
        progress.capturing()
        try:
            compiled = compile(spec.model, cluster, options=options, **spec.compile_kwargs())
        except InputError as exc:
            if spec.loss_fn is not None:
                raise
            raise CLIError(f"{exc}\n  from the command line: let {args.factory} return (model, example_inputs,"
                           " loss_fn, example_target)") from exc
        plan = compiled.plan
        progress.planned(plan)
        if args.out:
            plan.save(args.out)
            progress.say(f"saved {args.out}")
        table = compare_baselines(spec, cluster, options, plan, progress) if args.baselines else []
    if not args.quiet:
        print(plan.summary())
    if table:
        print("\nbaselines on the same cost model:")
        print("\n".join(table))
    return 0


def _load(path):
    return Plan.load(path)


def _show(args) -> int:
    print(_load(args.plan).summary())
    return 0


def _diff(args) -> int:
    a, b = _load(args.old), _load(args.new)
    d = diff_plans(a, b)
    print(f"--- {args.old} (plan {a.name!r})\n+++ {args.new} (plan {b.name!r})")
    print(d.text(rtol=args.rtol, limit=args.limit))
    moved = any(abs(x - y) > args.rtol * abs(x) for x, y in d.costs.values())
    return 1 if d.sharding_changed or moved else 0


def _explain(args) -> int:
    print(_load(args.plan).explain(args.target, top=args.top))
    return 0


def _render(args) -> int:
    path = _load(args.plan).render(args.out)
    print(f"wrote {path}")
    return 0


def _verify(args) -> int:
    """Run the saved plan's programs of FACTORY's model for one fake step; exit 1 on a mismatch."""
    plan = _load(args.plan)
    spec = build(args.factory, dict(parse_arg(a) for a in args.arg))
    compiled = compile(spec.model, plan.cluster, plan=plan, options=plan.options, **spec.compile_kwargs())
    report = compiled.verify(rank=args.rank)
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


def _demo(args) -> int:
    """Plan GPT-2 small for a DGX-A100, compare baselines, run the shardings on 2 CPU ranks."""
    return run(args.out_dir)


# ----------------------------------------------------------------------------- parser


def _add_plan_arguments(p) -> None:
    p.add_argument("factory", help="FILE.py:FUNCTION or MODULE:FUNCTION returning (model, example_inputs)"
                   " or (model, example_inputs, loss_fn, example_target); see autopar.factory")
    p.add_argument("-a", "--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (a Python literal), repeatable: --arg layers=4")
    p.add_argument("--cluster", default="dgx-a100",
                   help="dgx-v100, dgx-a100, dgx-h100, dgx-h200 (8 GPUs per node), gh200 (1 per node)"
                        " or local (CPU ranks)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (ranks for --cluster local)")
    p.add_argument("--mesh", help="plan on exactly this logical mesh of the devices, e.g. 2x8 or 4x4"
                   " (default: try the cluster's mesh and every (devices/t, t) with t up to a node)")
    p.add_argument("--baselines", action="store_true",
                   help="also plan data parallel, FSDP and the best Megatron configuration, and compare")
    p.add_argument("-o", "--out", help="save the plan as JSON here")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="share of device memory a plan may use")
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--mixed-precision", action="store_true", help="bf16 compute with fp32 master weights")
    p.add_argument("--offload", choices=("auto", "yes", "no", "parameters"), default="auto",
                   help="the optimizer on the host: where nothing fits without it (auto), always, never;"
                        " parameters: the parameters there too, fetched per layer")
    p.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit in seconds")
    p.add_argument("--no-profile", action="store_true", help="ignore stored profiles; use datasheet constants")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the summary")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Auto-parallel graph compiler for PyTorch.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("plan", help="plan a model for a cluster; print the summary, save the plan",
                       description="Capture the model from FACTORY, plan it for the cluster, print the"
                       " per-layer summary and save the plan. Progress goes to stderr.")
    _add_plan_arguments(p)
    p.set_defaults(func=_plan)
    p = sub.add_parser("show", help="print the summary of a saved plan")
    p.add_argument("plan", help="a plan JSON file (from autopar plan --out or plan.save)")
    p.set_defaults(func=_show)
    p = sub.add_parser("diff", help="what changed between two saved plans (exit 1 when they differ)",
                       description="Shardings, node strategies and stages that changed, and the predicted"
                       " costs that moved. Exit status 0 when the plans match, 1 when they differ.")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rtol", type=float, default=0.0, help="ignore cost changes below this relative size")
    p.add_argument("--limit", type=int, default=25, help="at most this many lines per list")
    p.set_defaults(func=_diff)
    p = sub.add_parser("explain", help="the strategies the solver weighed for a module or node",
                       description="For each node of TARGET (a module path such as model.layers.3.mlp,"
                       " or a node name), the chosen strategy and the recorded alternatives with their"
                       " compute, communication and the change in step time if that node alone switched.")
    p.add_argument("plan")
    p.add_argument("target", help="module path or graph node name")
    p.add_argument("--top", type=int, default=None, help="show at most this many alternatives per node")
    p.set_defaults(func=_explain)
    p = sub.add_parser("render", help="draw a saved plan as HTML (self-contained) or PNG",
                       description="Gantt chart of the schedule, memory per device and the sharding map.")
    p.add_argument("plan")
    p.add_argument("out", help="output file: .html or .png (PNG needs matplotlib)")
    p.set_defaults(func=_render)
    p = sub.add_parser("verify", help="run a saved plan's programs for one step on fake tensors; compare with"
                       " the plan (exit 1 on a mismatch)",
                       description="Runs one rank of each distinct program of PLAN (every stage of a pipelined"
                       " plan) for one training step on fake tensors under a fake process group of the plan's"
                       " size (no GPU, no real memory; models built on device='meta' work) and prints, beside"
                       " the plan's predictions, the peak memory by kind, the collectives issued and the FLOPs"
                       " executed. Exit status 0 when every prediction is within tolerance, 1 otherwise.")
    p.add_argument("plan", help="a plan JSON file (from autopar plan --out or plan.save)")
    p.add_argument("factory", help="the FILE.py:FUNCTION or MODULE:FUNCTION the plan was made for")
    p.add_argument("-a", "--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (a Python literal), repeatable")
    p.add_argument("--rank", type=int, default=None, help="verify this rank only")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_verify)
    demo = sub.add_parser("demo", help="plan GPT-2 for a DGX-A100, compare baselines, check a 2-rank run",
                          description="Plans GPT-2 small for a dgx-a100 node, compares data parallel, FSDP and"
                          " the best Megatron configuration on the same cost model, saves the plan (JSON,"
                          " HTML, PNG), then runs the same shardings on a scaled-down GPT-2 on 2 local CPU"
                          " ranks and checks the losses against one process. Exit status 0 on a match.")
    demo.add_argument("--out-dir", default="autopar-demo", help="where the plan and its pictures go")
    demo.set_defaults(func=_demo)

    profile = sub.add_parser("profile", help="measure this machine's devices and collectives; cache the results")
    add_profile_arguments(profile)
    profile.set_defaults(func=run_profile_command)
    return parser


SIGPIPE_STATUS = 128 + getattr(signal, "SIGPIPE", 13)  # a shell's status for a process a closed pipe ended


def _discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that flushing what is still buffered at
    exit does not fail a second time on the closed pipe."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured): nothing is flushed to a pipe
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader stopped early (autopar explain ... | head): end quietly
        _discard_stdout()
        return SIGPIPE_STATUS
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the user named cannot be read or written
        print(f"autopar: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
