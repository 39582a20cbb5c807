"""Sharding rules: the views between complex tensors and their real pairs.

``view_as_real`` adds a trailing dim of 2 (real, imaginary); ``view_as_complex`` takes it away.
Every other dim keeps its index, so a shard of it stays a shard of the same dim, and both are
linear (``Partial`` passes through). ``polar(abs, angle)``, which makes the rotary tables, is
elementwise (its inputs broadcast). Complex arithmetic itself (``mul`` of rotary tables) is
elementwise and uses the pointwise rules. Meta's Llama rotary embedding is written this way::

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import Partial, Shard
from autopar.passes.rules.pointwise import elementwise_options
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten
P = Partial()


def _shared_dims(spec: OpSpec) -> list[AxisOption]:
    """``S(d) -> S(d)`` for each dim the complex tensor and its real view share, and
    ``P -> P``."""
    ndim = min(spec.inputs[0].ndim, spec.outputs[0].ndim)
    shape = spec.inputs[0].shape
    return [AxisOption((Shard(d),), (Shard(d),)) for d in range(ndim) if shape[d] > 1] + [
        AxisOption((P,), (P,))]


def _view_as_real_samples():
    yield (torch.randn(8, 16, dtype=torch.complex64),), {}
    yield (torch.randn(2, 4, 8, dtype=torch.complex128),), {}


def _view_as_complex_samples():
    yield (torch.randn(8, 16, 2),), {}
    yield (torch.randn(2, 4, 8, 2, dtype=torch.float64),), {}


def _polar_samples():
    yield (torch.rand(8, 16) + 0.5, torch.randn(8, 16)), {}
    yield (torch.ones(16), torch.randn(8, 16, dtype=torch.float32)), {}  # a broadcast magnitude (Meta's freqs_cis)


register(aten.polar.default, samples=_polar_samples)(elementwise_options)
register(aten.view_as_real.default, samples=_view_as_real_samples)(_shared_dims)
register(aten.view_as_complex.default, samples=_view_as_complex_samples)(_shared_dims)

__all__: list[str] = []
