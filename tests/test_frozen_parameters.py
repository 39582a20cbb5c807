"""Frozen parameters (``requires_grad=False``, e.g. fine-tuning the last layer): capture marks
them, plans hold them without gradient or optimizer state and sum, step or reduce none of their
gradients, their consumers keep nothing for a weight gradient, and a sharded frozen weight is
gathered again in backward like a trained one. Plans used to price every parameter as trained:
a LLaMA shape with one of two layers trained was predicted at 1.76x its measured peak under
data parallelism and 1.5x its FLOPs under FSDP."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.passes.capture import capture
from autopar.testing import run_programs
from models import ResidualStack
from one_process import adamw, check_sgd_and_adamw

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)


def _llama(layers=2):
    """A LLaMA shape whose last layer alone is trained."""
    model, (args, kwargs) = zoo.llama(layers=layers, hidden=256, heads=8, kv_heads=2, ffn=704, vocab=4096, seq=256,
                                      batch=8)
    for name, p in model.named_parameters():
        if f"layers.{layers - 1}." not in name:
            p.requires_grad_(False)
    return model, {"input_ids": args[0], **kwargs}


def test_capture_marks_frozen_parameters_and_layers_before_the_trained_one_keep_nothing():
    model, inputs = _llama()
    cap = capture(model, (), kwargs=inputs)
    assert {i.name for i in cap.inputs if i.frozen} == {n for n, p in model.named_parameters() if not p.requires_grad}
    kept = {}  # module -> whether its projections keep an activation (a weight is model state)
    for n in cap.graph_module.graph.nodes:
        if n.target == torch.ops.aten.linear.default:
            kept.setdefault(n.meta["autopar_module"].split(".self_attn")[0].split(".mlp")[0], set()).add(
                bool(n.meta.get("autopar_saved")))
    # layer 0 and the head are frozen, layer 0's input needs no gradient, the head's input gradient
    # needs only its weight: only the trained layer keeps its projections' inputs
    assert kept == {"model.layers.0": {False}, "model.layers.1": {True}, "lm_head": {False}}


PLANS = {
    "dp": lambda m, i: baselines.data_parallel(m, A100, example_inputs=i),
    "fsdp": lambda m, i: baselines.fsdp(m, A100, example_inputs=i),
    "tp=8": lambda m, i: baselines.megatron(m, A100, example_inputs=i, tp=8),
    "tp=2 pp=2": lambda m, i: baselines.megatron(m, A100, example_inputs=i, tp=2, pp=2),
}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_plans_with_frozen_parameters_predict_what_verify_measures(kind):
    model, inputs = _llama()
    plan = PLANS[kind](model, inputs)
    check = compile(model, A100, example_inputs=inputs, plan=plan).verify()
    for rank in check.ranks:
        assert rank.predicted.peak == pytest.approx(rank.measured.peak, rel=0.06)
        assert rank.collective_diff() in (None, (Counter(), Counter()))
        assert rank.flops_ratio == pytest.approx(1.0, abs=1e-3)
        if not plan.stages:
            assert rank.predicted.memory["gradients"] == rank.measured.memory["gradients"] == 0


def _frozen_stack():
    torch.manual_seed(0)
    net = ResidualStack(depth=3, width=16)
    for p in list(net.parameters())[:4]:
        p.requires_grad_(False)
    return net, torch.randn(8, 16), torch.randn(8, 16)


@pytest.mark.slow
def test_frozen_parameters_stay_and_the_rest_train_like_one_process_under_zero_fsdp_and_tensor_parallelism():
    net, x, y = _frozen_stack()
    local = Cluster.local(world_size=2)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    plans = {"zero1": baselines.data_parallel(net, local, zero=1, **kw), "fsdp": baselines.fsdp(net, local, **kw),
             "tp": baselines.megatron(net, local, tp=2, **kw)}
    programs = {name: compile(net, local.with_mesh(p.mesh_shape), plan=p, **kw) for name, p in plans.items()}
    results = run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=0.01, return_parameters=True)
    check_sgd_and_adamw(results, net, inputs=(x,), target=y, loss_fn=F.mse_loss, lr=0.01)
    frozen = {n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad}
    for per_optimizer in results.values():
        for _, params in per_optimizer:
            assert all(torch.equal(params[n], t) for n, t in frozen.items())


class _WithUnused(torch.nn.Module):
    """A residual stack beside a projection its forward never reads (as a decoder-only run of an
    encoder-decoder layer leaves its cross-attention)."""

    def __init__(self):
        super().__init__()
        self.stack = ResidualStack(depth=4, width=64)
        self.unused = torch.nn.Linear(64, 256)

    def forward(self, x):
        return self.stack(x)


@pytest.mark.parametrize("kind", ["dp", "pp"])
def test_a_parameter_no_op_reads_is_planned_and_measured_as_frozen(kind):
    torch.manual_seed(0)
    net, x, y = _WithUnused(), torch.randn(8, 64), torch.randn(8, 64)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    cap = capture(net, (x,))
    assert {i.name for i in cap.inputs if i.frozen} == {"unused.weight", "unused.bias"}
    local = Cluster.local(world_size=4)
    plan = (baselines.data_parallel(net, local, **kw) if kind == "dp"
            else baselines.megatron(net, local, tp=1, pp=2, micro_batches=2, **kw))
    unused = sum(p.numel() * p.element_size() for p in net.unused.parameters())
    for r in compile(net, local, plan=plan, **kw).verify().ranks:
        if r.measured.stage in (None, 0):  # the first stage stores what no stage reads
            assert r.predicted.memory["parameters"] > unused
        # weights held, no optimizer state for them (AdamW's 4-byte step counters are not priced)
        for kind_ in ("parameters", "optimizer"):
            assert r.predicted.memory[kind_] == pytest.approx(r.measured.memory[kind_], rel=1e-3), kind_
