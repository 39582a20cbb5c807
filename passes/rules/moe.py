"""Sharding rules: the ops of mixture-of-experts routing and experts.

transformers' routed-MoE layers (Mixtral, Qwen-MoE, OLMoE, ...) sort the tokens' expert ids,
count them per expert with ``histc``, turn positions into expert slots with ``floor_divide``
and run every expert's matmul at once with ``transformers::grouped_mm_fallback(input (S, in),
weight (E, in, out), offs (E,))``, the rows of ``input`` grouped by expert as ``offs`` (the
running token counts) says. What stays exact for any routing:

- ``sort`` / ``argsort`` along ``dim``: any other dim shards (values and indices alike);
- ``histc``: the input shards along any dim and the counts are a pending sum (``Partial``);
- ``floor_divide``: elementwise;
- the grouped matmul: tensor parallelism inside every expert, the experts' output features
  sharded (``weight`` ``S(2)`` -> output ``S(1)``) or their input features (``input`` ``S(1)``,
  ``weight`` ``S(1)`` -> ``Partial``); a ``Partial`` input or weight gives a ``Partial`` output.
  Splitting ``input``'s rows would need each rank's own offsets (expert parallelism, not here).

The grouped matmul's rule is found by the op's name, so that nothing here imports transformers.
transformers calls ``aten._grouped_mm(input, weight, offs=offs)`` instead where torch has that kernel
(bf16 weights, GPUs, the meta device): the same rule, for that form (2D input, 3D weight, offsets).
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.pointwise import elementwise_options
from autopar.passes.rules.registry import AxisOption, RuleEntry, register, set_deriver

aten = torch.ops.aten
R, P = Replicate(), Partial()
GROUPED_MM = "transformers::grouped_mm_fallback"


def _gen():
    return torch.Generator().manual_seed(5)


def _sort_samples():
    g = _gen()
    yield (torch.randn(8, 16, generator=g),), {}
    yield (torch.randint(0, 4, (8, 8, 4), generator=g), 1), {"descending": True}
    yield (torch.randint(0, 4, (16,), generator=g),), {}


def _sort_stable_samples():
    for args, kwargs in _sort_samples():
        yield args[:1], {"stable": True, "dim": args[1] if len(args) > 1 else -1, **kwargs}


def _histc_samples():
    g = _gen()
    yield (torch.randint(0, 4, (8, 16), generator=g).float(),), {"bins": 4, "min": 0, "max": 3}
    yield (torch.randn(16, generator=g),), {"bins": 8, "min": -2, "max": 2}


def _floor_divide_samples():
    g = _gen()
    yield (torch.arange(16).view(2, 8), 2), {}
    yield (torch.randint(0, 64, (8, 8), generator=g), torch.randint(1, 8, (8,), generator=g)), {}


def _grouped_mm_samples():
    g = _gen()
    offs = torch.tensor([3, 3, 10, 16])  # an expert with no tokens
    yield (torch.randn(16, 8, generator=g), torch.randn(4, 8, 16, generator=g), offs), {}


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@register(aten.sort.stable, samples=_sort_stable_samples)
@register(aten.sort.default, samples=_sort_samples)
@register(aten.argsort.stable, samples=_sort_stable_samples)
@register(aten.argsort.default, samples=_sort_samples)
def _sort(spec: OpSpec) -> list[AxisOption]:
    """Values and indices (``sort``) or indices (``argsort``) shard along any dim but ``dim``."""
    x = spec.inputs[0]
    dim = _norm(spec.arg(1, "dim", -1), x.ndim)  # keyword-only in the .stable overloads
    outs = len(spec.outputs)
    return [AxisOption((Shard(d),), (Shard(d),) * outs) for d in range(x.ndim) if d != dim and x.shape[d] > 1]


@register(aten.histc.default, samples=_histc_samples)
def _histc(spec: OpSpec) -> list[AxisOption]:
    (x,) = spec.inputs
    return [AxisOption((Shard(d),), (P,)) for d in range(x.ndim) if x.shape[d] > 1]


register(aten.floor_divide.default, samples=_floor_divide_samples)(elementwise_options)


def _grouped_mm(spec: OpSpec) -> list[AxisOption]:
    x, w, _ = spec.inputs
    options = [AxisOption((R, Shard(2), R), (Shard(1),)), AxisOption((Shard(1), Shard(1), R), (P,))]
    if x.dtype.is_floating_point:
        options += [AxisOption((P, R, R), (P,)), AxisOption((R, P, R), (P,))]
    return options


def _aten_grouped_mm_samples():
    g = _gen()  # torch's kernel wants 16-byte strides: shards of 32 inner features stay aligned
    offs = torch.tensor([3, 3, 10, 16], dtype=torch.int32)  # an expert with no tokens
    yield (torch.randn(16, 32, generator=g), torch.randn(4, 32, 32, generator=g)), {"offs": offs}


@register(aten._grouped_mm.default, samples=_aten_grouped_mm_samples)
def _aten_grouped_mm(spec: OpSpec) -> list[AxisOption]:
    """``aten._grouped_mm(input (S, in), weight (E, in, out), offs=)``: as transformers' fallback;
    other forms (3D inputs, a bias) stay replicated."""
    ins = spec.inputs
    if len(ins) != 3 or ins[0].ndim != 2 or ins[1].ndim != 3 or spec.arg(3, "bias") is not None:
        return []
    return _grouped_mm(spec)


_GROUPED_MM_ENTRY: dict = {}


def grouped_mm_entry(op) -> RuleEntry | None:
    """The grouped matmul's rule for ``op`` when it is transformers' grouped matmul."""
    if getattr(getattr(op, "_schema", None), "name", None) != GROUPED_MM:
        return None
    if op not in _GROUPED_MM_ENTRY:
        _GROUPED_MM_ENTRY[op] = RuleEntry(op, _grouped_mm, _grouped_mm_samples)
    return _GROUPED_MM_ENTRY[op]


set_deriver(grouped_mm_entry)
