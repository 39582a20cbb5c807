"""Index reads (index.Tensor, gather, index_select): checker runs and hand expectations."""

import pytest
import torch

from autopar.core.ir import Strategy, spec_of_call
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import AxisOption, axis_options
from autopar.passes.rules.simulate import check_strategy

aten = torch.ops.aten
R, P = Replicate(), Partial()
def _options(op, *args):
    return axis_options(spec_of_call(op, args, {}, op(*args)))


def test_hf_mask_index_shards_along_the_batch_and_key_index_dims():
    pad = torch.randint(0, 2, (8, 8))
    b, kv = torch.arange(8).view(8, 1, 1, 1), torch.arange(8).view(1, 1, 1, 8)
    opts = _options(aten.index.Tensor, pad, [b, kv])
    assert AxisOption((R, Shard(0), R), (Shard(0),)) in opts
    assert AxisOption((R, R, Shard(3)), (Shard(3),)) in opts
    assert all(o.inputs[0] == R for o in opts)  # both source dims are indexed


def test_index_passes_untouched_dims_and_partial_through():
    x = torch.randn(8, 16, 8)
    opts = _options(aten.index.Tensor, x, [None, torch.randint(0, 16, (8,))])
    assert AxisOption((Shard(0), R), (Shard(0),)) in opts
    assert AxisOption((Shard(2), R), (Shard(2),)) in opts
    assert AxisOption((R, Shard(0)), (Shard(1),)) in opts
    assert AxisOption((P, R), (P,)) in opts
    assert all(o.inputs[0] != Shard(1) for o in opts)
    # non-adjacent indices move the index dims to the front
    opts = _options(aten.index.Tensor, x, [torch.randint(0, 8, (8,)), None, torch.randint(0, 8, (8,))])
    assert AxisOption((Shard(1), R, R), (Shard(1),)) in opts


def test_gather_shards_source_with_index_only_where_sizes_match():
    x, idx = torch.randn(16, 8), torch.randint(0, 8, (8, 8))
    opts = _options(aten.gather.default, x, 1, idx)
    assert all(o.inputs[0] != Shard(0) for o in opts)
    # forcing it anyway: the checker sees the shards do not line up
    with pytest.raises(AssertionError):
        check_strategy(aten.gather.default, (x, 1, idx), {}, Strategy(((Shard(0),), (Shard(0),)), ((Shard(0),),)), (2,))
    opts = _options(aten.gather.default, torch.randn(8, 16), 1, torch.randint(0, 16, (8, 8)))
    assert AxisOption((Shard(0), Shard(0)), (Shard(0),)) in opts
    assert AxisOption((R, Shard(1)), (Shard(1),)) in opts


def test_index_select_shards_the_index_into_the_selected_dim():
    opts = _options(aten.index_select.default, torch.randn(8, 16, 8), 1, torch.randint(0, 16, (8,)))
    assert AxisOption((R, Shard(0)), (Shard(1),)) in opts
    assert AxisOption((Shard(2), R), (Shard(2),)) in opts
    assert all(o.inputs[0] != Shard(1) for o in opts)


def test_scatter_shards_only_dims_off_dim_where_index_and_src_line_up_with_x():
    x, index = torch.zeros(8, 16), torch.randint(0, 16, (8, 4))
    opts = _options(aten.scatter.src, x, 1, index, torch.randn(8, 4))
    assert [o for o in opts if Shard(0) in o.outputs or Shard(1) in o.outputs] == [
        AxisOption((Shard(0), Shard(0), Shard(0)), (Shard(0),))]
    opts = _options(aten.scatter.value, x, 1, index[:4], 1.0)  # 4 index rows for 8 of x: no shard lines up
    assert all(o.outputs == (Replicate(),) for o in opts)
