"""View, shape, slicing, splitting and concatenation rules: checker runs and hand expectations."""

import pytest
import torch

from autopar.core.errors import ShardingError
from autopar.core.ir import Strategy, spec_of_call
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules import view
from autopar.passes.rules.registry import AxisOption, axis_options, entry, registered_ops, strategies
from autopar.passes.rules.simulate import check_strategy
from autopar.passes.rules.view import MAX_INDEX, view_dim_map

aten = torch.ops.aten
R, P = Replicate(), Partial()
VIEW_OPS = [op for op in registered_ops() if entry(op).rule.__module__ == view.__name__]


def _options(op, *args):
    spec = spec_of_call(op, args, {}, op(*args))
    return axis_options(spec), spec


def _shards(options):
    """{input placement: output placement} of the single-input options."""
    return {o.inputs[0]: o.outputs for o in options}


def test_view_family_is_registered():
    names = {str(op) for op in VIEW_OPS}
    for expected in ["aten.view.default", "aten.expand.default", "aten.transpose.int", "aten.slice.Tensor",
                     "aten.split.Tensor", "aten.cat.default", "aten.pad.default", "aten.unsqueeze.default"]:
        assert expected in names


def test_heads_split_keeps_batch_sequence_and_hidden_sharding():
    opts, _ = _options(aten.view.default, torch.randn(8, 8, 64), [8, 8, -1, 8])
    m = _shards(opts)
    assert m[Shard(0)] == (Shard(0),) and m[Shard(1)] == (Shard(1),) and m[Shard(2)] == (Shard(2),)
    assert m[P] == (P,)


def test_flattening_batch_and_sequence_maps_batch_but_not_sequence():
    opts, _ = _options(aten.view.default, torch.randn(8, 8, 16), [-1, 16])
    m = _shards(opts)
    assert m[Shard(0)] == (Shard(0),)
    assert m[Shard(2)] == (Shard(1),)
    assert Shard(1) not in m
    opts, _ = _options(aten.view.default, torch.randn(64, 16), [8, 8, 16])
    assert _shards(opts)[Shard(0)] == (Shard(0),)


def test_checker_rejects_sequence_sharding_through_a_flatten():
    x = torch.randn(8, 8, 16)
    wrong = Strategy(((Shard(1),),), ((Shard(0),),), local="local_shape")
    with pytest.raises(AssertionError, match="differs"):
        check_strategy(aten.view.default, (x, [-1, 16]), {}, wrong, (2,))


def test_nested_sharding_of_one_dim_on_two_axes_lines_up():
    x = torch.randn(8, 8, 16)
    spec = spec_of_call(aten.view.default, (x, [-1, 16]), {}, x.view(-1, 16))
    nested = Strategy(((Shard(0), Shard(0)),), ((Shard(0), Shard(0)),), local="local_shape")
    assert nested in strategies(spec, (2, 2))
    check_strategy(aten.view.default, (x, [-1, 16]), {}, nested, (2, 2))


def test_view_on_a_shard_needs_the_local_shape():
    # view(x_local, [8, 8, -1, 8]) on a sequence shard silently makes a wrong shape
    x = torch.randn(8, 8, 64)
    plain = Strategy(((Shard(1),),), ((Shard(1),),))
    with pytest.raises(AssertionError):
        check_strategy(aten.view.default, (x, [8, 8, -1, 8]), {}, plain, (2,))
    check_strategy(aten.view.default, (x, [8, 8, -1, 8]), {}, Strategy(plain.inputs, plain.outputs, "local_shape"), (2,))


def test_view_dim_map_groups_runs_of_equal_product():
    assert view_dim_map((2, 8, 16), (16, 16)) == {0: 0, 2: 1}
    assert view_dim_map((2, 1, 2, 8, 8), (2, 2, 8, 8)) == {0: 0, 2: 1, 3: 2, 4: 3}
    assert view_dim_map((6, 4), (4, 6)) == {0: 0}
    assert view_dim_map((8,), (1, 8, 1)) == {0: 1}
    with pytest.raises(ShardingError, match="element counts"):
        view_dim_map((8, 8), (8, 4))


def test_expand_keeps_the_broadcast_dim_replicated():
    opts, _ = _options(aten.expand.default, torch.randn(8, 1, 1, 8, 8), [8, 1, 2, 8, 8])
    outs = {o.outputs[0] for o in opts}
    assert Shard(2) not in outs  # the broadcast dim
    assert {Shard(0), Shard(3), Shard(4), P} <= outs
    opts, _ = _options(aten.expand.default, torch.randint(0, 9, (1, 8)), [8, -1])
    assert _shards(opts) == {R: (R,), Shard(1): (Shard(1),)}


def test_transpose_with_negative_dims_swaps_shardings():
    opts, _ = _options(aten.transpose.int, torch.randn(8, 16, 8), -2, -1)
    m = _shards(opts)
    assert m[Shard(1)] == (Shard(2),) and m[Shard(2)] == (Shard(1),) and m[Shard(0)] == (Shard(0),)


def test_slice_shards_the_sliced_dim_only_when_it_takes_all_of_it():
    opts, _ = _options(aten.slice.Tensor, torch.randn(8, 16), 1, 8, MAX_INDEX)
    assert Shard(1) not in _shards(opts)
    opts, _ = _options(aten.slice.Tensor, torch.randn(8, 16), 1, 0, MAX_INDEX)
    assert _shards(opts)[Shard(1)] == (Shard(1),)


def test_slice_scatter_shards_x_and_src_alike_off_the_written_dim():
    labels, shifted = torch.randint(0, 9, (8, 16)), torch.randint(0, 9, (8, 15))
    opts, _ = _options(aten.slice_scatter.default, labels, shifted, 1, 1, MAX_INDEX)
    assert AxisOption((Shard(0), Shard(0)), (Shard(0),)) in opts
    assert all(Shard(1) not in o.inputs for o in opts) and P not in [o.outputs[0] for o in opts]  # integers
    opts, _ = _options(aten.slice_scatter.default, torch.randn(8, 8), torch.randn(8, 8), 1, 0, MAX_INDEX)
    assert {AxisOption((Shard(1), Shard(1)), (Shard(1),)), AxisOption((P, P), (P,))} <= set(opts)


def test_select_scatter_shards_src_on_the_dims_it_keeps():
    opts, _ = _options(aten.select_scatter.default, torch.randn(8, 4, 16), torch.randn(8, 16), 1, 0)
    assert AxisOption((Shard(2), Shard(1)), (Shard(2),)) in opts
    assert AxisOption((Shard(0), Shard(0)), (Shard(0),)) in opts
    assert all(Shard(1) != o.inputs[0] for o in opts)


def test_split_shards_every_output_alike_off_the_split_dim():
    opts, _ = _options(aten.split.Tensor, torch.randn(8, 8, 48), 16, 2)
    m = _shards(opts)
    assert m[Shard(0)] == (Shard(0),) * 3 and m[Shard(1)] == (Shard(1),) * 3
    assert Shard(2) not in m


def test_cat_shards_all_inputs_alike_off_the_cat_dim():
    opts, _ = _options(aten.cat.default, [torch.randn(8, 1, 16), torch.randn(8, 4, 16)], 1)
    assert AxisOption((Shard(0), Shard(0)), (Shard(0),)) in opts
    assert AxisOption((Shard(2), Shard(2)), (Shard(2),)) in opts
    assert AxisOption((P, P), (P,)) in opts
    assert all(Shard(1) not in o.inputs for o in opts)


def test_pad_with_a_nonzero_constant_is_not_linear():
    opts, _ = _options(aten.pad.default, torch.randn(8, 8), [0, 1], "constant", 0.5)
    assert P not in _shards(opts)
    assert Shard(1) not in _shards(opts) and Shard(0) in _shards(opts)
    opts, _ = _options(aten.pad.default, torch.randn(8, 8), [0, 1])
    assert P in _shards(opts)


def test_squeeze_all_on_a_shard_of_local_size_one_uses_the_global_size_one_dims():
    x = torch.randn(2, 1, 8)
    plain = Strategy(((Shard(0),),), ((Shard(0),),))
    with pytest.raises(AssertionError):
        check_strategy(aten.squeeze.default, (x,), {}, plain, (2,))
    check_strategy(aten.squeeze.default, (x,), {}, Strategy(plain.inputs, plain.outputs, "local_shape"), (2,))
