"""Sharding rules: reductions (sum, mean, amax, max.dim, argmax, var, ...), scans (cumsum, diff)
and permutations along dims (flip, roll).

A dim that is not reduced shards straight through (to its position in the output: reduced dims
disappear unless ``keepdim``). A reduced dim may be sharded only where the local results combine
with a sum: ``sum`` over a sharded dim gives ``Partial``. The plain ``mean`` over a sharded dim
does not (each rank divides by its own count: the sum of local means is k times too big), so
that option names the local implementation ``"global_mean"``, which divides the local sum by the
*global* count. ``amax``/``argmax``/``var`` over a sharded dim would need a max/arg-max/Welford
combination, which ``Partial`` cannot express: not offered. ``Partial`` input passes through the
linear ones: ``sum``, ``mean``, ``cumsum``, ``diff``, ``flip``, ``roll``. Scans and
permutations never shard their own dims (``roll`` without dims moves the flattened tensor: no dim
shards).
"""

from __future__ import annotations

from typing import Sequence

import torch

from autopar.core.ir import OpSpec
from autopar.core.layout import LocalContext
from autopar.core.placement import P, Shard
from autopar.passes.rules.pointwise import is_float, option
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """Normalised reduced dims: ``None`` or ``[]`` is every dim, negatives wrap."""
    if dim is None:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return tuple(range(ndim))
    return tuple(sorted({d % ndim if ndim else 0 for d in dims}))


def reduction_options(
    spec: OpSpec,
    reduced: Sequence[int],
    *,
    keepdim: bool,
    sum_like: bool,
    linear: bool,
    local: str | None = None,
) -> list[AxisOption]:
    """Options of a reduction of the first tensor input over ``reduced`` dims.

    ``sum_like``: local results over shards of a reduced dim add up to the result (-> Partial),
    with the plain op, or with the local implementation ``local`` where it is given.
    ``linear``: the op is linear in its input (Partial in -> Partial out, float only).
    Every output (values and indices of ``max.dim``) gets the same placement.
    """
    x = spec.inputs[0]
    n_out = len(spec.outputs)
    options = []
    for d in range(x.ndim):
        if d in reduced:
            if sum_like:
                options.append(AxisOption((Shard(d),), (P,) * n_out, local=local))
        else:
            out_d = d if keepdim else d - sum(1 for r in reduced if r < d)
            options.append(AxisOption((Shard(d),), (Shard(out_d),) * n_out))
    if linear and is_float(x) and all(is_float(o) for o in spec.outputs):
        options.append(AxisOption((P,), (P,) * n_out))
    return options


def _dims_and_keepdim(spec: OpSpec, dim_default=None):
    x = spec.inputs[0]
    return reduced_dims(spec.arg(1, "dim", dim_default), x.ndim), bool(spec.arg(2, "keepdim", False))


@register(aten.sum.dim_IntList, samples=lambda: _reduce_samples(float_only=False))
def _sum_dim(spec: OpSpec) -> list[AxisOption]:
    dims, keep = _dims_and_keepdim(spec)
    return reduction_options(spec, dims, keepdim=keep, sum_like=True, linear=True)


@register(aten.sum.default, samples=lambda: _full_samples(float_only=False))
def _sum_all(spec: OpSpec) -> list[AxisOption]:
    return reduction_options(spec, range(spec.inputs[0].ndim), keepdim=False, sum_like=True, linear=True)


def global_mean(op, args, kwargs, ctx: LocalContext) -> torch.Tensor:
    """One rank's ``mean``/``mean.dim`` as a ``Partial`` piece: the local sum over the reduced
    dims divided by their *global* element count. Right for every combination of shards (of
    reduced or kept dims) and Partial inputs, since it is linear and counts globally."""
    x, rest = args[0], list(args[1:])
    dtype = kwargs.get("dtype")
    if op is aten.mean.default:
        dims, keepdim = list(range(x.ndim)), False
    else:
        dims = rest[0] if rest else kwargs.get("dim")
        keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    reduced = reduced_dims(dims, x.ndim)
    count = 1
    for d in reduced:
        count *= ctx.inputs[0].global_shape[d]
    total = aten.sum.dim_IntList(x, list(reduced), keepdim, dtype=dtype)
    return total / count


_MEAN_LOCAL = {"global_mean": global_mean}


@register(aten.mean.dim, samples=lambda: _reduce_samples(float_only=True), local_ops=_MEAN_LOCAL)
def _mean_dim(spec: OpSpec) -> list[AxisOption]:
    dims, keep = _dims_and_keepdim(spec)
    return reduction_options(spec, dims, keepdim=keep, sum_like=True, linear=True, local="global_mean")


@register(aten.mean.default, samples=lambda: _full_samples(float_only=True), local_ops=_MEAN_LOCAL)
def _mean_all(spec: OpSpec) -> list[AxisOption]:
    n = spec.inputs[0].ndim
    return reduction_options(spec, range(n), keepdim=False, sum_like=True, linear=True, local="global_mean")


@register(aten.amax.default, aten.amin.default, samples=lambda: _reduce_samples(float_only=False))
def _amax(spec: OpSpec) -> list[AxisOption]:
    dims, keep = _dims_and_keepdim(spec, dim_default=[])
    return reduction_options(spec, dims, keepdim=keep, sum_like=False, linear=False)


@register(aten.var.correction, aten.std.correction, samples=lambda: _var_samples())
def _var(spec: OpSpec) -> list[AxisOption]:
    dims = reduced_dims(spec.arg(1, "dim"), spec.inputs[0].ndim)
    keep = bool(spec.kwargs.get("keepdim", False))  # keyword-only in var/std.correction
    return reduction_options(spec, dims, keepdim=keep, sum_like=False, linear=False)


@register(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
          samples=lambda: _index_samples())
def _arg_reduce(spec: OpSpec) -> list[AxisOption]:
    # argmax(x, dim=None) reduces the flattened tensor: every dim is reduced.
    dims, keep = _dims_and_keepdim(spec)
    return reduction_options(spec, dims, keepdim=keep, sum_like=False, linear=False)


@register(aten.cumsum.default, samples=lambda: _cumsum_samples())
def _cumsum(spec: OpSpec) -> list[AxisOption]:
    x = spec.inputs[0]
    along = spec.arg(1, "dim") % max(x.ndim, 1)
    options = [AxisOption((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != along]
    if is_float(x) and is_float(spec.outputs[0]):
        options.append(AxisOption((P,), (P,)))
    return options


@register(aten.roll.default, samples=lambda: _roll_samples())
@register(aten.flip.default, samples=lambda: _flip_samples())
def _permute_along(spec: OpSpec) -> list[AxisOption]:
    x = spec.inputs[0]
    dims = spec.arg(1, "dims") if spec.op == aten.flip.default else spec.arg(2, "dims", [])
    moved = {d % max(x.ndim, 1) for d in dims} if dims else set(range(x.ndim))
    options = [AxisOption((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in moved]
    if is_float(x):
        options.append(AxisOption((P,), (P,)))
    return options


@register(aten.diff.default, samples=lambda: _diff_samples())
def _diff(spec: OpSpec) -> list[AxisOption]:
    # prepend/append have the input's shape except along `dim`: they shard with it.
    x = spec.inputs[0]
    along = spec.arg(2, "dim", -1) % x.ndim
    names = ("self", "prepend", "append")
    options = [option(spec, {n: Shard(d) for n in names}, (Shard(d),)) for d in range(x.ndim) if d != along]
    if all(is_float(t) for t in spec.inputs):
        options.append(option(spec, {n: P for n in names}, (P,)))
    return options


@register(aten.topk.default, samples=lambda: _topk_samples())
def _topk(spec: OpSpec) -> list[AxisOption]:
    # values and indices keep every dim but the one searched along: those shard through.
    x = spec.inputs[0]
    along = spec.arg(2, "dim", -1) % x.ndim
    return [AxisOption((Shard(d),), (Shard(d), Shard(d))) for d in range(x.ndim) if d != along]


# ---------------------------------------------------------------- samples


def _topk_samples():
    yield (torch.randn(8, 16), 2), {}
    yield (torch.randn(8, 8, 16), 3, 1), {}
    yield (torch.randn(2, 8, 8), 1, -1, False, True), {}  # largest=False: the k smallest


def _reduce_samples(*, float_only: bool):
    x = torch.randn(2, 8, 16)
    yield (x, [-1], True), {}  # LLaMA RMSNorm: mean(x^2, -1, keepdim=True)
    yield (x, [1]), {}
    yield (x, [0, 2]), {"keepdim": False}
    yield (torch.randn(8, 16), []), {}  # [] reduces every dim
    if not float_only:
        yield (torch.rand(8, 16) > 0.5, [1]), {}  # counting a mask
        yield (torch.randint(0, 9, (8, 16)), [0], True), {}
    else:
        yield (torch.randn(8, 16), [1]), {"dtype": torch.float64}


def _full_samples(*, float_only: bool):
    yield (torch.randn(8, 16),), {}
    yield (torch.randn(()),), {}
    if float_only:
        yield (torch.randn(8, 8),), {"dtype": torch.float64}
    else:
        yield (torch.randint(0, 9, (8, 8)),), {}


def _var_samples():
    yield (torch.randn(8, 16), [1]), {"correction": 1, "keepdim": True}
    yield (torch.randn(2, 8, 16), [0, 2]), {"correction": 0}
    yield (torch.randn(8, 16),), {}


def _index_samples():
    yield (torch.randn(8, 16), 1), {}
    yield (torch.randn(2, 8, 16), -1, True), {}
    yield (torch.randn(8, 16), 0), {"keepdim": True}


def _cumsum_samples():
    yield (torch.randn(8, 16), 1), {}
    yield (torch.randn(2, 8, 16), 0), {"dtype": torch.float64}
    yield (torch.ones(2, 8, dtype=torch.long), -1), {}  # HF position ids from an attention mask


def _roll_samples():
    yield (torch.randn(2, 8, 8, 4), [-3, -3], [1, 2]), {}  # Swin's shifted windows
    yield (torch.randn(8, 16), [3]), {}  # no dims: the flattened tensor
    yield (torch.arange(16).reshape(2, 8),), {"shifts": [1], "dims": [-1]}


def _flip_samples():
    yield (torch.randn(4, 8, 6), [0, 2]), {}
    yield (torch.arange(16).reshape(2, 8), [-1]), {}


def _diff_samples():
    yield (torch.randn(8, 16),), {}
    yield (torch.randint(0, 9, (2, 16)),), {"dim": -1}  # HF mask code: diff of position ids
    yield (torch.randn(8, 16), 2, 0), {}
    yield (torch.randn(8, 16), 1, -1, torch.randn(8, 1), torch.randn(8, 8)), {}


__all__ = ["global_mean", "reduced_dims", "reduction_options"]
