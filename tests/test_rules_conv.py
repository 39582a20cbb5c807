"""Sharding rules of convolutions and pooling: checked strategies, channel sharding (and its
Partial output), grouped convs limited to batch sharding, Partial only through average pools."""

import pytest
import torch

from autopar.core.ir import Strategy
from autopar.core.placement import P, R, Shard
from autopar.passes.rules import AxisOption, axis_options, spec_of_call
from autopar.passes.rules.simulate import check_strategy

aten = torch.ops.aten


def _r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _spec(op, *args, **kwargs):
    return spec_of_call(op, args, kwargs, op(*args, **kwargs))


def test_conv2d_channel_sharding():
    x, w, b = _r(8, 8, 5, 5), _r(16, 8, 3, 3), _r(16)
    opts = axis_options(_spec(aten.conv2d.default, x, w, b))
    assert AxisOption((Shard(0), R, R), (Shard(0),)) in opts  # batch
    assert AxisOption((R, Shard(0), Shard(0)), (Shard(1),)) in opts  # out channels
    assert AxisOption((Shard(1), Shard(1), P), (P,)) in opts  # in channels -> P(sum)
    assert AxisOption((Shard(1), Shard(1), R), (P,)) not in opts
    wrong = Strategy(((Shard(1),), (Shard(1),), (R,)), ((P,),))  # bias counted twice
    with pytest.raises(AssertionError):
        check_strategy(aten.conv2d.default, (x, w, b), {}, wrong, (2,))


def test_transposed_conv_shards_the_weight_on_its_own_channel_dims():
    x, w, b = _r(8, 8, 4, 4), _r(8, 16, 2, 2), _r(16)  # weight [C_in, O, kh, kw]
    opts = axis_options(_spec(aten.conv_transpose2d.input, x, w, b, [2, 2]))
    assert AxisOption((R, Shard(1), Shard(0)), (Shard(1),)) in opts
    assert AxisOption((Shard(1), Shard(0), P), (P,)) in opts


def test_grouped_conv_gets_no_channel_sharding():
    x, w, b = _r(8, 16, 4, 4), _r(16, 4, 3, 3), _r(16)
    args = (x, w, b, [1, 1], [1, 1], [1, 1], 4)
    opts = axis_options(_spec(aten.conv2d.default, *args))
    assert AxisOption((Shard(0), R, R), (Shard(0),)) in opts
    assert not any(o.outputs[0] == Shard(1) for o in opts)
    assert AxisOption((Shard(1), Shard(1), P), (P,)) not in opts
    # out-channel sharding with the global groups argument regroups channels wrongly
    wrong = Strategy(((R,), (Shard(0),), (Shard(0),)), ((Shard(1),),))
    with pytest.raises(AssertionError):
        check_strategy(aten.conv2d.default, args, {}, wrong, (2,))


def test_depthwise_conv_shards_whole_groups_with_the_local_group_count():
    x, w, b = _r(8, 8, 5, 5), _r(16, 1, 3, 3), _r(16)  # groups = C = 8, two outputs per group
    args = (x, w, b, [1, 1], [1, 1], [1, 1], 8)
    opts = axis_options(_spec(aten.conv2d.default, *args))
    groups = AxisOption((Shard(1), Shard(0), Shard(0)), (Shard(1),), local="groups")
    assert groups in opts
    strat = Strategy(((Shard(1), Shard(1)), (Shard(0), Shard(0)), (Shard(0), Shard(0))), ((Shard(1), Shard(1)),), "groups")
    check_strategy(aten.conv2d.default, args, {}, strat, (2, 2))
    # the plain op with the global groups argument cannot even run on a channel shard
    plain = Strategy(((Shard(1),), (Shard(0),), (Shard(0),)), ((Shard(1),),))
    with pytest.raises(RuntimeError):
        check_strategy(aten.conv2d.default, args, {}, plain, (2,))


def test_partial_passes_through_average_pools_only():
    x = _r(8, 8, 6, 6)
    avg = axis_options(_spec(aten.avg_pool2d.default, x, [2, 2]))
    mx = axis_options(_spec(aten.max_pool2d_with_indices.default, x, [2, 2]))
    assert AxisOption((P,), (P,)) in avg
    assert AxisOption((Shard(1),), (Shard(1),)) in avg
    assert AxisOption((Shard(0),), (Shard(0), Shard(0))) in mx  # values and indices
    assert not any(P in o.inputs for o in mx)
    wrong = Strategy(((P,),), ((P,),))
    with pytest.raises(AssertionError):
        check_strategy(aten.max_pool2d.default, (x, [2, 2]), {}, wrong, (2,))
