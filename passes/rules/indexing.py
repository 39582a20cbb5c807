"""Sharding rules: reads by index — ``index.Tensor``, ``gather``, ``index_select`` — and the
write ``index_put``.

Index values are data, so a rule may only shard what stays exact for *any* index values:

- a dim of the source that no index touches passes through (every rank reads the same
  positions of its own slice);
- the index tensors may be sharded along a dim of their (broadcast) result, with the source
  replicated: each rank computes its rows of the output from its rows of indices;
- a ``Partial`` float source gives a ``Partial`` output (a read is linear in the source).

A source sharded along an indexed dim is not offered: which rank holds a row depends on the
index values. ``index_put`` shards the same way (its values like the indexed view) and is
linear in source and values together. ``scatter`` (``src`` or a scalar ``value`` written at
``index`` along ``dim``) shards a dim other than ``dim`` where ``x``, ``index`` and ``src`` are
the same size on it, as ``gather`` does. Data-dependent ops (``masked_select``, ``nonzero``)
have no rules here.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec, TensorMeta
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _is_mask(t: TensorMeta) -> bool:
    return t.dtype in (torch.bool, torch.uint8)


# ---- samples: index values are random with repeats, as real gathers have ----------------------


def _gen():
    return torch.Generator().manual_seed(3)


def _index_samples():
    g = _gen()
    pad = torch.randint(0, 100, (8, 8), generator=g)
    batch = torch.arange(8).view(8, 1, 1, 1)
    # HF mask code: padding_mask[batch_idx, kv_idx] with broadcast arange indices
    yield (pad, [batch, torch.arange(8).view(1, 1, 8, 1)]), {}
    yield (pad > 50, [batch, torch.randint(0, 8, (1, 1, 1, 8), generator=g)]), {}
    x = torch.randn(8, 16, 8, generator=g)
    yield (x, [None, torch.randint(0, 16, (8,), generator=g)]), {}  # x[:, idx]
    yield (x, [torch.randint(0, 8, (8, 8), generator=g), None, torch.randint(0, 8, (8,), generator=g)]), {}
    yield (x, [torch.randn(8, 16, generator=g) > 0]), {}  # boolean mask: trailing dim passes
    yield (x, [torch.randint(0, 8, (8, 1), generator=g), torch.randint(0, 16, (8,), generator=g)]), {}


def _gather_samples():
    g = _gen()
    yield (torch.randn(8, 16, generator=g), 1, torch.randint(0, 16, (8, 8), generator=g)), {}
    yield (torch.arange(16).view(1, 16), 1, torch.randint(0, 16, (1, 8), generator=g)), {}  # BERT
    yield (torch.randn(16, 8, generator=g), 1, torch.randint(0, 8, (8, 8), generator=g)), {}
    yield (torch.randn(8, 8, 8, generator=g), -1, torch.randint(0, 8, (8, 8, 16), generator=g)), {}
    yield (torch.randn(8, 16, generator=g), 0, torch.randint(0, 8, (8, 16), generator=g)), {}


def _index_select_samples():
    g = _gen()
    yield (torch.randn(8, 16, 8, generator=g), 1, torch.randint(0, 16, (8,), generator=g)), {}
    yield (torch.randn(16, 8, generator=g), 0, torch.randint(0, 16, (8,), generator=g)), {}
    yield (torch.randn(8, 8, generator=g), -1, torch.randint(0, 8, (16,), generator=g)), {}


def _index_put_samples():
    g = _gen()
    x = torch.randn(8, 16, 4, generator=g)
    yield (x, [torch.randint(0, 8, (8,), generator=g)], torch.randn(8, 16, 4, generator=g), True), {}  # x[i] += v
    yield (x, [torch.randperm(8, generator=g)[:5]], torch.randn(5, 16, 4, generator=g)), {}  # rows overwritten
    yield (x, [None, torch.randperm(16, generator=g)[:6]], torch.randn(6, 4, generator=g)), {}  # x[:, i] = v (broadcast)
    yield (x, [torch.randn(8, 16, generator=g) > 0], torch.tensor(0.0)), {}  # x[mask] = 0
    perm = torch.randperm(16, generator=g)
    yield (torch.zeros(16, dtype=torch.int64), [perm], torch.arange(16)), {}  # an inverse permutation


def _scatter_samples(with_src: bool):
    g = _gen()
    rows = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(8)])  # no row writes twice
    x = torch.zeros(8, 16)
    yield (x, 1, rows, torch.randn(8, 4, generator=g) if with_src else 1.0), {}  # top-k weights into a dense row
    yield (torch.randn(16, 8, generator=g), 0, rows.t().contiguous(), torch.randn(4, 8, generator=g) if with_src else -1.0), {}


# ---- rules ---------------------------------------------------------------------------------


def _covered(tensors: list) -> int:
    """How many of ``x``'s dims the index tensors ``tensors`` cover (a boolean mask: as many as it has)."""
    return sum(t.ndim if _is_mask(t) else 1 for t in tensors)


def _layout(x: TensorMeta, entries: list, m: int) -> tuple[dict[int, int], int]:
    """Where ``x[entries]`` puts ``x``'s dims: ``({kept x dim: result dim}, first broadcast
    index dim of the result)``, ``m`` the number of broadcast index dims.

    PyTorch puts the broadcast index dims where the indexed dims were if the non-``None``
    indices are adjacent in the list, and in front otherwise; a boolean mask indexes as many
    dims as it has.
    """
    spans, dim = [], 0  # the x dims each list entry covers; dims past the list are not indexed
    for t in entries:
        width = _covered([t]) if t is not None else 1
        spans.append(range(dim, dim + width))
        dim += width
    indexed = [d for t, span in zip(entries, spans) if t is not None for d in span]
    kept = [d for d in range(x.ndim) if d not in indexed]
    used = [k for k, t in enumerate(entries) if t is not None]
    first = spans[used[0]].start
    if used == list(range(used[0], used[-1] + 1)):
        return {d: (d if d < first else d - len(indexed) + m) for d in kept}, first
    return {d: m + j for j, d in enumerate(kept)}, 0


@register(aten.index.Tensor, samples=_index_samples)
def _index(spec: OpSpec) -> list[AxisOption]:
    """``x[indices]`` with a list of optional index tensors (``None`` keeps a dim)."""
    x, out = spec.inputs[0], spec.outputs[0]
    entries = list(spec.arg(1, "indices"))
    tensors = [t for t in entries if t is not None]
    m = out.ndim - (x.ndim - _covered(tensors))  # number of broadcast index dims in the output
    kept_out, b0 = _layout(x, entries, m)
    options = [AxisOption((Shard(d),) + (R,) * len(tensors), (Shard(o),)) for d, o in kept_out.items() if x.shape[d] > 1]
    if not any(_is_mask(t) for t in tensors):
        for b in range(m):
            size = out.shape[b0 + b]
            places = []
            for t in tensors:
                aligned = b - (m - t.ndim)
                places.append(Shard(aligned) if aligned >= 0 and t.shape[aligned] == size else R)
            if size > 1 and any(p != R for p in places):
                options.append(AxisOption((R, *places), (Shard(b0 + b),)))
    if x.dtype.is_floating_point:
        options.append(AxisOption((P,) + (R,) * len(tensors), (P,)))
    return options


@register(aten.index_put.default, samples=_index_put_samples)
def _index_put(spec: OpSpec) -> list[AxisOption]:
    """``x[indices] = values`` (``accumulate``: ``+=``) as a new tensor. A dim of ``x`` that no
    index touches shards in ``x``, the output and ``values`` where ``values`` has it (a
    broadcast ``values`` stays whole); the write is linear in ``x`` and ``values`` together,
    so both ``Partial`` give a ``Partial`` output."""
    x, values = spec.inputs[0], spec.inputs[-1]
    entries = list(spec.arg(1, "indices"))
    tensors = [t for t in entries if t is not None]
    m = max(1 if _is_mask(t) else t.ndim for t in tensors)
    kept_out, _ = _layout(x, entries, m)
    view_ndim = x.ndim - _covered(tensors) + m
    options = []
    for d, o in kept_out.items():
        v = o - (view_ndim - values.ndim)  # values broadcast to the indexed view, right-aligned
        place = Shard(v) if v >= 0 and values.shape[v] == x.shape[d] else R
        if x.shape[d] > 1:
            options.append(AxisOption((Shard(d),) + (R,) * len(tensors) + (place,), (Shard(d),)))
    if x.dtype.is_floating_point:
        options.append(AxisOption((P,) + (R,) * len(tensors) + (P,), (P,)))
    return options


@register(aten.gather.default, samples=_gather_samples)
def _gather(spec: OpSpec) -> list[AxisOption]:
    """``out[..i..] = x[..index[..i..]..]`` along ``dim``. Off ``dim``, index and source shard
    together only where they have the same size (gather allows a smaller index, and then the
    shards would not line up); along ``dim``, the index shards alone."""
    x, index = spec.inputs
    dim = _norm(spec.arg(1, "dim"), x.ndim)
    options = [
        AxisOption((Shard(d), Shard(d)), (Shard(d),))
        for d in range(x.ndim)
        if d != dim and x.shape[d] == index.shape[d] > 1
    ]
    options.append(AxisOption((R, Shard(dim)), (Shard(dim),)))
    if x.dtype.is_floating_point:
        options.append(AxisOption((P, R), (P,)))
    return options


@register(aten.index_select.default, samples=_index_select_samples)
def _index_select(spec: OpSpec) -> list[AxisOption]:
    x, _ = spec.inputs
    dim = _norm(spec.arg(1, "dim"), x.ndim)
    options = [AxisOption((Shard(d), R), (Shard(d),)) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    options.append(AxisOption((R, Shard(0)), (Shard(dim),)))
    if x.dtype.is_floating_point:
        options.append(AxisOption((P, R), (P,)))
    return options


@register(aten.scatter.src, samples=lambda: _scatter_samples(True))
@register(aten.scatter.value, samples=lambda: _scatter_samples(False))
def _scatter(spec: OpSpec) -> list[AxisOption]:
    """``x`` with ``src`` (or a scalar) written at ``index`` along ``dim``: a dim other than
    ``dim`` shards in every tensor where all have its size (an index may be smaller than
    ``x``, and then the shards would not line up)."""
    x = spec.inputs[0]
    dim = _norm(spec.arg(1, "dim"), x.ndim)
    return [AxisOption((Shard(d),) * len(spec.inputs), (Shard(d),)) for d in range(x.ndim)
            if d != dim and all(t.shape[d] == x.shape[d] for t in spec.inputs) and x.shape[d] > 1]
