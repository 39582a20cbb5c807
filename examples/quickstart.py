"""Quick start: plan a tiny GPT-2 for one DGX A100 node (8 GPUs), print the plan, save it.

    python examples/quickstart.py [plan.json]

Runs on a CPU in seconds: autopar captures the model on fake tensors and predicts the costs of
every sharding with its cost model; no GPU is needed to plan.
"""

import sys

from autopar import Cluster, zoo
from autopar.compile import compile
from autopar.plan import Plan


def main(out: str = "gpt2_plan.json") -> None:
    # A GPT2LMHeadModel with random weights; the labels make it return its own loss.
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=64, heads=4, vocab=512, seq=64, batch=16)
    cluster = Cluster.preset("dgx-a100", nodes=1)  # mesh (1, 8): 8 x A100-80GB on NVSwitch

    compiled = compile(model, cluster, example_inputs={"input_ids": args[0], **kwargs})
    plan = compiled.plan
    print(plan.summary())
    print()
    print(plan.explain("transformer.h.0.mlp.c_fc", top=2))  # what else the solver weighed

    plan.save(out)
    assert Plan.load(out) == plan  # plans are plain JSON and load back equal
    print(f"\nsaved {out}: predicted {plan.predicted_step_time * 1e3:.3f} ms per step,"
          f" {plan.predicted_peak_memory / 2**20:.1f} MiB per GPU")


if __name__ == "__main__":
    main(*sys.argv[1:2])
