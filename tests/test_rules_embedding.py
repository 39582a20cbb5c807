"""Embedding sharding rules and the local-implementation hook (vocab-parallel lookup)."""

import pytest
import torch

from autopar.core.errors import ShardingError
from autopar.core.ir import OpSpec, Strategy, TensorMeta, spec_of_call
from autopar.core.layout import LocalContext, piece_of
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules import registry
from autopar.passes.rules.embedding import vocab_parallel_embedding
from autopar.passes.rules.registry import AxisOption, RuleEntry, axis_options, local_impl, strategies
from autopar.passes.rules.simulate import check_strategy, run_sharded

aten = torch.ops.aten
R, P = Replicate(), Partial()
EMB = aten.embedding.default


def _sample(vocab=16, hidden=8, hi=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(vocab, hidden, generator=g), torch.randint(0, hi, (8, 8), generator=g)


def test_embedding_offers_vocab_sharding_to_the_checker():
    """(tests/test_rules_registry.py runs the checker over every strategy of every op.)"""
    weight, idx = _sample()
    spec = spec_of_call(EMB, (weight, idx), {}, EMB(weight, idx))
    vocab = [s for s in strategies(spec, (2, 2, 2)) if s.local == "vocab"]
    assert vocab, "vocab-sharded strategies must reach the checker"


def test_embedding_options_are_batch_hidden_and_vocab_sharding():
    weight, idx = _sample()
    spec = spec_of_call(EMB, (weight, idx), {}, EMB(weight, idx))
    opts = set(axis_options(spec))
    assert AxisOption((R, Shard(0)), (Shard(0),)) in opts  # batch
    assert AxisOption((R, Shard(1)), (Shard(1),)) in opts  # sequence
    assert AxisOption((Shard(1), R), (Shard(2),)) in opts  # hidden (column) sharding
    assert AxisOption((Shard(0), R), (P,), local="vocab") in opts  # vocab rows -> partial sum
    assert AxisOption((Shard(0), R), (P,)) not in opts  # never with the plain op


def test_vocab_sharding_gives_partial_sum_through_the_local_op():
    weight, idx = _sample()
    strat = Strategy(((Shard(0), Shard(0)), (R, R)), ((P, P),), local="vocab")
    check_strategy(EMB, (weight, idx), {}, strat, (2, 2))
    # the summed pieces are the lookup; each piece alone is not
    out = run_sharded(EMB, (weight, idx), {}, strat, (2, 2))[0]
    torch.testing.assert_close(out, EMB(weight, idx))


def test_vocab_sharding_with_the_plain_op_is_caught_by_the_checker():
    # indices < 8 keep the plain op in range on an 8-row shard, so it runs and is merely wrong
    weight, idx = _sample(hi=8)
    plain = Strategy(((Shard(0),), (R,)), ((P,),))
    with pytest.raises(AssertionError, match="differs"):
        check_strategy(EMB, (weight, idx), {}, plain, (2,))
    check_strategy(EMB, (weight, idx), {}, Strategy(plain.inputs, plain.outputs, "vocab"), (2,))


def test_vocab_local_op_keeps_padding_row_gradient_zero_on_its_owner():
    weight, idx = _sample()
    idx[0, :4] = 11  # the padding row, on the second half of the vocabulary
    w = weight.clone().requires_grad_()
    aten.embedding.default(w, idx, 11).sum().backward()
    grads = []
    for rank in range(2):
        shard = weight[8 * rank : 8 * rank + 8].clone().requires_grad_()
        piece = piece_of((16, 8), (Shard(0),), (2,), (rank,))
        ctx = LocalContext((piece, piece_of((8, 8), (R,), (2,), (rank,))), ())
        vocab_parallel_embedding(EMB, (shard, idx, 11), {}, ctx).sum().backward()
        grads.append(shard.grad)
    torch.testing.assert_close(torch.cat(grads), w.grad)
    assert w.grad[11].abs().sum() == 0


def test_piece_of_splits_nested_axes_axis0_major():
    p = piece_of((16, 8), (Shard(0), Shard(0)), (2, 2), (1, 0))
    assert (p.starts, p.stops, p.shape) == ((8, 0), (12, 8), (4, 8))
    p = piece_of((16, 8), (Shard(0), Shard(1)), (2, 4), (1, 3))
    assert (p.starts, p.stops) == ((8, 6), (16, 8))
    p = piece_of((16, 8), (P, R), (2, 2), (1, 1))
    assert (p.starts, p.stops) == ((0, 0), (16, 8))


def _two_local_rule(spec):
    return [
        AxisOption((Shard(0),), (Shard(0),), local="a"),
        AxisOption((Shard(1),), (Shard(1),), local="b"),
        AxisOption((P,), (P,)),
    ]


def test_strategies_never_mix_two_local_implementations(monkeypatch):
    op = "test.two_locals"
    impls = {"a": lambda *a: None, "b": lambda *a: None}
    monkeypatch.setitem(registry._REGISTRY, op, RuleEntry(op, _two_local_rule, None, impls))
    spec = OpSpec(op, (TensorMeta((8, 8), torch.float32),), {}, (TensorMeta((8, 8), torch.float32),))
    strats = strategies(spec, (2, 2))
    assert {s.local for s in strats} == {None, "a", "b"}
    for s in strats:
        placements = s.inputs[0]
        if s.local == "a":
            assert Shard(0) in placements and Shard(1) not in placements
        if s.local is None:
            assert all(not isinstance(p, Shard) for p in placements)
    assert local_impl(op, "a") is impls["a"]
    with pytest.raises(ShardingError, match="no local implementation"):
        local_impl(op, "c")


def test_option_naming_an_unregistered_local_implementation_is_rejected(monkeypatch):
    op = "test.missing_local"
    monkeypatch.setitem(registry._REGISTRY, op, RuleEntry(op, _two_local_rule, None, {"a": None}))
    spec = OpSpec(op, (TensorMeta((8, 8), torch.float32),), {}, (TensorMeta((8, 8), torch.float32),))
    with pytest.raises(RuntimeError, match="'b'"):
        axis_options(spec)
