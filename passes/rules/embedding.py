"""Sharding rules: ``aten.embedding`` (weight ``[V, H]``, integer indices of any shape).

On one mesh axis an embedding can

- shard the indices on any dim (weight replicated): the output is sharded on the same dim;
- shard the weight's hidden dim (column parallel): the output is sharded on its last dim;
- shard the weight's vocabulary rows: each rank looks up only the indices that fall in its rows
  and writes zeros elsewhere, so the output is ``Partial(sum)`` (the key-partitioned parameter
  server written as one all-reduce). The plain op would index out of range on a row shard, so
  this option names the local implementation ``"vocab"``: mask, shift, look up, zero;
- take a ``Partial`` weight (the lookup is linear in the weight): the output is ``Partial``.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.layout import LocalContext
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()


def vocab_parallel_embedding(op, args, kwargs, ctx: LocalContext) -> torch.Tensor:
    """One rank's embedding on a row shard ``[start, stop)`` of the weight.

    Indices outside the shard look up row 0 and are then zeroed; summing over the ranks that
    share the vocabulary gives the full lookup. ``padding_idx`` (used only by the backward) is
    moved into the shard's local numbering, or dropped when another rank holds that row.
    """
    weight, indices = args[0], args[1]
    rest = dict(kwargs)
    padding_idx = args[2] if len(args) > 2 else rest.pop("padding_idx", -1)
    tail = args[3:]
    start, stop = ctx.inputs[0].starts[0], ctx.inputs[0].stops[0]
    # at ATen level a negative padding_idx means none (F.embedding has made real ones positive)
    local_pad = padding_idx - start if start <= padding_idx < stop else -1
    mine = (indices >= start) & (indices < stop)
    local_indices = torch.where(mine, indices - start, torch.zeros_like(indices))
    out = op(weight, local_indices, local_pad, *tail, **rest)
    return out.masked_fill(~mine.unsqueeze(-1), 0)


def _embedding_samples():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 8, generator=g)
    yield (weight, torch.randint(0, 16, (8, 8), generator=g)), {}
    # BERT passes padding_idx; 1-D indices and indices hitting every row, including the last
    yield (weight, torch.randint(0, 16, (8, 8), generator=g), 0), {}
    yield (weight, torch.arange(16).flip(0)), {}


@register(aten.embedding.default, samples=_embedding_samples, local_ops={"vocab": vocab_parallel_embedding})
def _embedding(spec: OpSpec) -> list[AxisOption]:
    weight, indices = spec.inputs
    if weight.ndim != 2:
        return []
    options = [AxisOption((R, Shard(d)), (Shard(d),)) for d in range(indices.ndim)]
    options.append(AxisOption((Shard(1), R), (Shard(indices.ndim),)))
    if weight.dtype.is_floating_point:
        # scale_grad_by_freq would count the masked-out lookups of row 0 in the backward
        if not spec.arg(3, "scale_grad_by_freq", False):
            options.append(AxisOption((Shard(0), R), (P,), local="vocab"))
        options.append(AxisOption((P, R), (P,)))
    return options
