"""Sharding rules: losses (cross entropy, NLL, MSE, BCE-with-logits).

A loss is a per-element loss followed by a reduction (``reduction`` 0 none, 1 mean, 2 sum):

- ``none``: every per-element dim (batch, and the spatial dims of ``[N, C, d1, ...]`` inputs)
  shards straight through;
- ``sum``: sharding any of those dims leaves each rank the sum over its elements: ``Partial``;
- ``mean`` of MSE and BCE-with-logits divides by the element count, known from the global
  shapes: sharded, they run the local implementation ``"global_mean"`` (local sum / global
  count) and give ``Partial``;
- ``mean`` of cross entropy / NLL is NOT offered when sharded: it divides by the number of
  non-ignored targets (or their summed class weights), which depends on the data on every rank
  and needs its own all-reduce.

The class dim of cross entropy / NLL is never sharded: the log-softmax over it needs the whole
row. Megatron's vocab-parallel cross entropy gets around that with all-reduces *inside* the op
(max, sum-exp and target logit over the vocabulary shards): several collectives between local
steps, which one sharding strategy (inputs -> op -> outputs) cannot express. It is left out.
``Partial`` input is never offered (no loss is linear).
"""

from __future__ import annotations

import functools
import math

import torch

from autopar.core.ir import OpSpec
from autopar.core.layout import LocalContext
from autopar.core.placement import P, R, Shard
from autopar.passes.rules.pointwise import broadcast_shards, option
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def _class_losses(spec: OpSpec, *, reduction_index: int, n_out: int) -> list[AxisOption]:
    """Cross entropy / NLL: ``self`` is ``[N, C, d1, ...]`` (or unbatched ``[C, ...]``), the
    target holds class indices (``self`` without the class dim) or probabilities (same shape).

    Extra outputs (NLL's ``total_weight``) are Partial under ``sum`` and replicated under
    ``none`` (where every rank returns the same placeholder)."""
    x, target = spec.inputs[0], spec.arg(1, "target")
    reduction = spec.arg(reduction_index, "reduction", MEAN)
    if reduction == MEAN:
        return []
    cls = 1 if x.ndim >= 2 else 0
    prob_target = target.ndim == x.ndim
    options = []
    for d in range(x.ndim):
        if d == cls:
            continue
        element_dim = d if d < cls else d - 1
        t = Shard(d if prob_target else element_dim)
        if reduction == NONE:
            outs = (Shard(element_dim),) + (R,) * (n_out - 1)
        else:
            outs = (P,) * n_out
        options.append(option(spec, {"self": Shard(d), "target": t}, outs))
    return options


@register(aten.cross_entropy_loss.default, samples=lambda: _cross_entropy_samples())
def _cross_entropy(spec: OpSpec) -> list[AxisOption]:
    return _class_losses(spec, reduction_index=3, n_out=1)


@register(aten.nll_loss_forward.default, samples=lambda: _nll_samples())
def _nll_loss(spec: OpSpec) -> list[AxisOption]:
    # outputs: (output, total_weight); also nll_loss2d_forward, registered below
    return _class_losses(spec, reduction_index=3, n_out=2)


_REDUCTION_INDEX = {aten.mse_loss.default: 2, aten.binary_cross_entropy_with_logits.default: 4}


def _elementwise_loss(spec: OpSpec) -> list[AxisOption]:
    """A loss on ``self`` and broadcast companions (target, weights): shard any dim of ``self``."""
    reduction = spec.arg(_REDUCTION_INDEX[spec.op], "reduction", MEAN)
    x = spec.inputs[0]
    out = (lambda d: Shard(d)) if reduction == NONE else (lambda d: P)
    local = "global_mean" if reduction == MEAN else None
    return [AxisOption(ins, (out(d),), local=local) for d, ins in broadcast_shards(spec, x.shape)]


def global_mean_loss(op, args, kwargs, ctx: LocalContext) -> torch.Tensor:
    """One rank's mean-reduced elementwise loss as a ``Partial`` piece: its local sum divided by
    the global number of loss elements (the broadcast of the inputs' global shapes)."""
    index = _REDUCTION_INDEX[op]
    args, kwargs = list(args), dict(kwargs)
    if len(args) > index:
        args[index] = SUM
    else:
        kwargs["reduction"] = SUM
    return op(*args, **kwargs) / _element_count(tuple(p.global_shape for p in ctx.inputs))


@functools.lru_cache(maxsize=256)
def _element_count(shapes: tuple) -> int:
    """Elements of the broadcast of ``shapes`` (cached: it runs on every training step)."""
    return math.prod(torch.broadcast_shapes(*shapes))


_LOCAL = {"global_mean": global_mean_loss}


@register(aten.mse_loss.default, samples=lambda: _mse_samples(), local_ops=_LOCAL)
def _mse_loss(spec: OpSpec) -> list[AxisOption]:
    return _elementwise_loss(spec)


@register(aten.binary_cross_entropy_with_logits.default, samples=lambda: _bce_samples(), local_ops=_LOCAL)
def _bce_with_logits(spec: OpSpec) -> list[AxisOption]:
    return _elementwise_loss(spec)


# ---------------------------------------------------------------- samples


def _targets(shape, classes):
    t = torch.randint(0, classes, shape)
    t.view(-1)[::3] = -100  # some ignored positions, as HF's shifted labels have
    return t


def _cross_entropy_samples():
    C = 5  # the class dim is never sharded: an odd size keeps it out of every mesh
    x = torch.randn(16, C)
    yield (x, _targets((16,), C)), {}  # as HF causal-LM / classification graphs call it
    for red in (NONE, SUM):
        yield (x, _targets((16,), C), None, red), {}
        yield (x, _targets((16,), C), torch.rand(C) + 0.5, red, -100, 0.1), {}
        yield (torch.randn(8, C, 8), _targets((8, 8), C)), {"reduction": red}
        yield (x, torch.softmax(torch.randn(16, C), 1), None, red), {}  # probability targets
    yield (torch.randn(C), torch.tensor(2)), {"reduction": SUM}  # unbatched: nothing to shard


def _nll_samples():
    C = 5
    for red in (NONE, MEAN, SUM):
        yield (torch.randn(16, C).log_softmax(1), _targets((16,), C), None, red, -100), {}
    yield (torch.randn(16, C).log_softmax(1), _targets((16,), C), torch.rand(C) + 0.5, SUM, -100), {}


def _nll2d_samples():
    C = 3
    for red in (NONE, SUM):
        yield (torch.randn(8, C, 8, 8).log_softmax(1), _targets((8, 8, 8), C), None, red, -100), {}


register(aten.nll_loss2d_forward.default, samples=_nll2d_samples)(_nll_loss)


def _mse_samples():
    for red in (NONE, MEAN, SUM):
        yield (torch.randn(8, 16), torch.randn(8, 16), red), {}
    yield (torch.randn(8, 1), torch.randn(8, 1)), {"reduction": SUM}


def _bce_samples():
    x, t = torch.randn(8, 16), torch.rand(8, 16)
    for red in (NONE, MEAN, SUM):
        yield (x, t, None, None, red), {}
    yield (x, t, torch.rand(8, 16), torch.rand(16) + 0.5, SUM), {}  # pos_weight per class
    yield (x, t), {"pos_weight": torch.rand(16) + 0.5, "reduction": NONE}
