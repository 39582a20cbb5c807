"""Matmul-like sharding rules (einsum machinery): every strategy checked on real tensors, plus
the Megatron/Alpa options written out by hand."""

import pytest
import torch

from autopar.core.errors import AutoparError
from autopar.core.ir import Strategy
from autopar.core.placement import P, R, Shard
from autopar.passes.rules import AxisOption, axis_options, spec_of_call, strategies
from autopar.passes.rules.einsum import parse_equation
from autopar.passes.rules.simulate import check_strategy

aten = torch.ops.aten

def _spec(op, *args, **kwargs):
    return spec_of_call(op, args, kwargs, op(*args, **kwargs))


def test_linear_offers_column_and_row_parallel():
    x, w, b = torch.randn(8, 8, 16), torch.randn(24, 16), torch.randn(24)
    opts = axis_options(_spec(aten.linear.default, x, w, b))
    column = AxisOption((R, Shard(0), Shard(0)), (Shard(2),))
    row = AxisOption((Shard(2), Shard(1), P), (P,))
    data = AxisOption((Shard(0), R, R), (Shard(0),))
    assert column in opts and row in opts and data in opts
    # the bias is never replicated under a Partial output: it would be added once per rank
    assert all(o.inputs[2] == P for o in opts if o.outputs[0] == P)


def test_linear_without_bias_and_with_1d_input():
    opts = axis_options(_spec(aten.linear.default, torch.randn(8, 16), torch.randn(24, 16)))
    assert AxisOption((R, Shard(0)), (Shard(1),)) in opts
    assert AxisOption((Shard(1), Shard(1)), (P,)) in opts
    opts = axis_options(_spec(aten.linear.default, torch.randn(16), torch.randn(24, 16), torch.randn(24)))
    assert AxisOption((R, Shard(0), Shard(0)), (Shard(0),)) in opts
    assert AxisOption((Shard(0), Shard(1), P), (P,)) in opts


def test_mm_never_multiplies_two_partial_inputs_on_one_axis():
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    spec = _spec(aten.mm.default, a, b)
    assert AxisOption((P, R), (P,)) in axis_options(spec)
    assert AxisOption((R, P), (P,)) in axis_options(spec)
    for mesh in [(2,), (2, 2)]:
        for strat in strategies(spec, mesh):
            for axis in range(len(mesh)):
                assert not (strat.inputs[0][axis] == P and strat.inputs[1][axis] == P), strat.name
    # and it would be wrong: (a1 + a2)(b1 + b2) is not a1 b1 + a2 b2
    with pytest.raises(AssertionError):
        check_strategy(aten.mm.default, (a, b), {}, Strategy(((P,), (P,)), ((P,),)), (2,))


def test_partial_inputs_on_different_axes_are_offered_and_exact():
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    strat = Strategy(((P, R), (R, P)), ((P, P),))
    assert strat in strategies(_spec(aten.mm.default, a, b), (2, 2))
    check_strategy(aten.mm.default, (a, b), {}, strat, (2, 2))


def test_addmm_bias_follows_the_output():
    bias, a, b = torch.randn(24), torch.randn(8, 16), torch.randn(16, 24)
    opts = axis_options(_spec(aten.addmm.default, bias, a, b))
    assert AxisOption((Shard(0), R, Shard(1)), (Shard(1),)) in opts  # column: bias sharded
    assert AxisOption((R, Shard(0), R), (Shard(0),)) in opts  # rows: 1-d bias broadcasts
    assert AxisOption((P, Shard(1), Shard(0)), (P,)) in opts
    assert AxisOption((R, Shard(1), Shard(0)), (P,)) not in opts
    # the excluded option really is wrong: the bias would be counted twice
    wrong = Strategy(((R,), (Shard(1),), (Shard(0),)), ((P,),))
    with pytest.raises(AssertionError):
        check_strategy(aten.addmm.default, (bias, a, b), {}, wrong, (2,))


def test_integer_addmm_offers_no_partial_bias():
    ints = lambda *s: torch.randint(-3, 3, s)  # noqa: E731
    opts = axis_options(_spec(aten.addmm.default, ints(8), ints(8, 16), ints(16, 8)))
    assert all(P not in o.inputs and P not in o.outputs for o in opts)
    assert AxisOption((Shard(0), R, Shard(1)), (Shard(1),)) in opts


def test_matmul_broadcast_batch_dim_keeps_the_size_one_operand_replicated():
    a, b = torch.randn(8, 1, 8, 16), torch.randn(8, 16, 8)
    opts = axis_options(_spec(aten.matmul.default, a, b))
    assert AxisOption((R, Shard(0)), (Shard(1),)) in opts  # out [8, 8, 8, 8]: dim 1 from b only
    assert AxisOption((Shard(0), R), (Shard(0),)) in opts
    assert AxisOption((Shard(3), Shard(1)), (P,)) in opts


def test_einsum_moe_dispatch_options():
    dispatch, x = torch.randn(16, 8, 8), torch.randn(16, 8)  # "sec,sm->ecm"
    opts = axis_options(_spec(aten.einsum.default, "sec,sm->ecm", [dispatch, x]))
    assert AxisOption((Shard(1), R), (Shard(0),)) in opts  # experts
    assert AxisOption((R, Shard(1)), (Shard(2),)) in opts  # model dim
    assert AxisOption((Shard(0), Shard(0)), (P,)) in opts  # tokens, contracted


def test_parse_equation_expands_ellipsis_right_aligned_and_implicit_output():
    eq = parse_equation("...ij,...jk->...ik", ndims=(4, 3))
    assert eq.inputs == (("…0", "…1", "i", "j"), ("…1", "j", "k"))
    assert eq.output == ("…0", "…1", "i", "k")
    eq = parse_equation("ba,ac", ndims=(2, 2))
    assert eq.output == ("b", "c")
    assert parse_equation("ii->i", ndims=(2,)).output == ("i",)


def test_diagonal_letter_is_not_sharded():
    opts = axis_options(_spec(aten.einsum.default, "ii->i", [torch.randn(8, 8)]))
    assert all(not isinstance(p, Shard) for o in opts for p in o.inputs)


@pytest.mark.parametrize(
    "equation, ndims",
    [("ij,jk->ik", (2,)), ("ij,jk->ik", (3, 2)), ("i...j...->ij", (3,)), ("i1->i", (2,)), ("ij->iz", (2,))],
)
def test_bad_equation_raises_autopar_error(equation, ndims):
    with pytest.raises(AutoparError, match="einsum"):
        parse_equation(equation, ndims=ndims)
