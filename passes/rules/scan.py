"""Sharding rules: ``autopar::linear_scan(a, b, dim)``, the linear recurrence
``h_t = a_t * h_{t-1} + b_t`` along ``dim`` (:mod:`autopar.passes.capture.scan`), and
``autopar::chunk_delta_scan``, the gated delta rule's scan over chunks
(:mod:`autopar.passes.capture.delta_rule`), and ``autopar::wkv``, RWKV's recurrence
(:mod:`autopar.passes.capture.wkv`).

Every position of every dim but ``dim`` runs its own recurrence, so ``a``, ``b`` and ``h`` shard
alike along any other dim (batch, channels, state); ``dim`` itself is the scan and stays whole.
``h`` is linear in ``b``: a pending sum in ``b`` (``a`` whole) is one in ``h``.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.capture import scan as _scan  # noqa: F401  (registers autopar::linear_scan)
from autopar.passes.rules.registry import AxisOption, register

R, P = Replicate(), Partial()


def _samples():
    g = torch.Generator().manual_seed(7)
    yield (torch.rand(4, 6, 8, 2, generator=g), torch.randn(4, 6, 8, 2, generator=g), 2), {}
    yield (torch.rand(4, 5, 8, generator=g), torch.randn(4, 5, 8, generator=g), 1), {}  # odd length


@register(torch.ops.autopar.linear_scan.default, samples=_samples)
def _linear_scan(spec: OpSpec) -> list[AxisOption]:
    a = spec.inputs[0]
    dim = spec.arg(2, "dim") % a.ndim
    options = [AxisOption((Shard(d), Shard(d)), (Shard(d),)) for d in range(a.ndim) if d != dim and a.shape[d] > 1]
    if a.dtype.is_floating_point:
        options.append(AxisOption((R, P), (P,)))
    return options



def _delta_samples():
    g = torch.Generator().manual_seed(5)
    b, h, n, c, dk, dv = 4, 4, 3, 4, 2, 3
    shapes = [(b, h, n, c, dk), (b, h, n, c, dk), (b, h, n, c, dv), (b, h, n, c, dk), (b, h, n, c, c), (b, h, n),
              (b, h, dk, dv)]
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    args[5] = torch.rand(b, h, n, generator=g, dtype=torch.float64)
    yield tuple(args), {}
    args[5] = torch.rand(b, h, n, dk, generator=g, dtype=torch.float64)  # a decay per key dim (Kimi's)
    yield tuple(args), {}


@register(torch.ops.autopar.chunk_delta_scan.default, samples=_delta_samples)
def _chunk_delta_scan(spec: OpSpec) -> list[AxisOption]:
    """Batch (dim 0) and heads (dim 1) are independent systems; everything else stays whole."""
    values = spec.inputs[2]
    return [AxisOption((Shard(d),) * 7, (Shard(d), Shard(d))) for d in (0, 1) if values.shape[d] > 1]


def _wkv_samples():
    g = torch.Generator().manual_seed(9)
    channels = 8
    yield (torch.randn(channels, generator=g, dtype=torch.float64), torch.randn(channels, generator=g, dtype=torch.float64),
           torch.randn(4, 5, channels, generator=g, dtype=torch.float64),
           torch.randn(4, 5, channels, generator=g, dtype=torch.float64)), {}


@register(torch.ops.autopar.wkv.default, samples=_wkv_samples)
def _wkv(spec: OpSpec) -> list[AxisOption]:
    """Batch and channels are independent; the per-channel decay and bonus follow the channels."""
    key = spec.inputs[2]
    options = [AxisOption((R, R, Shard(0), Shard(0)), (Shard(0),))] if key.shape[0] > 1 else []
    if key.shape[2] > 1:
        options.append(AxisOption((Shard(0), Shard(0), Shard(2), Shard(2)), (Shard(2),)))
    return options
