"""Sharding rules: layer norm, RMS norm and batch norm.

Layer/RMS norm normalise over the trailing ``normalized_shape`` dims: the leading dims shard
straight through (weight and bias replicated, ``native_layer_norm``'s mean and rstd sharded with
the output); the normalised dims are never sharded (the statistics need the whole row).

Batch norm normalises each channel (dim 1) over the batch and spatial dims:

- channel sharding is always exact: input/output ``S(1)``, weight, bias, running stats and the
  saved/new statistics ``S(0)``;
- in evaluation (running statistics given, ``training=False``) it is a per-channel affine map,
  so any other dim shards too, with every per-channel tensor replicated;
- in training, sharding the batch or a spatial dim would need the statistics of the whole batch
  (SyncBatchNorm's all-reduce inside the op), which one sharding pass cannot express: NOT
  offered. This is a known gap: data parallelism over a batch-norm model in training needs
  either replicated batch norm or a SyncBN-style local implementation.

Group norm normalises each sample's groups of channels: the batch dim shards (channels would
need the op called with the rank's number of groups, a local implementation not written). Weight
norm (``_weight_norm(v, g, dim)``: ``v · g / ‖v‖`` over every dim but ``dim``) shards ``dim`` in
``v``, ``g`` and the output.

No norm is linear, so ``Partial`` is never offered.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import R, Shard
from autopar.passes.rules.pointwise import option
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


# ---------------------------------------------------------------- layer norm, RMS norm


def _leading_dims(spec: OpSpec) -> range:
    x = spec.inputs[0]
    return range(x.ndim - len(spec.arg(1, "normalized_shape")))


@register(aten.layer_norm.default, samples=lambda: _layer_norm_samples(True))
def _layer_norm(spec: OpSpec) -> list[AxisOption]:
    # also aten.rms_norm, registered below with its own samples
    return [option(spec, {"input": Shard(d)}, (Shard(d),)) for d in _leading_dims(spec)]


@register(aten.native_layer_norm.default, samples=lambda: _layer_norm_samples(False))
def _native_layer_norm(spec: OpSpec) -> list[AxisOption]:
    # outputs: (out, mean, rstd); mean/rstd keep the leading dims (normalised dims become 1)
    return [option(spec, {"input": Shard(d)}, (Shard(d),) * 3) for d in _leading_dims(spec)]


def _layer_norm_samples(optional_args: bool):
    x, w, b = torch.randn(2, 8, 16), torch.randn(16), torch.randn(16)
    yield (x, [16], w, b, 1e-5), {}
    yield (torch.randn(8, 2, 8), [2, 8], torch.randn(2, 8), torch.randn(2, 8), 1e-5), {}
    if optional_args:
        yield (x, [16], w, b, 1e-12, False), {}  # as BERT/GPT-2 graphs call it
        yield (x, [16]), {}
    else:
        yield (x, [16], None, None, 1e-5), {}


def _rms_norm_samples():
    yield (torch.randn(2, 8, 16), [16], torch.randn(16), 1e-6), {}
    yield (torch.randn(8, 16), [16]), {}


register(aten.rms_norm.default, samples=_rms_norm_samples)(_layer_norm)


# ---------------------------------------------------------------- batch norm

_CHANNEL_ARGS = ("weight", "bias", "running_mean", "running_var")


def _batch_norm_options(spec: OpSpec, *, batch_stats: bool, saved: int, new_stats: int) -> list[AxisOption]:
    """Options for a batch norm with outputs ``(out, *saved statistics, *new running stats)``.

    Saved statistics are per channel, or empty (size 0) in evaluation; new running stats are
    per channel.
    """
    x = spec.inputs[0]
    saved_outs = spec.outputs[1 : 1 + saved]
    chan_saved = tuple(Shard(0) if t.shape and t.shape[0] > 0 else R for t in saved_outs)
    chan_out = (Shard(1),) + chan_saved + (Shard(0),) * new_stats
    options = [option(spec, {"input": Shard(1), **{n: Shard(0) for n in _CHANNEL_ARGS}}, chan_out)]
    if not batch_stats:
        rest = (R,) * (saved + new_stats)
        options += [option(spec, {"input": Shard(d)}, (Shard(d),) + rest) for d in range(x.ndim) if d != 1]
    return options


@register(aten.batch_norm.default, samples=lambda: _bn_samples("batch_norm"))
def _batch_norm(spec: OpSpec) -> list[AxisOption]:
    return _batch_norm_options(spec, batch_stats=bool(spec.arg(5, "training")), saved=0, new_stats=0)


@register(aten._native_batch_norm_legit_functional.default, samples=lambda: _bn_samples("functional"))
def _bn_functional(spec: OpSpec) -> list[AxisOption]:
    # (out, save_mean, save_invstd, new running_mean, new running_var)
    return _batch_norm_options(spec, batch_stats=bool(spec.arg(5, "training")), saved=2, new_stats=2)


@register(aten._native_batch_norm_legit_no_training.default, samples=lambda: _bn_samples("no_training"))
def _bn_no_training(spec: OpSpec) -> list[AxisOption]:
    return _batch_norm_options(spec, batch_stats=False, saved=2, new_stats=0)


@register(aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
          samples=lambda: _bn_samples("native"))
def _bn_native(spec: OpSpec) -> list[AxisOption]:
    # (out, save_mean, save_invstd); running stats are updated in place in training
    return _batch_norm_options(spec, batch_stats=bool(spec.arg(5, "training")), saved=2, new_stats=0)


@register(aten._native_batch_norm_legit.no_stats, samples=lambda: _bn_samples("no_stats"))
def _bn_no_stats(spec: OpSpec) -> list[AxisOption]:
    # no running stats: always batch statistics, whatever `training` says
    return _batch_norm_options(spec, batch_stats=True, saved=2, new_stats=0)


def _bn_samples(kind: str):
    def params():
        return torch.randn(8), torch.randn(8), torch.randn(8), torch.rand(8) + 0.5

    shapes = [(8, 8, 2, 2)] + ([(8, 8, 8)] if kind == "batch_norm" else [])  # BatchNorm2d, BatchNorm1d
    for x in map(torch.randn, shapes):
        w, b, rm, rv = params()
        if kind == "batch_norm":
            yield (x, w, b, rm, rv, True, 0.1, 1e-5, False), {}
            yield (x, w, b, rm, rv, False, 0.1, 1e-5, False), {}
            yield (x, None, None, None, None, True, 0.1, 1e-5, False), {}
        elif kind == "functional":
            yield (x, w, b, rm, rv, True, 0.1, 1e-5), {}  # ResNet graph in training
            yield (x, w, b, rm, rv, False, 0.1, 1e-5), {}
        elif kind == "no_training":
            yield (x, w, b, rm, rv, 0.1, 1e-5), {}  # ResNet graph in eval
        elif kind == "native":
            yield (x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5), {}
            yield (x, w, b, rm, rv, False, 0.1, 1e-5), {}
        else:
            yield (x, w, b, True, 0.1, 1e-5), {}


# ---------------------------------------------------------------- group norm, weight norm


def _group_norm_samples():
    x = torch.randn(8, 8, 4, 4)
    yield (x, 4, torch.randn(8), torch.randn(8), 1e-5, False), {}  # two channels a group
    yield (torch.randn(8, 16, 8), 2), {}
    yield (x, 8, torch.randn(8), torch.randn(8)), {}


@register(aten.group_norm.default, samples=_group_norm_samples)
def _group_norm(spec: OpSpec) -> list[AxisOption]:
    x = spec.inputs[0]
    return [option(spec, {"input": Shard(0)}, (Shard(0),))] if x.shape[0] > 1 else []


def _weight_norm_samples():
    yield (torch.randn(16, 8, 4), torch.rand(16, 1, 1) + 0.5, 0), {}
    yield (torch.randn(8, 4, 16), torch.rand(1, 1, 16) + 0.5, 2), {}  # HuBERT's positional conv


@register(aten._weight_norm.default, samples=_weight_norm_samples)
def _weight_norm(spec: OpSpec) -> list[AxisOption]:
    v = spec.inputs[0]
    dim = spec.arg(2, "dim", 0)
    dim = dim + v.ndim if dim < 0 else dim
    return [AxisOption((Shard(dim), Shard(dim)), (Shard(dim),))] if v.shape[dim] > 1 else []
