"""The predicted peak memory is what the program allocates: a plan's ``predicted_peak_memory``
against ``verify``'s measured peak of rank 0's step (fake tensors, fake process group), for the
issue's LLaMA case at small sizes under tensor parallelism, data parallelism and FSDP; and the
facts capture records about what autograd saves; an MoE under FSDP (expert weights' gradients as
large as the gathered weights) and a saved tensor resharded for a second consumer that saves it."""

import dataclasses

import pytest
import torch
from torch import nn

from autopar import Cluster, Options, baselines, zoo
from autopar.compile import compile
from autopar.core.errors import InfeasibleError
from autopar.core.placement import Replicate, Shard
from autopar.passes.capture import capture
from autopar.planner.intra import plan_intra

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)


def small_llama():
    """Activations dominate the step (batch 8 x 256 tokens, vocabulary 4096): the peak tests them."""
    model, (args, kwargs) = zoo.llama(layers=2, hidden=256, heads=8, kv_heads=2, ffn=704, vocab=4096, seq=256,
                                      batch=8, device="meta")
    return model, {"input_ids": args[0], **kwargs}


PLANS = {
    "tp=8": lambda m, i: baselines.megatron(m, A100, example_inputs=i, tp=8),
    "dp": lambda m, i: baselines.data_parallel(m, A100, example_inputs=i),
    "fsdp": lambda m, i: baselines.fsdp(m, A100, example_inputs=i),
}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_predicted_peak_is_within_ten_percent_of_the_measured_peak(kind):
    model, inputs = small_llama()
    plan = PLANS[kind](model, inputs)
    (rank,) = compile(model, A100, example_inputs=inputs, plan=plan).verify().ranks
    print(f"\n{kind}: predicted {rank.predicted.peak / 2**20:.1f} MiB, measured {rank.measured.peak / 2**20:.1f} MiB")
    assert rank.predicted.peak == pytest.approx(plan.predicted_peak_memory)
    assert rank.predicted.peak == pytest.approx(rank.measured.peak, rel=0.10)


def _saved(cap, target):
    return [n.meta["autopar_saved"] for n in cap.graph_module.graph.nodes if n.target == target]


def test_capture_records_saved_tensors_shared_between_the_nodes_that_keep_them():
    model, inputs = small_llama()
    cap = capture(model, (), kwargs=inputs)
    linear = _saved(cap, torch.ops.aten.linear.default)
    # q, k and v keep one normed input: a third each; the weight (a parameter) is not counted
    assert [(p.where, p.index, p.share) for p in linear[0]] == [("input", 0, pytest.approx(1 / 3))]
    assert all(p.elements == 1.0 for saved in linear for p in saved)
    # a cross entropy keeps its log-probabilities: one tensor of its logits' size
    (loss,) = _saved(cap, torch.ops.aten.cross_entropy_loss.default)
    assert sum(p.elements for p in loss if p.where == "input" and p.index == 0) == pytest.approx(1.0)
    backward = [n.meta["autopar_backward"] for n in cap.graph_module.graph.nodes
                if n.target == torch.ops.aten.cross_entropy_loss.default]
    # its backward holds the gradients of the log-probabilities and of the logits at once, both
    # measured against the logits, and the loss's own gradient (one element of its output)
    assert sum(p.elements for p in backward[0] if (p.where, p.index) == ("input", 0)) == pytest.approx(2.0, rel=0.01)
    assert [p.elements for p in backward[0] if p.where == "output"] == [1.0]


def test_a_plan_whose_step_peaks_above_the_limit_is_not_returned_as_fitting():
    """FSDP's linear sum (states + saved activations) fits 29 MiB; its step (with the loss's
    backward in flight) peaks at about 33 MiB: the planner must not call that plan fitting."""
    model, inputs = small_llama()
    limit = 29 * 2**20
    cluster = dataclasses.replace(A100, device_memory=limit / Options().memory_fraction)
    try:
        plan = baselines.fsdp(model, cluster, example_inputs=inputs)
    except InfeasibleError as exc:
        assert exc.smallest_peak > limit
    else:
        assert plan.predicted_peak_memory <= limit


def _measured_within_ten_percent(model, inputs, plan):
    (rank,) = compile(model, A100, example_inputs=inputs, plan=plan).verify().ranks
    print(f"\npredicted {rank.predicted.peak / 2**20:.1f} MiB, measured {rank.measured.peak / 2**20:.1f} MiB")
    assert rank.predicted.peak == pytest.approx(plan.predicted_peak_memory)
    assert rank.predicted.peak == pytest.approx(rank.measured.peak, rel=0.10)


def test_moe_under_fsdp_counts_the_expert_weights_gradients_at_the_gathered_size():
    """The experts' batched matmuls run on gathered weights: their backward makes a weight
    gradient as large as the whole weight while the activations' gradients are split 8 ways."""
    model, (args, kwargs) = zoo.moe(d_model=512, ffn=2048, experts=8, top_k=2, layers=2, seq=256, batch=8,
                                    device="meta")
    inputs = {"x": args[0], **kwargs}
    _measured_within_ten_percent(model, inputs, baselines.fsdp(model, A100, example_inputs=inputs))


class TwoReaders(nn.Module):
    """``h`` is saved by ``sin`` and by ``down``."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 1024, bias=False)
        self.down = nn.Linear(1024, 256, bias=False)

    def forward(self, x):
        h = self.up(x)
        return h.sin().sum() + self.down(h).sum()


def test_a_saved_tensor_resharded_for_a_consumer_that_saves_it_is_held_twice():
    """``h`` split over the batch is saved by ``sin``; ``down`` takes it whole (all-gathered) and
    saves that copy too: both copies live until the backward, not one shared between them."""
    with torch.device("meta"):
        model = TwoReaders()
    x = torch.empty(8192, 256, device="meta")
    split, whole = (Replicate(), Shard(0)), (Replicate(), Replicate())  # over the 1 x 8 mesh
    wanted = {"linear": lambda s: tuple(s.outputs[0]) == split, "sin": lambda s: tuple(s.inputs[0]) == split,
              "linear_1": lambda s: tuple(s.inputs[0]) == whole}
    plan = plan_intra(capture(model, (x,)), A100, Options(),
                      allow=lambda graph, n, s: wanted.get(graph.nodes[n].name, lambda s: True)(s))
    assert (plan.node("sin").inputs[0], plan.node("linear_1").inputs[0]) == ("R,S(0)", "R,R")
    _measured_within_ten_percent(model, (x,), plan)
