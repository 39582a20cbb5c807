"""Reduction, scan and softmax sharding rules: every op passes the rule checker; reduced dims
give Partial only where local results add up (sum, mean through its global-count local op)."""

import pytest
import torch

from autopar.core.ir import Strategy, spec_of_call
from autopar.core.layout import local_context
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.reduction import global_mean
from autopar.passes.rules.registry import AxisOption, axis_options, strategies
from autopar.passes.rules.simulate import check_strategy

aten = torch.ops.aten
R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)

def options(op, *args, **kwargs):
    return set(axis_options(spec_of_call(op, args, kwargs, op(*args, **kwargs))))


def opt(ins, outs, local=None):
    return AxisOption(tuple(ins), tuple(outs), local)


def test_sum_over_a_sharded_dim_is_partial_and_kept_dims_move_when_others_vanish():
    x = torch.randn(2, 8, 16)
    got = options(aten.sum.dim_IntList, x, [1])
    assert got == {opt([R], [R]), opt([S0], [S0]), opt([S1], [P]), opt([S2], [S1]), opt([P], [P])}
    assert opt([S2], [S2]) in options(aten.sum.dim_IntList, x, [1], True)  # keepdim
    assert opt([S1], [P]) in options(aten.sum.default, torch.randn(8, 16))
    # integer sums are exact too; Partial input only for floats (the checker draws float pieces)
    got = options(aten.sum.dim_IntList, torch.rand(8, 16) > 0.5, [1])
    assert opt([S1], [P]) in got and opt([P], [P]) not in got


def test_mean_over_a_sharded_dim_needs_the_global_count():
    x = torch.randn(2, 8, 16)
    got = options(aten.mean.dim, x, [-1], True)  # LLaMA RMSNorm
    assert opt([S2], [P], "global_mean") in got
    assert opt([S2], [P]) not in got  # the plain op divides by the local count
    assert opt([S1], [S1]) in got and opt([P], [P]) in got
    plain = Strategy(((S2,),), ((P,),))
    with pytest.raises(AssertionError, match="differs"):
        check_strategy(aten.mean.dim, (x, [-1], True), {}, plain, (2,))
    check_strategy(aten.mean.dim, (x, [-1], True), {}, Strategy(((S2,),), ((P,),), "global_mean"), (2,))


def test_global_mean_is_exact_when_reduced_and_kept_dims_are_sharded_together():
    x = torch.randn(8, 8, 16)
    spec = spec_of_call(aten.mean.dim, (x, [0, 2]), {}, aten.mean.dim(x, [0, 2]))
    mixed = [s for s in strategies(spec, (2, 2, 2)) if s.local == "global_mean" and S1 in s.inputs[0]]
    assert len(mixed) >= 6, "strategies sharding a kept dim next to a reduced one must exist"
    for strat in mixed:
        check_strategy(aten.mean.dim, (x, [0, 2]), {}, strat, (2, 2, 2))


def test_global_mean_divides_the_local_sum_by_the_global_count():
    x = torch.arange(16.0).view(2, 8)
    strat = Strategy(((S1,),), ((P,),), "global_mean")
    ctx = local_context(input_shapes=[(2, 8)], output_shapes=[(2,)], strategy=strat, mesh_shape=(2,), coord=(1,))
    local = global_mean(aten.mean.dim, (x[:, 4:], [1]), {}, ctx)
    torch.testing.assert_close(local, x[:, 4:].sum(1) / 8)


def test_max_like_reductions_never_shard_the_reduced_dim():
    x = torch.randn(8, 16)
    for op, args in [(aten.amax.default, ([1],)), (aten.argmax.default, (1,)), (aten.var.correction, ([1],))]:
        got = options(op, x, *args)
        assert got == {opt([R], [R]), opt([S0], [S0])}, op
    got = options(aten.max.dim, x, 1, True)
    assert got == {opt([R], [R, R]), opt([S0], [S0, S0])}  # values and indices together
    assert options(aten.argmax.default, x) == {opt([R], [R])}  # dim=None: the flattened tensor


def test_scans_never_shard_their_own_dim():
    x = torch.randn(8, 16)
    assert options(aten.cumsum.default, x, 1) == {opt([R], [R]), opt([S0], [S0]), opt([P], [P])}
    got = options(aten.diff.default, x, 1, -1, torch.randn(8, 1), torch.randn(8, 8))
    assert got == {opt([R] * 3, [R]), opt([S0] * 3, [S0]), opt([P] * 3, [P])}


def test_softmax_shards_every_dim_but_its_own_and_takes_no_partial():
    scores = torch.randn(2, 2, 8, 8)
    got = options(aten._softmax.default, scores, -1, False)
    assert got == {opt([R], [R]), opt([S0], [S0]), opt([S1], [S1]), opt([S2], [S2])}
    assert opt([S0], [S0]) not in options(aten.softmax.int, torch.randn(8, 16), 0)
