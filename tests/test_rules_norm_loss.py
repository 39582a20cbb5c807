"""Norm and loss sharding rules: every op passes the rule checker; normalised dims and class
dims are never sharded, training batch norm shards channels only, mean-reduced class losses
are never sharded."""

import pytest
import torch

from autopar.core.ir import Strategy, spec_of_call
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import AxisOption, axis_options
from autopar.passes.rules.simulate import ReplicaMismatch, check_strategy

aten = torch.ops.aten
R, P = Replicate(), Partial()
S0, S1, S2, S3 = Shard(0), Shard(1), Shard(2), Shard(3)
NONE, MEAN, SUM = 0, 1, 2

def options(op, *args, **kwargs):
    return set(axis_options(spec_of_call(op, args, kwargs, op(*args, **kwargs))))


def opt(ins, outs, local=None):
    return AxisOption(tuple(ins), tuple(outs), local)


def test_layer_norm_never_shards_the_normalised_dims():
    x, w, b = torch.randn(2, 8, 16), torch.randn(16), torch.randn(16)
    got = options(aten.layer_norm.default, x, [16], w, b, 1e-5, False)  # as GPT-2 calls it
    assert got == {opt([R, R, R], [R]), opt([S0, R, R], [S0]), opt([S1, R, R], [S1])}
    got = options(aten.layer_norm.default, torch.randn(8, 2, 8), [2, 8])
    assert got == {opt([R], [R]), opt([S0], [S0])}
    got = options(aten.native_layer_norm.default, x, [16], w, b, 1e-5)
    assert opt([S1, R, R], [S1, S1, S1]) in got  # mean and rstd shard with the output
    assert not any(S2 in o.inputs for o in got)
    assert options(aten.rms_norm.default, x, [16], w, 1e-6) == {opt([R, R], [R]), opt([S0, R], [S0]), opt([S1, R], [S1])}


def _bn_args():
    return torch.randn(8, 8, 2, 2), torch.randn(8), torch.randn(8), torch.randn(8), torch.rand(8) + 0.5


def test_training_batch_norm_shards_channels_only():
    x, w, b, rm, rv = _bn_args()
    got = options(aten._native_batch_norm_legit_functional.default, x, w, b, rm, rv, True, 0.1, 1e-5)
    assert got == {opt([R] * 5, [R] * 5), opt([S1, S0, S0, S0, S0], [S1, S0, S0, S0, S0])}
    # sharding the batch would normalise each shard by its own statistics: the checker sees it
    batch = Strategy(((S0,), (R,), (R,), (R,), (R,)), ((S0,), (R,), (R,), (R,), (R,)))
    with pytest.raises(ReplicaMismatch):
        check_strategy(aten._native_batch_norm_legit_functional.default, (x, w, b, rm, rv, True, 0.1, 1e-5), {},
                       batch, (2,))


def test_evaluation_batch_norm_is_a_per_channel_affine_map_and_shards_any_dim():
    x, w, b, rm, rv = _bn_args()
    got = options(aten._native_batch_norm_legit_no_training.default, x, w, b, rm, rv, 0.1, 1e-5)
    assert opt([S1, S0, S0, S0, S0], [S1, R, R]) in got  # saved statistics are empty in eval
    assert opt([S0, R, R, R, R], [S0, R, R]) in got and opt([S2, R, R, R, R], [S2, R, R]) in got
    got = options(aten.batch_norm.default, x, w, b, rm, rv, False, 0.1, 1e-5, False)
    assert opt([S3, R, R, R, R], [S3]) in got


def test_cross_entropy_with_mean_reduction_is_never_sharded():
    logits, target = torch.randn(16, 5), torch.randint(0, 5, (16,))
    target[::3] = -100
    assert options(aten.cross_entropy_loss.default, logits, target) == {opt([R, R], [R])}
    # per-rank means over different numbers of non-ignored targets do not add up
    with pytest.raises(AssertionError, match="differs"):
        check_strategy(aten.cross_entropy_loss.default, (logits, target), {}, Strategy(((S0,), (S0,)), ((P,),)), (2,))


def test_cross_entropy_shards_batch_and_spatial_dims_never_classes():
    logits, target = torch.randn(16, 5), torch.randint(0, 5, (16,))
    assert options(aten.cross_entropy_loss.default, logits, target, None, SUM) == {
        opt([R, R], [R]), opt([S0, S0], [P])}
    assert options(aten.cross_entropy_loss.default, logits, target, None, NONE) == {
        opt([R, R], [R]), opt([S0, S0], [S0])}
    got = options(aten.cross_entropy_loss.default, torch.randn(8, 5, 8), torch.randint(0, 5, (8, 8)), reduction=NONE)
    assert got == {opt([R, R], [R]), opt([S0, S0], [S0]), opt([S2, S1], [S1])}
    probs = torch.softmax(torch.randn(16, 5), 1)  # probability targets shard with the logits
    assert opt([S0, S0, R], [P]) in options(aten.cross_entropy_loss.default, logits, probs, torch.rand(5), SUM)


def test_nll_loss_sum_gives_partial_loss_and_partial_total_weight():
    logp, target = torch.randn(16, 5).log_softmax(1), torch.randint(0, 5, (16,))
    assert opt([S0, S0], [P, P]) in options(aten.nll_loss_forward.default, logp, target, None, SUM, -100)
    assert opt([S0, S0], [S0, R]) in options(aten.nll_loss_forward.default, logp, target, None, NONE, -100)
    assert options(aten.nll_loss_forward.default, logp, target, None, MEAN, -100) == {opt([R, R], [R, R])}


def test_elementwise_loss_mean_is_partial_through_the_global_count():
    x, t = torch.randn(8, 16), torch.randn(8, 16)
    got = options(aten.mse_loss.default, x, t)
    assert opt([S0, S0], [P], "global_mean") in got and opt([S1, S1], [P], "global_mean") in got
    assert opt([S0, S0], [P]) not in got
    assert opt([S1, S1], [P]) in options(aten.mse_loss.default, x, t, SUM)
    got = options(aten.binary_cross_entropy_with_logits.default, x, t.sigmoid(), None, torch.rand(16), NONE)
    assert opt([S0, S0, R], [S0]) in got and opt([S1, S1, S0], [S1]) in got  # pos_weight per class
