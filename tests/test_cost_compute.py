"""Compute cost: FLOPs and bytes per op by hand, the roofline on local shapes, dtype awareness,
and whole-graph FLOPs of GPT models against the Megatron-LM paper's formula."""

import warnings

import pytest
import torch

from autopar import zoo
from autopar.core.ir import OpSpec, Strategy, TensorMeta
from autopar.core.placement import Partial, Replicate, Shard
from autopar.cost_models.compute import (
    compute_time,
    graph_flops,
    node_bytes,
    node_flops,
    op_class,
    roofline_time,
)
from autopar.cost_models.devices import DeviceSpec, device_spec
from autopar.passes.capture import capture

aten = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16


def T(*shape, dtype=F32):
    return TensorMeta(tuple(shape), dtype)


def spec(op, args, outs, kwargs=None):
    return OpSpec(op, tuple(args), kwargs or {}, tuple(outs))


@pytest.mark.parametrize("s, fwd", [
    (spec(aten.mm.default, [T(64, 32), T(32, 16)], [T(64, 16)]), 2 * 64 * 32 * 16),
    (spec(aten.addmm.default, [T(16), T(64, 32), T(32, 16)], [T(64, 16)]), 2 * 64 * 32 * 16),
    (spec(aten.bmm.default, [T(3, 64, 32), T(3, 32, 16)], [T(3, 64, 16)]), 3 * 2 * 64 * 32 * 16),
    (spec(aten.linear.default, [T(4, 8, 32), T(16, 32), T(16)], [T(4, 8, 16)]), 2 * 32 * 32 * 16),
    (spec(aten.conv2d.default, [T(2, 3, 16, 16), T(8, 3, 3, 3), T(8), [1, 1], [1, 1]], [T(2, 8, 16, 16)]),
     2 * (2 * 16 * 16) * 8 * (3 * 3 * 3)),
])
def test_matmul_like_flops_by_hand(s, fwd):
    assert node_flops(s) == (fwd, 2 * fwd)   # backward: gradient of each of the two operands


def test_an_input_that_needs_no_gradient_gets_no_gemm_in_backward():
    mm = spec(aten.mm.default, [T(64, 32), T(32, 16)], [T(64, 16)])
    fwd = 2 * 64 * 32 * 16
    assert node_flops(mm, (False, True)) == (fwd, fwd)  # a first layer: only the weight's gradient
    assert node_flops(mm, (False, False)) == (fwd, 0)


def test_attention_flops_as_the_counter_counts_the_fused_kernels():
    # QK^T and PV, each 2*B*H*L*S*E (the counter does not halve causal attention); the fused
    # kernels' backward recomputes QK^T and computes dV, dP, dQ, dK: five GEMMs
    sdpa = spec(aten.scaled_dot_product_attention.default, [T(2, 4, 32, 8)] * 3, [T(2, 4, 32, 8)],
                {"is_causal": True})
    gemm = 2 * 2 * 4 * 32 * 32 * 8
    assert node_flops(sdpa) == (2 * gemm, 4 * gemm)  # the model's FLOPs, as Megatron counts them
    assert node_flops(sdpa, executed=True) == (2 * gemm, 5 * gemm)
    assert node_flops(sdpa, (False, False, False), executed=True) == (2 * gemm, 0)


@pytest.mark.parametrize("mask_grad, dropout", [(False, 0.0), (True, 0.0), (False, 0.1)])
def test_attention_flops_are_what_the_counter_counts_on_the_kernel_torch_picks(mask_grad, dropout):
    """A mask that needs a gradient (Doge's learned one) or dropout sends attention to plain GEMMs:
    a backward of four, as the counter counts them on the CPU where verify runs programs."""
    from autopar.runtime.verify.fake import flop_counter

    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 4, 32, 32, requires_grad=mask_grad)
    with flop_counter() as counter:  # as verify counts
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout).sum().backward()
    sdpa = spec(aten.scaled_dot_product_attention.default, [T(2, 4, 32, 8)] * 3 + [T(2, 4, 32, 32)],
                [T(2, 4, 32, 8)], {"dropout_p": dropout})
    assert sum(node_flops(sdpa, (True, True, True, mask_grad), executed=True)) == counter.get_total_flops()


def test_memory_bound_ops_by_rule():
    add = spec(aten.add.Tensor, [T(10, 20), T(10, 20)], [T(10, 20)])
    assert node_flops(add) == (200, 400)
    assert node_bytes(add) == (3 * 200 * 4, 2 * 3 * 200 * 4)
    assert node_bytes(add, dtype=BF16) == (3 * 200 * 2, 2 * 3 * 200 * 2)
    eq = spec(aten.eq.Tensor, [T(10, 20), T(10, 20)], [T(10, 20, dtype=torch.bool)])
    assert node_flops(eq)[1] == 0 and node_bytes(eq)[1] == 0      # no gradient through a compare
    view = spec(aten.view.default, [T(10, 20), [200]], [T(200)])
    assert node_flops(view) == (0, 0) and node_bytes(view) == (0, 0)
    emb = spec(aten.embedding.default, [T(1000, 64), T(4, 8, dtype=torch.long)], [T(4, 8, 64)])
    assert node_bytes(emb)[0] == 2 * 4 * 8 * 64 * 4 + 4 * 8 * 8    # rows read + written, indices
    softmax = spec(aten._softmax.default, [T(8, 128), -1, False], [T(8, 128)])
    assert op_class(softmax.op) == "softmax" and node_flops(softmax)[0] == 5 * 8 * 128


# A device where the roofline is exact arithmetic: no overhead, no size penalty, efficiency 1.
IDEAL = DeviceSpec(name="ideal", peak_flops=(("fp32", 1e12), ("bf16", 4e12)), vector_flops=1e11,
                   memory_bytes=2**30, memory_bandwidth=1e11,
                   efficiency=tuple((c, 1.0) for c in ("matmul", "copy", "elementwise")),
                   matmul_half_dim=0.0, op_overhead=0.0)


def test_compute_time_costs_local_shapes():
    x, w = T(64, 512, 1024), T(4096, 1024)
    lin = spec(aten.linear.default, [x, w], [T(64, 512, 4096)])
    flops = 2 * 64 * 512 * 1024 * 4096
    assert compute_time(lin, None, (1,), IDEAL) == pytest.approx((flops / 1e12, 2 * flops / 1e12))
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    batch = Strategy(inputs=((S0, R), (R, R)), outputs=((S0, R),))          # data parallel x tensor
    col = Strategy(inputs=((S0, R), (R, S0)), outputs=((S0, Shard(2)),))    # + column parallel
    row = Strategy(inputs=((R, Shard(2)), (R, S1)), outputs=((R, Partial()),))
    assert compute_time(lin, batch, (2, 4), IDEAL)[0] == pytest.approx(flops / 2 / 1e12)
    assert compute_time(lin, col, (2, 4), IDEAL)[0] == pytest.approx(flops / 8 / 1e12)
    assert compute_time(lin, row, (2, 4), IDEAL)[0] == pytest.approx(flops / 4 / 1e12)


def test_roofline_is_dtype_aware_and_memory_bound_where_it_should_be():
    a100 = device_spec("A100-80GB")
    mm = spec(aten.mm.default, [T(8192, 8192), T(8192, 8192)], [T(8192, 8192)])
    mm16 = spec(aten.mm.default, [T(8192, 8192, dtype=BF16)] * 2, [T(8192, 8192, dtype=BF16)])
    flops, eff = 2 * 8192**3, 0.75 * 8192 / (8192 + 64)   # min GEMM dim 8192, half-dim 64
    t32, t16 = compute_time(mm, None, (1,), a100)[0], compute_time(mm16, None, (1,), a100)[0]
    assert t32 == pytest.approx(5e-6 + flops / (19.5e12 * eff))
    assert t16 == pytest.approx(5e-6 + flops / (312e12 * eff))
    # mixed precision: the fp32-captured op costed in bf16 runs at the bf16 peak
    assert compute_time(mm, None, (1,), a100, dtype=BF16)[0] == pytest.approx(t16)
    add = spec(aten.add.Tensor, [T(10**8), T(10**8)], [T(10**8)])
    assert compute_time(add, None, (1,), a100)[0] == pytest.approx(5e-6 + 12e8 / (2039e9 * 0.8))
    assert roofline_time(flops=0, nbytes=0, op_cls="elementwise", dtype="fp32", device=a100) == 0.0
    assert roofline_time(flops=10**9, nbytes=0, op_cls="matmul", dtype="fp32", device=a100,
                         min_dim=64) == pytest.approx(5e-6 + 1e9 / (19.5e12 * 0.75 * 0.5))


def _megatron_eq3_no_recompute(B, s, l, h, V):
    """Narayanan et al. 2021 (arXiv:2104.04473) Eq. 3 is 96 B s l h^2 (1 + s/6h + V/16lh) with
    activation recomputation (4 forward-equivalents per layer); without it the layers cost 3
    (forward + backward = 3 x forward) and the logits 3: 72 B s l h^2 (1 + s/6h + V/12lh)."""
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


@pytest.mark.parametrize("h, heads, layers, seq, batch", [
    (768, 12, 2, 1024, 2),     # GPT-2 small width
    (1600, 25, 2, 1024, 1),    # GPT-2 XL width
    (2560, 32, 2, 2048, 1),    # GPT-3 2.7B width and context
], ids=["h768", "h1600", "h2560"])
def test_gpt_flops_match_megatron_formula(h, heads, layers, seq, batch):
    """Sum of counted FLOPs over the captured training graph of HF GPT-2 (on the meta device,
    with the loss, so the logits and cross-entropy are in the graph).

    Megatron counts the matmuls of the layers (QKV, projection, MLP, QK^T, PV) and the logits;
    the graph also has layer norms, GELU, dropout, adds, the embedding and the loss, costed by
    rule (a few FLOPs per element): they add 0.1-0.5 %, inside the 2 % bound. SDPA is counted as
    its two GEMMs, unhalved under the causal mask, as Megatron counts it.
    """
    V = 50257
    model, ((ids,), kwargs) = zoo.gpt2(layers=layers, hidden=h, heads=heads, vocab=V, seq=seq,
                                       batch=batch, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, (ids,), kwargs=kwargs)
    fwd, bwd = graph_flops(captured.graph_module)
    expected = _megatron_eq3_no_recompute(batch, seq, layers, h, V)
    assert (fwd + bwd) / expected == pytest.approx(1.0, rel=0.02)
    assert bwd / fwd == pytest.approx(2.0, rel=0.01)


def test_localize_maps_tensors_in_pytree_order():
    from autopar.cost_models.compute import localize

    cat = spec(aten.cat.default, [[T(8, 4), T(8, 6)], 1], [T(8, 10)])
    strat = Strategy(inputs=((Shard(0),), (Replicate(),)), outputs=((Shard(0),),))
    local = localize(cat, strat, (4,))
    assert [m.shape for m in local.inputs] == [(2, 4), (8, 6)] and local.outputs == (T(2, 10),)
    assert isinstance(local.args[0], list) and local.args[1] == 1


def test_a_grouped_convolution_counts_its_weight_gradient_as_many_flops_as_its_forward():
    """torch's counter takes a grouped conv's weight gradient for a dense one (a depthwise conv's
    backward 13x its forward at 12 channels); planning and verify count it with flop_formulas."""
    depthwise = spec(aten.conv2d.default, [T(4, 12, 16, 16), T(12, 1, 7, 7), None, [1, 1], [3, 3], [1, 1], 12],
                     [T(4, 12, 16, 16)])
    fwd = 2 * (4 * 16 * 16) * 12 * (7 * 7)
    assert node_flops(depthwise) == (fwd, 2 * fwd)


def test_a_convolution_split_by_whole_groups_is_costed_with_the_groups_it_runs():
    from autopar.cost_models.compute import localize
    from autopar.planner.costs import executed_flops

    depthwise = spec(aten.conv2d.default, [T(4, 12, 16, 16), T(12, 1, 7, 7), None, [1, 1], [3, 3], [1, 1], 12],
                     [T(4, 12, 16, 16)])
    channels = Strategy(inputs=((Shard(1),), (Shard(0),)), outputs=((Shard(1),),), local="groups")
    assert localize(depthwise, channels, (4,)).args[6] == 3
    assert executed_flops(depthwise, channels, (4,)) == sum(node_flops(depthwise)) / 4
