"""Sharding rules of triangular matrices, batched over leading dims.

``linalg_solve_triangular(A, B, *, upper, left, unitriangular)`` solves ``A X = B`` (``left``) or
``X A = B``. Every system of the batch is independent, and so is every right-hand side: a
column of ``B`` (``left``) or a row (otherwise) gives that of ``X`` with ``A`` whole. ``X`` is
linear in ``B``: a pending sum in ``B`` (``A`` whole) is one in ``X``. The system's own dims stay
whole. ``triu`` / ``tril`` keep a triangle of the last two dims: the batch dims shard, the
matrix dims stay whole (which elements survive depends on both indices), a pending sum passes.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import P, R, Shard
from autopar.passes.rules.einsum import addend_placement
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


def _samples():
    g = torch.Generator().manual_seed(11)
    a = torch.randn(4, 2, 8, 8, generator=g, dtype=torch.float64) + 8 * torch.eye(8, dtype=torch.float64)
    yield (a, torch.randn(4, 2, 8, 4, generator=g, dtype=torch.float64)), dict(upper=False, unitriangular=True)
    yield (a[0, 0], torch.randn(4, 8, 8, generator=g, dtype=torch.float64)), dict(upper=True)  # broadcast A
    yield (a, torch.randn(4, 2, 6, 8, generator=g, dtype=torch.float64)), dict(upper=False, left=False)


@register(aten.linalg_solve_triangular.default, samples=_samples)
def _solve_triangular(spec: OpSpec) -> list[AxisOption]:
    a, b = spec.inputs[:2]
    out = spec.outputs[0]
    options = [AxisOption(tuple(addend_placement(Shard(d), addend_shape=t.shape, out_shape=out.shape) for t in (a, b)),
                          (Shard(d),))
               for d in range(out.ndim - 2) if out.shape[d] > 1]  # batch dims; broadcast ones stay whole
    sides = -1 if spec.kwargs.get("left", True) else -2  # the dim of independent right-hand sides
    if out.shape[sides] > 1:
        options.append(AxisOption((R, Shard(b.ndim + sides)), (Shard(out.ndim + sides),)))
    if b.dtype.is_floating_point or b.dtype.is_complex:
        options.append(AxisOption((R, P), (P,)))
    return options


def _triangle_samples():
    g = torch.Generator().manual_seed(13)
    yield (torch.randn(4, 2, 8, 8, generator=g, dtype=torch.float64), 1), {}
    yield (torch.randn(8, 6, generator=g, dtype=torch.float64),), {}
    yield (torch.ones(4, 8, 8, dtype=torch.bool), -1), {}


@register(aten.triu.default, aten.tril.default, samples=_triangle_samples)
def _triangle(spec: OpSpec) -> list[AxisOption]:
    x = spec.inputs[0]
    options = [AxisOption((Shard(d),), (Shard(d),)) for d in range(x.ndim - 2) if x.shape[d] > 1]
    if x.dtype.is_floating_point or x.dtype.is_complex:
        options.append(AxisOption((P,), (P,)))
    return options
