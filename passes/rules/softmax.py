"""Sharding rules: softmax and log-softmax.

Every dim except the softmax dim shards straight through; the softmax dim needs the whole row
(its max and its sum), so it is never sharded, and softmax of a ``Partial`` is not a sum of
softmaxes, so ``Partial`` is never offered.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


def _samples(op):
    internal = op in (aten._softmax.default, aten._log_softmax.default)

    def samples():
        third = (False,) if internal else ()
        yield (torch.randn(2, 2, 8, 8), -1) + third, {}  # attention scores
        yield (torch.randn(8, 16), 0) + third, {}
        yield (torch.randn(16), 0) + third, {}
        if not internal:
            yield (torch.randn(8, 16), 1), {"dtype": torch.float64}

    return samples


def _register(op):
    @register(op, samples=_samples(op))
    def _softmax_rule(spec: OpSpec) -> list[AxisOption]:
        x = spec.inputs[0]
        along = spec.arg(1, "dim") % max(x.ndim, 1)
        return [AxisOption((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != along]


for _op in (aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int):
    _register(_op)
