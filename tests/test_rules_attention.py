"""Sharding rules of scaled_dot_product_attention: checked strategies, GQA head alignment,
and the options left out because they would be wrong."""

import pytest
import torch

from autopar.core.ir import Strategy
from autopar.core.placement import P, R, Shard
from autopar.passes.rules import AxisOption, axis_options, spec_of_call, strategies
from autopar.passes.rules.simulate import check_strategy

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _spec(*args, **kwargs):
    return spec_of_call(SDPA, args, kwargs, SDPA(*args, **kwargs))


def test_gqa_head_sharding_is_offered_checked_and_kept_aligned():
    q, k, v = _r(2, 8, 8, 4), _r(2, 2, 8, 4), _r(2, 2, 8, 4)  # Hq=8, Hkv=2
    spec = _spec(q, k, v, enable_gqa=True)
    heads = Strategy(((Shard(1),), (Shard(1),), (Shard(1),)), ((Shard(1),),))
    assert heads in strategies(spec, (2,))
    check_strategy(SDPA, (q, k, v), {"enable_gqa": True}, heads, (2,))
    # 4 shards would split Hkv=2 unevenly: the evenness filter drops it
    assert Strategy(((Shard(1),), (Shard(1),), (Shard(1),)), ((Shard(1),),)) not in strategies(spec, (4,))
    # sharding q's heads alone would pair q heads with the wrong kv heads
    misaligned = Strategy(((Shard(1),), (R,), (R,)), ((Shard(1),),))
    assert AxisOption((Shard(1), R, R), (Shard(1),)) not in axis_options(spec)
    with pytest.raises(AssertionError):
        check_strategy(SDPA, (q, k, v), {"enable_gqa": True}, misaligned, (2,))


def test_mask_follows_batch_and_broadcasts_over_heads():
    q = k = v = _r(8, 8, 8, 4)
    mask = _r(8, 1, 8, 8)
    opts = axis_options(_spec(q, k, v, mask))
    assert AxisOption((Shard(0), Shard(0), Shard(0), Shard(0)), (Shard(0),)) in opts
    assert AxisOption((Shard(1), Shard(1), Shard(1), R), (Shard(1),)) in opts
    assert AxisOption((Shard(2), R, R, Shard(2)), (Shard(2),)) in opts  # query sequence
    assert AxisOption((R, R, P, R), (P,)) in opts  # linear in v


def test_causal_query_sequence_sharding_runs_the_causal_rows_implementation():
    q, k, v = _r(2, 2, 8, 4), _r(2, 2, 16, 4), _r(2, 2, 16, 4)  # L=8 queries over S=16 keys
    plain = AxisOption((Shard(2), R, R), (Shard(2),))
    assert plain in axis_options(_spec(q, k, v))
    causal = axis_options(_spec(q, k, v, is_causal=True))
    assert plain not in causal
    assert AxisOption((Shard(2), R, R), (Shard(2),), local="causal_rows") in causal
    # the plain op on a row shard is wrong: each rank's causal mask starts at its own first row
    wrong = Strategy(((Shard(2),), (R,), (R,)), ((Shard(2),),))
    with pytest.raises(AssertionError):
        check_strategy(SDPA, (q, k, v), {"is_causal": True}, wrong, (2,))
    # with the local implementation it is exact, also split over two axes and beside heads
    for mesh, strat in [
        ((2,), Strategy(((Shard(2),), (R,), (R,)), ((Shard(2),),), "causal_rows")),
        ((2, 2), Strategy(((Shard(2), Shard(2)), (R, R), (R, R)), ((Shard(2), Shard(2)),), "causal_rows")),
        ((2, 2), Strategy(((Shard(1), Shard(2)), (Shard(1), R), (Shard(1), R)), ((Shard(1), Shard(2)),), "causal_rows")),
    ]:
        assert strat in strategies(_spec(q, k, v, is_causal=True), mesh)
        check_strategy(SDPA, (q, k, v), {"is_causal": True}, strat, mesh)


def test_key_sequence_and_head_dim_are_not_sharded():
    q = k = v = _r(2, 2, 8, 4)
    for opt in axis_options(_spec(q, k, v)):
        assert opt.inputs[1] not in (Shard(2), Shard(3))  # k's S and E dims
        assert opt.inputs[0] != Shard(3)
