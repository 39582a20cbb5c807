"""Time-step recurrences captured as one parallel-scan node (passes/capture/scan.py): the scan
equals the loop, transformers' Mamba family gives the model's numbers through it, its graph no
longer grows with the sequence, and plans that shard the scan train like one process."""

from __future__ import annotations

import pytest
import torch

from autopar.cost_models.compute import node_bytes, node_flops
from autopar.core.ir import spec_of_call
from autopar.passes.capture import capture
from autopar.passes.capture.scan import linear_scan, parallel_scans, recurrences
from autopar.passes.capture.training import capture_for_training
from autopar.planner.layers import FIRST, LAYER, POST, PRE, split_layers, window
from one_process import sharded_op_mismatches


def _loop(a, b, dim):
    """The recurrence as the models write it: one step at a time."""
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    h, out = torch.zeros_like(b[0]), []
    for t in range(a.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out).movedim(0, dim)


@pytest.mark.parametrize("length", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("dim", [1, -1])
def test_the_scan_and_its_gradients_equal_the_loop(length, dim):
    g = torch.Generator().manual_seed(length)
    shape = (2, length, 3, length)
    a = torch.rand(shape, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    want = _loop(a, b, dim)
    got = linear_scan(a, b, dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want_grads = torch.autograd.grad((want * weights).sum(), [a, b])
    got_grads = torch.autograd.grad((got * weights).sum(), [a, b])
    for x, y in zip(got_grads, want_grads):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_the_scan_is_costed_as_the_kernels_it_runs():
    """Ten levels of pointwise kernels for 1,024 steps: about 7x the traffic of reading a and b
    and writing h once, 5 FLOPs per step."""
    a = torch.empty(2, 8, 1024, 4, device="meta")
    spec = spec_of_call(torch.ops.autopar.linear_scan.default, (a, a, 2), {}, a)
    flops, _ = node_flops(spec)
    fwd_bytes, bwd_bytes = node_bytes(spec)
    assert flops == 5 * (1024 - 1) * 2 * 8 * 4  # 2.5 per step at each level: 1,024 + 512 + ... + 2 steps
    assert 6 * 3 * a.numel() * 4 < fwd_bytes < 7 * 3 * a.numel() * 4 and bwd_bytes == 2 * fwd_bytes


pytest.importorskip("transformers")

from autopar.zoo_hf import architectures, build, config_of  # noqa: E402

RECURRENT = ["MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM", "ZambaForCausalLM",
             "RecurrentGemmaForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "OlmoHybridForCausalLM",
             "RwkvForCausalLM"]


def _model(name, **kwargs):
    return build(next(a for a in architectures() if a.class_name == name), **kwargs)


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_models_run_the_parallel_scan_with_the_models_numbers(name):
    """fp32, 37 tokens: measured differences up to 1.2e-6 in the logits, 5.4e-7 relative in the
    gradients (Mamba; RecurrentGemma 7e-7 and 5e-7)."""
    model, inputs = _model(name, seq=37)
    found = recurrences(model)
    own = [getattr(owner, name) for owner, name in found]
    out = model(**inputs)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    with parallel_scans(model):
        assert found and all(getattr(o, n) is not f for (o, n), f in zip(found, own))
        got = model(**inputs)
        got_grads = torch.autograd.grad(got.loss, list(model.parameters()), allow_unused=True)
    assert [getattr(o, n) for o, n in found] == own  # the model's own, restored
    torch.testing.assert_close(got.logits, out.logits, rtol=1e-5, atol=1e-5)
    for x, y in zip(got_grads, grads):
        if y is not None:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["MambaForCausalLM", "JambaForCausalLM", "RecurrentGemmaForCausalLM"])
def test_a_scanning_models_graph_does_not_grow_with_the_sequence(name):
    """The unrolled loops made about 9 nodes per token and layer (2 layers: Mamba 478 nodes at 16
    tokens, 766 at 32; RecurrentGemma 611 and 963); the scan is one node at any length."""
    sizes = []
    for seq in (16, 64):
        model, inputs = _model(name, seq=seq, device="meta")
        graph = capture(model, (), kwargs=inputs).graph_module.graph
        assert sum(n.target == torch.ops.autopar.linear_scan.default for n in graph.nodes) >= 1
        sizes.append(len(graph.nodes))
    assert sizes[0] == sizes[1]


def test_a_bf16_mamba_is_costed_from_a_window_of_its_layers():
    """Its first layer casts the residual to fp32 and the others do not (other ops, the same
    values handed on), which once sent every Mamba to the whole-graph window (8,480 nodes costed
    for each stage at full size)."""
    arch = next(a for a in architectures() if a.class_name == "MambaForCausalLM")
    config = config_of(arch)
    config.num_hidden_layers = 4
    model, inputs = build(arch, config=config, device="meta")
    captured = capture_for_training(model.to(torch.bfloat16), example_inputs=inputs)
    segments = split_layers(captured)
    assert segments is not None and segments.num_layers == 4
    assert [str(n.target) for n in segments.layers[0]] != [str(n.target) for n in segments.layers[1]]
    win = window(captured, segments)
    assert win.parts == (PRE, FIRST, LAYER, POST)
    assert len(win.graph.nodes) < len(captured.graph_module.graph.nodes)  # two layers of the four


@pytest.mark.slow
def test_plans_that_shard_the_scan_train_like_one_process():
    """autopar's plan and Megatron tp=2 shard the scan's channels, FSDP its batch."""
    model, inputs = _model("MambaForCausalLM", batch=4, seq=16)
    wrong = sharded_op_mismatches(model, inputs, "autopar.linear_scan.default")
    assert {name: why for name, why in wrong.items() if why} == {}
