"""Sharding rules: factory ops — tensors made from sizes and constants, not from tensor values.

- ``arange``, ``full``, ``zeros``, ``ones``, ``scalar_tensor`` have no tensor inputs and are
  planned replicated only. Run per rank, the plain op makes the *global* tensor (its size and
  values are arguments), so a sharded output would need a local implementation that offsets
  ``arange``'s start and shrinks sizes by the rank's piece; it is not worth one: turning a
  replicated tensor into a sharded one is a local slice with no communication, and these
  tensors are small (position ids, masks, constants).
- ``new_ones`` / ``new_zeros`` / ``new_full`` take a tensor only for its dtype and device: it may
  be sharded or ``Partial`` (so nothing is gathered to feed them) and the output, whose size is
  an argument, is replicated.
- ``zeros_like`` / ``ones_like`` / ``full_like`` make a tensor of their input's shape: a sharded
  input gives the same sharding (each rank makes its local shape); a ``Partial`` float input
  has full-size pieces, so the output is replicated.

``empty`` has no rule (no tensor input: replicated through the registry's fallback);
``empty_like`` / ``new_empty`` never reach the planner: capture makes them ``zeros_like`` /
``new_zeros`` (:mod:`autopar.passes.capture.empties`), whose values a check can compare.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()
CPU = {"device": torch.device("cpu"), "pin_memory": False}


def _arange_samples():
    yield (8,), dict(CPU)  # position ids, as captured graphs call it
    yield (16,), {"dtype": torch.float32}


def _arange_start_samples():
    yield (2, 10), {}


def _arange_start_step_samples():
    yield (0, 16, 2), {"dtype": torch.float32}
    yield (8, 0, -3), {}


def _full_samples():
    yield ([8, 8], 1.5), {}
    yield ([8], -100), {"dtype": torch.int64}


def _zeros_samples():
    yield ([8, 8],), {}
    yield ([8],), {"dtype": torch.int64, **CPU}


def _scalar_tensor_samples():
    yield (3.0,), {"dtype": torch.float32}
    yield (-1,), {"dtype": torch.int64}


def _new_samples():
    yield (torch.randint(0, 9, (1, 1, 8, 1)), []), {"dtype": torch.bool, "pin_memory": False}  # HF mask
    yield (torch.randn(8, 8), [8, 16]), {}


def _new_full_samples():
    yield (torch.randn(8, 8), [8], 2.0), {}
    yield (torch.randint(0, 9, (8, 8)), [8, 8], -1), {}


def _like_samples():
    yield (torch.randn(8, 8, 8),), {}
    yield (torch.randint(0, 9, (8, 8)),), {"dtype": torch.float32}


def _full_like_samples():
    yield (torch.randn(8, 8), 3.0), {}
    yield (torch.randint(0, 9, (8, 16)), 7), {}


def _fill_samples():
    yield (torch.randn(8, 8), 2.5), {}
    yield (torch.randint(0, 9, (8, 16)), 7), {}


def _fill_tensor_samples():
    yield (torch.randn(8, 8), torch.tensor(2.5)), {}
    yield (torch.randint(0, 9, (8, 16)), torch.tensor(7)), {}  # the decoder's start token


@register(aten.arange.default, samples=_arange_samples)
@register(aten.arange.start, samples=_arange_start_samples)
@register(aten.arange.start_step, samples=_arange_start_step_samples)
@register(aten.full.default, samples=_full_samples)
@register(aten.zeros.default, aten.ones.default, samples=_zeros_samples)
@register(aten.scalar_tensor.default, samples=_scalar_tensor_samples)
def _replicated_only(spec: OpSpec) -> list[AxisOption]:
    """No tensor inputs: the registry's all-replicated strategy is the only one (see above)."""
    return []


def _any_input_replicated_output(spec: OpSpec) -> list[AxisOption]:
    (x,) = spec.inputs
    options = [AxisOption((Shard(d),), (R,)) for d in range(x.ndim) if x.shape[d] > 1]
    if x.dtype.is_floating_point:
        options.append(AxisOption((P,), (R,)))
    return options


register(aten.new_ones.default, aten.new_zeros.default, samples=_new_samples)(_any_input_replicated_output)
register(aten.new_full.default, samples=_new_full_samples)(_any_input_replicated_output)


def _like(spec: OpSpec) -> list[AxisOption]:
    """A tensor of ``x``'s shape; a tensor fill value (``fill.Tensor``'s 0-dim) stays whole."""
    x, *values = spec.inputs
    whole = (R,) * len(values)
    options = [AxisOption((Shard(d), *whole), (Shard(d),)) for d in range(x.ndim) if x.shape[d] > 1]
    if x.dtype.is_floating_point:
        options.append(AxisOption((P, *whole), (R,)))
    return options


register(aten.zeros_like.default, aten.ones_like.default, samples=_like_samples)(_like)
register(aten.full_like.default, samples=_full_like_samples)(_like)
register(aten.fill.Scalar, samples=_fill_samples)(_like)
register(aten.fill.Tensor, samples=_fill_tensor_samples)(_like)
