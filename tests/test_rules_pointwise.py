"""Pointwise sharding rules: every op passes the rule checker, and the options are the right ones
(Partial only through linear arguments, broadcast dims replicated)."""

import pytest
import torch

from autopar.core.ir import OpSpec, Strategy, TensorMeta, spec_of_call
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules import pointwise
from autopar.passes.rules.registry import AxisOption, axis_options
from autopar.passes.rules.simulate import check_strategy

aten = torch.ops.aten
R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)

def options(op, *args, **kwargs):
    return set(axis_options(spec_of_call(op, args, kwargs, op(*args, **kwargs))))


def opt(ins, outs):
    return AxisOption(tuple(ins), tuple(outs))


def test_add_of_two_partials_is_partial_but_partial_plus_replicate_is_not():
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    got = options(aten.add.Tensor, x, y)
    assert opt([P, P], [P]) in got
    assert opt([P, R], [P]) not in got and opt([R, P], [P]) not in got
    assert opt([P, P], [P]) in options(aten.sub.Tensor, x, y, alpha=2)
    # a Python scalar added to a Partial would be added k times
    assert all(P not in o.inputs for o in options(aten.add.Tensor, x, 1.0))


def test_mul_takes_one_partial_factor_never_two():
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    got = options(aten.mul.Tensor, x, y)
    assert opt([P, R], [P]) in got and opt([R, P], [P]) in got
    assert opt([P, P], [P]) not in got
    assert opt([P], [P]) in options(aten.mul.Tensor, x, 0.5)  # HF GELU: mul by a Python float
    assert opt([P, R], [P]) in options(aten.div.Tensor, x, y + 3)
    assert opt([R, P], [P]) not in options(aten.div.Tensor, x, y + 3)


@pytest.mark.parametrize("op,args", [
    (aten.exp.default, ()), (aten.relu.default, ()), (aten.pow.Tensor_Scalar, (2,)),
    (aten.add.Scalar, (1.0,)), (aten.gt.Scalar, (0.0,)), (aten.rsqrt.default, ()),
], ids=str)
def test_nonlinear_ops_offer_no_partial(op, args):
    got = options(op, torch.rand(8, 16) + 0.5, *args)
    assert not any(P in o.inputs or P in o.outputs for o in got)
    assert opt([S0], [S0]) in got and opt([S1], [S1]) in got


def test_broadcast_dims_of_size_one_stay_replicated():
    got = options(aten.add.Tensor, torch.randn(2, 8, 16), torch.randn(1, 8, 16))  # GPT-2 h + wpe
    assert opt([S0, R], [S0]) in got
    assert opt([S1, S1], [S1]) in got and opt([S2, S2], [S2]) in got
    assert not any(o.inputs[1] == S0 for o in got)
    got = options(aten.mul.Tensor, torch.randn(8, 16), torch.randn(16))  # missing leading dim
    assert got - {opt([R, R], [R])} == {opt([S0, R], [S0]), opt([S1, S0], [S1]), opt([P, R], [P]), opt([R, P], [P])}


def test_where_is_linear_in_both_branches_with_a_replicated_condition():
    cond, x = torch.rand(1, 1, 8, 8) > 0.5, torch.randn(2, 2, 8, 8)
    got = options(aten.where.self, cond, x, torch.tensor(-1e4))
    assert opt([R, P, P], [P]) in got
    assert opt([R, P, R], [P]) not in got
    assert opt([R, S0, R], [S0]) in got  # the [1, 1, 8, 8] condition broadcasts on dim 0
    assert opt([S2, S2, R], [S2]) in got


def test_masked_fill_keeps_partial_only_when_filling_zero_or_a_partial_value():
    x, m = torch.randn(8, 16), torch.rand(8, 16) > 0.5
    assert opt([P, R], [P]) in options(aten.masked_fill.Scalar, x, m, 0.0)
    assert opt([P, R], [P]) not in options(aten.masked_fill.Scalar, x, m, -1e4)
    assert opt([P, R, P], [P]) in options(aten.masked_fill.Tensor, x, m, torch.tensor(-1e4))
    assert opt([P, R, R], [P]) not in options(aten.masked_fill.Tensor, x, m, torch.tensor(-1e4))


def test_copies_pass_partial_only_when_nothing_is_lost():
    x = torch.randn(8, 16)
    assert opt([P], [P]) in options(aten._to_copy.default, x, dtype=torch.float64)
    assert opt([P], [P]) not in options(aten._to_copy.default, x, dtype=torch.bfloat16)
    ints = options(aten._to_copy.default, torch.randint(0, 2, (2, 8)), dtype=torch.bool)
    assert opt([S1], [S1]) in ints and opt([P], [P]) not in ints
    assert opt([P], [P]) in options(aten.clone.default, x) and opt([P], [P]) in options(aten.alias.default, x)


def test_dropout_is_identity_like_and_native_dropout_replicates_its_mask_under_partial():
    # split options keep their piece of the whole tensor's mask (one device's), drawn on each rank
    whole = lambda ins, outs: AxisOption(tuple(ins), tuple(outs), local="global_mask")  # noqa: E731
    got = options(aten.native_dropout.default, torch.randn(2, 8, 16), 0.1, True)
    assert whole([P], [P, R]) in got and whole([S1], [S1, S1]) in got
    assert whole([P], [P]) in options(aten.dropout.default, torch.randn(8, 16), 0.1, True)


def test_comparisons_and_logical_ops_shard_but_never_take_partial():
    for op, args in [
        (aten.le.Tensor, (torch.arange(8).view(1, 1, 1, 8), torch.arange(8).view(1, 1, 8, 1))),
        (aten.__and__.Tensor, (torch.tensor(True), torch.rand(1, 1, 8, 8) > 0.5)),
        (aten.eq.Tensor, (torch.randn(8, 16), torch.randn(8, 16))),
    ]:
        got = options(op, *args)
        assert len(got) > 1
        assert not any(P in o.inputs or P in o.outputs for o in got)
    got = options(aten.le.Tensor, torch.arange(8).view(1, 1, 1, 8), torch.arange(8).view(1, 1, 8, 1))
    assert opt([R, S2], [S2]) in got and opt([S3 := Shard(3), R], [S3]) in got


def test_tensor_arg_names_follow_the_schema_for_positional_keyword_and_missing_tensors():
    spec = spec_of_call(aten.masked_fill.Tensor, (torch.randn(8), torch.rand(8) > 0), {"value": torch.tensor(0.0)},
                        torch.randn(8))
    assert pointwise.tensor_arg_names(spec) == ["self", "mask", "value"]
    spec = spec_of_call(aten.add.Tensor, (torch.randn(8), 2.0), {}, torch.randn(8))
    assert pointwise.tensor_arg_names(spec) == ["self"]


@pytest.mark.parametrize("op,args,ins,outs", [
    (aten.add.Tensor, (torch.randn(8, 16), torch.randn(8, 16)), [P, R], [P]),
    (aten.mul.Tensor, (torch.randn(8, 16), torch.randn(8, 16)), [P, P], [P]),
    (aten.exp.default, (torch.randn(8, 16),), [P], [P]),
    (aten.masked_fill.Scalar, (torch.randn(8, 16), torch.rand(8, 16) > 0.5, -1e4), [P, R], [P]),
    (aten.add.Tensor, (torch.randn(8, 16), 1.0), [P], [P]),
], ids=["add(P,R)", "mul(P,P)", "exp(P)", "masked_fill(P,-1e4)", "add(P,1.0)"])
def test_the_checker_rejects_the_options_the_rules_leave_out(op, args, ins, outs):
    strat = Strategy(tuple((p,) for p in ins), tuple((p,) for p in outs))
    with pytest.raises(AssertionError, match="differs"):
        check_strategy(op, args, {}, strat, (2,))


def test_copy_into_a_buffer_shards_like_an_elementwise_op():
    buf, src = torch.zeros(8, 16), torch.randn(16)
    got = options(aten.copy_.default, buf, src)
    assert got == {opt([R, R], [R]), opt([S0, R], [S0]), opt([S1, S0], [S1]), opt([P, P], [P])}
    # a node without output metadata (unlifted buffer update) gets only the replicated option
    bare = OpSpec(aten.copy_.default, (TensorMeta((8,), torch.float32), TensorMeta((8,), torch.float32)))
    assert pointwise.elementwise_options(bare) == []
