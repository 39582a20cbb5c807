"""Factory ops: arange & co. replicated only; *_like follows its input."""

import torch

from autopar.core.ir import spec_of_call
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import strategies

aten = torch.ops.aten
R, P = Replicate(), Partial()


def test_arange_is_replicated_only():
    op = aten.arange.default
    spec = spec_of_call(op, (8,), {}, op(8))
    strats = strategies(spec, (2, 2))
    assert len(strats) == 1 and strats[0].outputs == ((R, R),)


def test_new_ones_accepts_any_input_sharding_and_replicates():
    x = torch.randn(8, 8)
    spec = spec_of_call(aten.new_ones.default, (x, [4]), {}, x.new_ones([4]))
    outs = {s.outputs for s in strategies(spec, (2,))}
    assert outs == {((R,),)}
    ins = {s.inputs[0] for s in strategies(spec, (2,))}
    assert ins == {(R,), (Shard(0),), (Shard(1),), (P,)}


def test_zeros_like_follows_its_input_and_partial_gives_replicated():
    x = torch.randn(8, 8)
    spec = spec_of_call(aten.zeros_like.default, (x,), {}, torch.zeros_like(x))
    strats = strategies(spec, (2,))
    pairs = {(s.inputs[0], s.outputs[0]) for s in strats}
    assert pairs == {((R,), (R,)), ((Shard(0),), (Shard(0),)), ((Shard(1),), (Shard(1),)), ((P,), (R,))}


def test_fill_with_a_tensor_value_follows_its_input_and_keeps_the_value_whole():
    x, value = torch.randint(0, 9, (8, 8)), torch.tensor(3)
    spec = spec_of_call(aten.fill.Tensor, (x, value), {}, torch.fill(x, value))
    pairs = {(s.inputs, s.outputs[0]) for s in strategies(spec, (2,))}
    assert pairs == {(((R,), (R,)), (R,)), (((Shard(0),), (R,)), (Shard(0),)), (((Shard(1),), (R,)), (Shard(1),))}
