"""Predicted vs measured step time of several plans of a GPT-2-small-width model on 2 local ranks.

The model is GPT-2 with hidden 768 and 12 heads (layers, sequence, batch and vocabulary reduced
so that a step takes about a second on one CPU thread). The cluster is ``Cluster.local(2)``
calibrated by the profiler (``--profile`` measures this machine first; otherwise the stored
profile is used, or the analytic CPU constants when there is none). Plans, each costed by the
same cost model (``plan.predicted_step_time``: forward + backward, compute and communication):

- ``replicated``: no parallelism, every rank computes the whole step;
- ``data_parallel``, ``fsdp`` (ZeRO-3), ``megatron(tp=2)``: the baselines;
- ``sequence``, ``sequence + ZeRO-3``: inputs split along the sequence, parameters stored
  replicated or sharded and used whole, the rest as the solver picks;
- ``autopar``: autopar's own plan.

Measured: forward + backward of each emitted program (``program.step``) on 2 gloo ranks, one
thread each, plans interleaved round by round, the slower rank per round; median and lower
quartile after warm-up. Printed side by side with the Spearman rank correlation::

    python benchmarks/predicted_vs_measured.py --profile --rounds 7
    python benchmarks/predicted_vs_measured.py --cache-dir /tmp/prof --profile   # a private profile
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
from steptiming import interleaved, summary

import autopar
from autopar import zoo
from autopar.core.placement import Replicate, Shard
from autopar.passes.capture.training import capture_for_training
from autopar.planner.intra import plan_intra
from autopar.profiler import profile
from autopar.testing import run_on_ranks


def _replicated(graph, i, strategy) -> bool:
    return all(isinstance(p, Replicate) for sh in (*strategy.inputs, *strategy.outputs) for p in sh)


def _sequence(*, zero: bool):
    """Inputs split along the sequence (dim 1); parameters stored replicated, or sharded
    (``zero``: ZeRO-3) and used whole; everything else as the solver picks."""
    cache: dict = {}

    def params_of(graph, i):
        """Which tensor inputs of node ``i`` are parameters."""
        if cache.get("graph") is not graph:
            cache.clear()
            cache["graph"] = graph
            for e in graph.edges:
                if graph.nodes[e.src].kind == "parameter":
                    cache.setdefault(e.dst, set()).add(e.in_index)
        return cache.get(i, ())

    def allow(graph, i, strategy) -> bool:
        node = graph.nodes[i]
        if node.kind == "user_input":
            return strategy.outputs[0] == (Shard(1),)
        if node.kind == "parameter":
            return isinstance(strategy.outputs[0][0], Shard if zero else Replicate)
        if node.kind == "op":
            return all(strategy.inputs[k] == (Replicate(),) for k in params_of(graph, i))
        return True
    return allow


def make_plans(model, example_inputs: dict, cluster) -> dict:
    """``{name: Plan}``, every plan on ``cluster`` (2 ranks)."""
    inputs = {"example_inputs": example_inputs}
    captured = capture_for_training(model, **inputs)
    options = autopar.Options(optimizer="sgd")
    plans = {
        "replicated": plan_intra(captured, cluster, options, allow=_replicated, name="replicated"),
        "data_parallel": autopar.baselines.data_parallel(model, cluster, options=options, **inputs),
        "fsdp": autopar.baselines.fsdp(model, cluster, options=options, **inputs),
        "megatron(tp=2)": autopar.baselines.megatron(model, cluster, tp=2, options=options, **inputs),
        "sequence": plan_intra(captured, cluster, options, allow=_sequence(zero=False), name="sequence"),
        "sequence + ZeRO-3": plan_intra(captured, cluster, options, allow=_sequence(zero=True),
                                        name="sequence + ZeRO-3"),
        "autopar": autopar.compile(model, cluster, options=options, **inputs).plan,
    }
    return plans


def _model(cfg):
    model, example = zoo.gpt2(**cfg)
    args, kwargs = example
    return model, {"input_ids": args[0], **kwargs}


def _measure(cfg, plans, warmup, rounds):
    warnings.simplefilter("ignore")
    model, inputs = _model(cfg)
    cluster = autopar.Cluster.local(2)
    runners = {}
    for name, plan in plans.items():
        program = autopar.compile(model, cluster, example_inputs=inputs, plan=plan).program
        params = list(program.parameters())

        def step(program=program, params=params):
            for p in params:
                p.grad = None
            program.step(inputs)
        runners[name] = step
    return interleaved(runners, warmup=warmup, rounds=rounds)


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="profile this machine first (minutes)")
    parser.add_argument("--quick-profile", action="store_true", help="a shorter profile")
    parser.add_argument("--cache-dir", default=None, help="profile database folder (default: autopar's)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.local(2, cache_dir=args.cache_dir)
    if args.profile or args.quick_profile:
        cluster = profile(cluster, quick=args.quick_profile, cache_dir=args.cache_dir, progress=lambda *_: None)
    cfg = dict(layers=args.layers, hidden=768, heads=12, vocab=args.vocab, seq=args.seq, batch=args.batch)
    model, inputs = _model(cfg)
    plans = make_plans(model, inputs, cluster)
    load = os.getloadavg()[0]
    (times, *_) = run_on_ranks(_measure, world_size=2, timeout=3000,
                               args=(cfg, plans, args.warmup, args.rounds))
    print(f"GPT-2 (hidden 768, 12 heads, {args.layers} layers, vocab {args.vocab}), batch {args.batch}"
          f" x seq {args.seq}; 2 gloo ranks x 1 thread; cost model: "
          + (f"profiled ({cluster.calibration.key})" if cluster.calibration else "analytic CPU constants")
          + f"; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    print(f"{'plan':24s} {'mesh':7s} {'predicted':>10s} {'(compute':>9s} {'comm)':>7s}"
          f" {'measured med':>13s} {'lq':>8s} {'meas/pred':>9s}")
    pred, meas = [], []
    for name, plan in plans.items():
        med, lq = summary(times[name])
        pred.append(plan.predicted_step_time)
        meas.append(med)
        comm = plan.time.communication + plan.time.resharding
        print(f"{name:24s} {str(tuple(plan.mesh_shape)):7s} {plan.predicted_step_time * 1e3:8.1f}ms"
              f" {plan.time.compute * 1e3:7.0f}ms {comm * 1e3:5.0f}ms {med * 1e3:11.1f}ms {lq * 1e3:6.1f}ms {med / plan.predicted_step_time:9.2f}")
    print(f"Spearman rank correlation (predicted, measured median): {spearman(pred, meas):.2f};"
          f" with the lower quartiles: {spearman(pred, [summary(times[n])[1] for n in plans]):.2f}")


if __name__ == "__main__":
    main()
