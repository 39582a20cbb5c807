"""The chunked gated delta rule captured as one scan node (passes/capture/delta_rule.py): the op
and its hand-written backward equal the loop under autograd, the replacement gives
transformers' numbers, the graph no longer grows with the sequence, and its costs count the
kernels it runs."""

from __future__ import annotations

import pytest
import torch

from autopar.cost_models.compute import node_bytes, node_flops
from autopar.core.ir import spec_of_call
from autopar.passes.capture import capture
from autopar.passes.capture.delta_rule import chunk_delta_scan, chunk_gated_delta_rule, delta_scan_forward

SHAPES = dict(batch=2, heads=3, chunks=5, chunk=4, key=3, value=2)


def _scan_inputs(seed: int, batch, heads, chunks, chunk, key, value):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, chunks, chunk, key), (batch, heads, chunks, chunk, key),
              (batch, heads, chunks, chunk, value), (batch, heads, chunks, chunk, key),
              (batch, heads, chunks, chunk, chunk), (batch, heads, chunks), (batch, heads, key, value)]
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    args[5] = torch.rand(shapes[5], generator=g, dtype=torch.float64)  # decays in (0, 1)
    return [a.requires_grad_(True) for a in args]


@pytest.mark.parametrize("seed", range(3))
def test_the_op_and_its_backward_equal_the_loop_under_autograd(seed):
    args = _scan_inputs(seed, **SHAPES)
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


def test_an_unused_final_state_gets_no_gradient_and_the_op_passes_gradcheck():
    args = [a.detach()[:1, :1, :3].clone().requires_grad_(True) if a.ndim == 5 else a for a in _scan_inputs(7, **SHAPES)]
    args[5] = args[5].detach()[:1, :1, :3].clone().requires_grad_(True)
    args[6] = args[6].detach()[:1, :1].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: chunk_delta_scan(*a)[0], args)
    assert torch.autograd.gradcheck(lambda *a: chunk_delta_scan(*a)[1], args)


pytest.importorskip("transformers")

from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next  # noqa: E402

from autopar.zoo_hf import architectures, build  # noqa: E402


@pytest.mark.parametrize("length, k_heads, v_heads, with_state", [(13, 2, 2, False), (16, 1, 2, True), (37, 2, 4, True)])
def test_the_replacement_gives_transformers_numbers(length, k_heads, v_heads, with_state):
    """fp32, chunk 8: padding, grouped value heads, a state carried in and out."""
    g = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, k_heads, 4, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, length, v_heads, 3, generator=g, requires_grad=True)
    decay = (-torch.rand(2, length, v_heads, generator=g)).requires_grad_(True)
    beta = torch.rand(2, length, v_heads, generator=g).requires_grad_(True)
    state = torch.randn(2, v_heads, 4, 3, generator=g, requires_grad=True) if with_state else None
    leaves = [q, k, v, decay, beta] + ([state] if with_state else [])
    kwargs = dict(g=decay, beta=beta, chunk_size=8, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    want_out, want_state = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, **kwargs)
    got_out, got_state = chunk_gated_delta_rule(q, k, v, **kwargs)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-6)
    weights = torch.randn(want_out.shape, generator=g)
    want = torch.autograd.grad((want_out * weights).sum() + want_state.sum(), leaves)
    got = torch.autograd.grad((got_out * weights).sum() + got_state.sum(), leaves)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


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
