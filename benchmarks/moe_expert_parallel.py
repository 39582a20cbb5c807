"""Expert parallelism on a full-size Mixtral-8x7B: autopar's plan with and without EP available.

Mixtral-8x7B (its config class's defaults, bf16) is built on the meta device with a global batch of
``--batch`` sequences of ``--seq`` tokens, captured for training three ways and planned by
the one-program search (every logical mesh of the devices, :func:`autopar.planner.intra.
candidate_meshes`; every layer recomputed: without it no one-program plan fits) on DGX A100
clusters of 1 and 2 nodes (nothing runs on a device):

- ``sorted``: the experts as the model runs them (``Options(moe_dispatch="sorted")``; on meta in
  bf16 transformers calls ``aten._grouped_mm``, which has no rule: experts replicated). What
  autopar planned before the dense dispatch;
- ``dense, no EP``: the dense dispatch of ``passes/capture/moe.py``, exact capacity (every token
  kept: the experts' matmuls run on E/k = 4 times the routed tokens), with every strategy that
  uses an expert weight sharded on E removed (:func:`no_expert_parallel`): data and tensor
  parallelism and ZeRO only;
- ``dense``: the same with expert parallelism available;
- ``dense f=1.25, no EP`` / ``dense f=1.25``: ``Options(moe_capacity_factor=1.25)`` (GShard's
  capacity, tokens past it dropped: 1.25x padding), without and with EP.

Per row: predicted step time, two MFUs: the plan's (the FLOPs of the graph as captured, so a
padded dispatch counts its padding, and transformers' ``aten._grouped_mm`` is not counted at all)
and the model's (:func:`model_flops`: 6 x active parameters x tokens + attention, the same for
every row), whether the plan shards the experts on E (expert parallelism: the experts' weights
``S(0)`` on a mesh axis and their batched matmuls taking them so), the all-to-all bytes per step
and the seconds capture and planning took.

With ``--full`` each variant with EP on offer is planned by autopar's whole search instead
(:func:`autopar.compile.search_plan`: one program or pipeline stages, recomputation chosen).

    python benchmarks/moe_expert_parallel.py [--nodes 1 2] [--variants sorted dense] [--batch 32 --seq 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from autopar.compile import search_plan
from autopar.core.errors import InfeasibleError
from autopar.core.options import Options
from autopar.core.placement import Shard
from autopar.cost_models.cluster import Cluster
from autopar.passes.capture.training import capture_for_training
from autopar.plan.experts import EXPERT_WEIGHTS, expert_parallel_axes
from autopar.planner.intra import candidate_meshes, plan_intra_fastest
from autopar.zoo_hf import architectures, build, config_of

ONE_PROGRAM = Options(pipeline=False, recompute=True, moe_dispatch="dense")  # none fits without recompute
VARIANTS = {  # name -> (options, expert parallelism allowed)
    "sorted": (dataclasses.replace(ONE_PROGRAM, moe_dispatch="sorted"), True),
    "dense, no EP": (ONE_PROGRAM, False),
    "dense": (ONE_PROGRAM, True),
    "dense f=1.25, no EP": (dataclasses.replace(ONE_PROGRAM, moe_capacity_factor=1.25), False),
    "dense f=1.25": (dataclasses.replace(ONE_PROGRAM, moe_capacity_factor=1.25), True),
}


_EXPERT_INPUTS: dict = {}  # id(graph) -> {op node: its inputs that are expert weights}


def no_expert_parallel(graph, i, strategy) -> bool:
    """A planner restriction: no op takes an expert weight sharded on its experts dim."""
    if id(graph) not in _EXPERT_INPUTS:
        _EXPERT_INPUTS.clear()
        found: dict = {}
        for e in graph.edges:
            src = graph.nodes[e.src]
            if src.kind == "parameter" and (src.target or "").endswith(EXPERT_WEIGHTS):
                found.setdefault(e.dst, []).append(e.in_index)
        _EXPERT_INPUTS[id(graph)] = found
    return not any(isinstance(p, Shard) and p.dim == 0
                   for k in _EXPERT_INPUTS[id(graph)].get(i, ()) for p in strategy.inputs[k])


def model_flops(model, tokens: int, seq: int) -> float:
    """Training FLOPs per step: 6 x parameters a token uses (k of E experts) x tokens, plus causal
    attention's 6 x layers x width x seq x tokens (QK^T and AV, forward and backward, halved)."""
    c = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERT_WEIGHTS))
    active = sum(p.numel() for p in model.parameters()) - experts * (1 - c.num_experts_per_tok / c.num_local_experts)
    return 6 * active * tokens + 6 * c.num_hidden_layers * c.hidden_size * seq * tokens


def mixtral(batch: int, seq: int):
    arch = next(a for a in architectures() if a.class_name == "MixtralForCausalLM")
    model, inputs = build(arch, size="full", batch=batch, seq=seq, device="meta", config=config_of(arch, "full"))
    return model.to(torch.bfloat16), inputs


def row(model, inputs, nodes: int, variant: str, useful: float, full: bool = False) -> dict:
    options, ep = VARIANTS[variant]
    start = time.perf_counter()
    captured = capture_for_training(model, example_inputs=inputs, **options.moe_capture())
    cluster = Cluster.preset("dgx-a100", nodes=nodes)
    allow = None if ep else no_expert_parallel
    if full:
        plan = search_plan(captured, cluster, dataclasses.replace(options, pipeline="auto", recompute="auto"))
    else:
        plan = plan_intra_fastest(captured, cluster, options,
                                  {shape: [(allow, variant)] for shape in candidate_meshes(cluster)})
    a2a = sum(r.nbytes for r in plan.collective_records if r.kind == "all_to_all")
    step = plan.predicted_step_time
    return {"cluster": f"{nodes}x8 A100", "variant": variant, "step_ms": step * 1e3, "mfu": plan.mfu,
            "model_mfu": useful / (step * plan.peak_flops), "ep_axes": sorted(expert_parallel_axes(plan)),
            "all_to_all_gib": a2a / 2**30, "mesh": tuple(plan.mesh_shape), "zero": plan.zero,
            "stages": len(plan.stages), "micro_batches": plan.micro_batches,
            "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--full", action="store_true", help="autopar's whole search (variants with EP on offer)")
    args = parser.parse_args(argv)
    model, inputs = mixtral(args.batch, args.seq)
    useful = model_flops(model, args.batch * args.seq, args.seq)
    print(f"Mixtral-8x7B, {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B parameters, bf16,"
          f" batch {args.batch} x {args.seq} tokens")
    print(f"model FLOPs per step {useful:.3g}")
    print(f"{'cluster':12s} {'experts':19s} {'step ms':>9s} {'MFU':>6s} {'model':>6s}  {'EP axes':8s} {'a2a GiB':>8s}"
          f"  {'mesh':8s} {'zero':>4s} {'s':>6s}")
    for nodes in args.nodes:
        for variant in args.variants:
            if args.full and not VARIANTS[variant][1]:
                continue
            try:
                r = row(model, inputs, nodes, variant, useful, args.full)
            except InfeasibleError as exc:
                print(f"{nodes}x8 A100     {variant:19s} no one-program plan fits: {str(exc).splitlines()[0]}")
                continue
            print(f"{r['cluster']:12s} {variant:19s} {r['step_ms']:9.1f} {r['mfu']:6.1%} {r['model_mfu']:6.1%}"
                  f"  {str(r['ep_axes']):8s} {r['all_to_all_gib']:8.2f}  {str(r['mesh']):8s} {r['zero']:4d}"
                  f" {r['seconds']:6.1f}" + (f"  {r['stages']} stages x {r['micro_batches']} micro-batches"
                                              if r["stages"] else ""),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
