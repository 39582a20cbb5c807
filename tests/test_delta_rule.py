"""The chunked gated delta rule captured as one scan node (passes/capture/delta_rule.py): the op
and its hand-written backward equal the loop under autograd (a decay per head, or per head and
key dim as Kimi's delta attention has), the replacements give transformers' numbers, the graph no longer grows with the sequence, and its costs count the
kernels it runs."""

from __future__ import annotations

import pytest
import torch

from autopar.core.ir import spec_of_call
from autopar.cost_models.compute import node_bytes, node_flops
from autopar.passes.capture import capture
from autopar.passes.capture.delta_rule import (
    chunk_delta_scan,
    chunk_gated_delta_rule,
    chunk_kimi_delta_attention,
    delta_scan_forward,
)

SHAPES = dict(batch=2, heads=3, chunks=5, chunk=4, key=3, value=2)


def _scan_inputs(seed: int, batch, heads, chunks, chunk, key, value, per_key=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, chunks, chunk, key), (batch, heads, chunks, chunk, key),
              (batch, heads, chunks, chunk, value), (batch, heads, chunks, chunk, key),
              (batch, heads, chunks, chunk, chunk), (batch, heads, chunks) + (key,) * per_key, (batch, heads, key, value)]
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    args[5] = torch.rand(shapes[5], generator=g, dtype=torch.float64)  # decays in (0, 1)
    return [a.requires_grad_(True) for a in args]


@pytest.mark.parametrize("seed, per_key", [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_the_op_and_its_backward_equal_the_loop_under_autograd(seed, per_key):
    args = _scan_inputs(seed, **SHAPES, per_key=per_key)
    g = torch.Generator().manual_seed(100 + seed)
    weights = torch.randn(args[2].shape, generator=g, dtype=torch.float64)
    state_weights = torch.randn(args[6].shape, generator=g, dtype=torch.float64)
    want_out, want_state, _ = delta_scan_forward(*args)
    got_out, got_state = chunk_delta_scan(*args)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_state, want_state, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad((want_out * weights).sum() + (want_state * state_weights).sum(), args)
    got = torch.autograd.grad((got_out * weights).sum() + (got_state * state_weights).sum(), args)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("per_key", [False, True])
def test_an_unused_final_state_gets_no_gradient_and_the_op_passes_gradcheck(per_key):
    inputs = _scan_inputs(7, **SHAPES, per_key=per_key)
    args = [a.detach()[:1, :1, :3].clone().requires_grad_(True) if a.ndim == 5 else a for a in inputs]
    args[5] = args[5].detach()[:1, :1, :3].clone().requires_grad_(True)
    args[6] = args[6].detach()[:1, :1].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: chunk_delta_scan(*a)[0], args)
    assert torch.autograd.gradcheck(lambda *a: chunk_delta_scan(*a)[1], args)


pytest.importorskip("transformers")

from transformers.models.kimi_linear import modeling_kimi_linear as kimi_linear
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from autopar.zoo_hf import architectures, build


@pytest.mark.parametrize("length, k_heads, v_heads, with_state", [(13, 2, 2, False), (16, 1, 2, True), (37, 2, 4, True)])
def test_the_replacement_gives_transformers_numbers(length, k_heads, v_heads, with_state):
    """fp32, chunk 8: padding, grouped value heads, a state carried in and out."""
    g = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, k_heads, 4, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, length, v_heads, 3, generator=g, requires_grad=True)
    decay = (-torch.rand(2, length, v_heads, generator=g)).requires_grad_(True)
    beta = torch.rand(2, length, v_heads, generator=g).requires_grad_(True)
    state = torch.randn(2, v_heads, 4, 3, generator=g, requires_grad=True) if with_state else None
    _same_numbers(qwen3_next.torch_chunk_gated_delta_rule, chunk_gated_delta_rule, g, q, k, v, decay, beta, state)


def _same_numbers(model_fn, replacement, g, q, k, v, decay, beta, state):
    """Outputs, final states and every input's gradient of ``replacement`` equal ``model_fn``'s
    (chunk 8, l2-normalised queries and keys, a state carried out)."""
    leaves = [q, k, v, decay, beta] + ([state] if state is not None else [])
    kwargs = {"g": decay, "beta": beta, "chunk_size": 8, "initial_state": state, "output_final_state": True,
              "use_qk_l2norm_in_kernel": True}
    want_out, want_state = model_fn(q, k, v, **kwargs)
    got_out, got_state = replacement(q, k, v, **kwargs)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-6)
    weights = torch.randn(want_out.shape, generator=g)
    want = torch.autograd.grad((want_out * weights).sum() + want_state.sum(), leaves)
    got = torch.autograd.grad((got_out * weights).sum() + got_state.sum(), leaves)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length, with_state", [(13, False), (16, True), (37, True)])
def test_the_kda_replacement_gives_transformers_numbers(length, with_state):
    """Kimi's delta attention, fp32, chunk 8: a log decay per token, head and key dim; padding,
    a state carried in and out."""
    g = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, 3, 4, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, length, 3, 5, generator=g, requires_grad=True)
    decay = (-0.3 * torch.rand(2, length, 3, 4, generator=g)).requires_grad_(True)
    beta = torch.rand(2, length, 3, generator=g).requires_grad_(True)
    state = torch.randn(2, 3, 4, 5, generator=g, requires_grad=True) if with_state else None
    _same_numbers(kimi_linear.chunk_kimi_delta_attention, chunk_kimi_delta_attention, g, q, k, v, decay, beta, state)


def test_a_kda_models_graph_does_not_grow_with_the_sequence():
    """Kimi-Linear: its 64-row substitution and its chunks unrolled under export; now one scan
    node per KDA layer, and 128 tokens or 512 give one graph."""
    arch = next(a for a in architectures() if a.class_name == "KimiLinearForCausalLM")
    sizes = []
    for seq in (128, 512):
        model, inputs = build(arch, seq=seq, device="meta")
        graph = capture(model, (), kwargs=inputs).graph_module.graph
        scans = sum(n.target == torch.ops.autopar.chunk_delta_scan.default for n in graph.nodes)
        kda = sum(type(m).__name__ == "KimiLinearDeltaAttention" for m in model.modules())
        assert scans == kda > 0
        sizes.append(len(graph.nodes))
    assert sizes[0] == sizes[1]


def _qwen3_next(**kwargs):
    return build(next(a for a in architectures() if a.class_name == "Qwen3NextForCausalLM"), **kwargs)


def test_a_gated_delta_models_graph_does_not_grow_with_the_sequence():
    """The model's export branch unrolled its 64-row substitution and its chunks; now two chunks
    and eight give one graph, with one scan node per linear-attention layer."""
    sizes = []
    for seq in (128, 512):
        model, inputs = _qwen3_next(seq=seq, device="meta")
        graph = capture(model, (), kwargs=inputs).graph_module.graph
        scans = sum(n.target == torch.ops.autopar.chunk_delta_scan.default for n in graph.nodes)
        assert scans == sum(t == "linear_attention" for t in model.config.layer_types) > 0
        sizes.append(len(graph.nodes))
    assert sizes[0] == sizes[1]


def test_the_scan_is_costed_as_the_kernels_it_runs():
    """Four GEMMs per chunk forward; its backward recomputes the states and runs eight more."""
    b, h, n, c, dk, dv = 2, 4, 16, 64, 128, 96
    meta = [torch.empty(s, device="meta") for s in [(b, h, n, c, dk), (b, h, n, c, dk), (b, h, n, c, dv),
                                                   (b, h, n, c, dk), (b, h, n, c, c), (b, h, n), (b, h, dk, dv)]]
    spec = spec_of_call(torch.ops.autopar.chunk_delta_scan.default, tuple(meta), {}, chunk_delta_scan(*meta))
    gemms = 2 * b * h * n * (2 * c * dk * dv + c * c * dv + c * dk * dv)
    fwd, bwd = node_flops(spec)
    assert gemms < fwd < 1.05 * gemms
    assert 3 * gemms < bwd < 3.6 * gemms  # the forward again, then dv (2), dA, dq, dk, dkd, dS (2)
    fwd_bytes, bwd_bytes = node_bytes(spec)
    assert sum(t.numel() for t in meta) * 4 < fwd_bytes and bwd_bytes > 2 * fwd_bytes


@pytest.mark.slow
def test_plans_that_shard_the_delta_scan_train_like_one_process():
    """Qwen3-Next with one linear-attention and one attention layer on 2 ranks: FSDP shards the
    scan's batch; autopar's plan and Megatron tp=2 keep this tiny scan whole (sharding its heads
    costs more in collectives than it saves; the rule checker runs that strategy); all three
    match one process."""
    from one_process import sharded_op_mismatches

    model, inputs = _qwen3_next(batch=4, seq=16)
    wrong = sharded_op_mismatches(model, inputs, "autopar.chunk_delta_scan.default", sharding=("fsdp",))
    assert {name: why for name, why in wrong.items() if why} == {}
