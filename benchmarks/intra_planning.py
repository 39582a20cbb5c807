"""Intra-op planning end to end (capture included): GPT-39B on 1x8 A100 and LLaMA-2-70B on 2x8.

Prints wall time per phase and the solver's size before and after simplification. The model is
built on the meta device first (not timed: that is the user's own construction). Targets: each
<= 10 s wall on a 2-core machine.

    python benchmarks/intra_planning.py [gpt39b|llama70b]
"""

from __future__ import annotations

import sys
import time

import torch

from autopar import zoo
from autopar.cluster import Cluster
from autopar.errors import InfeasibleError
from autopar.compile import capture_for_training
from autopar.options import Options
from autopar.planner.costgraph import build_cost_graph
from autopar.planner.costs import CostModel
from autopar.planner.intra import build_plan, solve_graph


def gpt39b():
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=48, n_embd=8192, n_head=64, n_positions=1024, vocab_size=51200,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    with torch.device("meta"):
        model = tf.GPT2LMHeadModel(cfg).to(torch.bfloat16)
        ids = torch.randint(0, 51200, (1024, 1024))
    return model, {"input_ids": ids, "labels": ids.clone()}, Cluster.preset("dgx-a100", nodes=1)


def llama70b():
    import transformers as tf

    with torch.device("meta"):
        model = tf.LlamaForCausalLM(zoo.llama2_70b_config()).to(torch.bfloat16)
        ids = torch.randint(0, 32000, (2, 4096))
    return model, {"input_ids": ids, "labels": ids.clone()}, Cluster.preset("dgx-a100", nodes=2)


def run(name: str) -> None:
    model, example, cluster = {"gpt39b": gpt39b, "llama70b": llama70b}[name]()
    model.train()
    # LLaMA-2-70B's Adam state (12 B/param) alone exceeds 16 x 80 GB with no pipeline; plan SGD.
    options = Options(mixed_precision=True, optimizer="adam" if name == "gpt39b" else "sgd")
    t0 = time.perf_counter()
    captured = capture_for_training(model, example_inputs=example)
    t1 = time.perf_counter()
    cost_model = CostModel(cluster, options)
    graph = build_cost_graph(captured, cluster.mesh_shape, cost_model, shard_parameters=True)
    t2 = time.perf_counter()
    try:
        solved = solve_graph(graph, options, cluster.memory_per_device * options.memory_fraction, method="autopar")
    except InfeasibleError as exc:
        # Such a model does not fit this cluster without pipelining: report it and time the
        # solve without the memory row, which is the planning work the target is about.
        print(f"  memory: {exc}".splitlines()[0][:160])
        solved = solve_graph(graph, options, None, method="autopar (no memory limit)")
    t3 = time.perf_counter()
    plan = build_plan(solved, captured, cluster, cost_model, options, name="autopar")
    t4 = time.perf_counter()
    strategies = sum(n.size for n in graph.nodes)
    print(f"{name} on mesh {cluster.mesh_shape}: {len(captured.graph_module.graph.nodes)} graph nodes")
    print(f"  solver size: {len(graph.nodes)} cost nodes / {strategies} strategies / {len(graph.edges)} edges"
          f" -> {solved.stats.solver_nodes} decisions, {solved.stats.num_variables} ILP variables,"
          f" {solved.stats.num_constraints} constraints ({solved.stats.status})")
    print(f"  capture {t1 - t0:.1f} s, costing {t2 - t1:.1f} s, simplify+solve {t3 - t2:.1f} s,"
          f" plan {t4 - t3:.1f} s: total {t4 - t0:.1f} s wall (target <= 10 s)")
    print(f"  predicted step {plan.predicted_step_time:.3f} s, peak {plan.predicted_peak_memory / 2**30:.1f} GiB,"
          f" MFU {plan.mfu:.1%}")


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["gpt39b", "llama70b"]:
        run(arg)
