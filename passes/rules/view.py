"""Sharding rules: views, shape changes, slicing, splitting and concatenation.

These ops move elements without arithmetic, so a sharded dim passes through when the op maps it
to one output dim whole, and a ``Partial`` float input stays ``Partial`` (every op here is
linear, except padding with a non-zero constant). A dim the op cuts, pads, broadcasts or
concatenates along stays replicated.

Reshapes (view, reshape, flatten, unflatten, squeeze, unsqueeze) pair runs of input and output
dims with equal products (:func:`view_dim_map`); sharding the first dim of an input run is
sharding the first dim of its output run: both cut the run's flat index into the same
contiguous blocks when each divides evenly, which the registry's evenness filter checks.

Ops whose arguments hold global sizes (view's size, expand's size, unflatten's sizes) must be
called with the rank's local sizes: their sharded options name the local implementation
``"local_shape"``, which passes the local output shape from the :class:`LocalContext`.
``squeeze()`` uses the same name for squeezing only the dims of global size 1 (a shard may
have local size 1).
"""

from __future__ import annotations

import math

import torch

from autopar.core.errors import ShardingError
from autopar.core.ir import OpSpec
from autopar.core.layout import LocalContext
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()
MAX_INDEX = 9223372036854775807  # the "to the end" slice bound captured graphs use


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _partial(spec: OpSpec, *, linear: bool = True) -> list[AxisOption]:
    """``Partial`` in, ``Partial`` out, when every tensor input is floating point."""
    if not linear or not spec.inputs or not all(t.dtype.is_floating_point for t in spec.inputs):
        return []
    return [AxisOption((P,) * len(spec.inputs), (P,) * len(spec.outputs))]


def _mapped(spec: OpSpec, dim_map: dict[int, int], *, local: str | None = None) -> list[AxisOption]:
    """Options for one input and one or more outputs: input ``S(i)`` -> every output ``S(o)``
    (size-1 dims left out: they never split)."""
    n_out, shape = len(spec.outputs), spec.inputs[0].shape
    return [
        AxisOption((Shard(i),), (Shard(o),) * n_out, local)
        for i, o in sorted(dim_map.items())
        if shape[i] > 1
    ]


def view_dim_map(in_shape, out_shape) -> dict[int, int]:
    """``{input dim: output dim}`` for a row-major reshape of ``in_shape`` into ``out_shape``.

    Size-1 dims are left out; the remaining dims are grouped into runs of equal product, and
    the first dim of each input run maps to the first dim of its output run.

    >>> view_dim_map((2, 8, 16), (2, 8, 2, 8))
    {0: 0, 1: 1, 2: 2}
    >>> view_dim_map((2, 8, 16), (16, 16))
    {0: 0, 2: 1}
    """
    if math.prod(in_shape) != math.prod(out_shape):
        raise ShardingError(
            f"cannot reshape {tuple(in_shape)} into {tuple(out_shape)}: the element counts differ;"
            " pass the op's real input and output shapes"
        )
    if 0 in in_shape:
        return {}
    a = [d for d, n in enumerate(in_shape) if n != 1]
    b = [d for d, n in enumerate(out_shape) if n != 1]
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(a):
        mapping[a[i]] = b[j]
        pa, pb = in_shape[a[i]], out_shape[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * in_shape[a[i]], i + 1
            else:
                pb, j = pb * out_shape[b[j]], j + 1
    return mapping


def _reshape_options(spec: OpSpec, *, local: str | None = None, frozen=()) -> list[AxisOption]:
    """Reshape-like op: map dims by shape; dims in ``frozen`` are never sharded."""
    dim_map = view_dim_map(spec.inputs[0].shape, spec.outputs[0].shape)
    dim_map = {i: o for i, o in dim_map.items() if i not in frozen}
    return _mapped(spec, dim_map, local=local) + _partial(spec)


# ---- local implementations -------------------------------------------------------------------


def _call_with_local_shape(op, args, kwargs, ctx: LocalContext):
    """view / reshape / _unsafe_view / expand with the size argument replaced by the local one."""
    rest = {k: v for k, v in kwargs.items() if k not in ("size", "shape")}
    return op(args[0], list(ctx.outputs[0].shape), *args[2:], **rest)


def _unflatten_local(op, args, kwargs, ctx: LocalContext):
    x = args[0]
    dim = _norm(args[1] if len(args) > 1 else kwargs["dim"], x.ndim)
    sizes = args[2] if len(args) > 2 else kwargs["sizes"]
    return op(x, dim, list(ctx.outputs[0].shape[dim : dim + len(sizes)]))


def _squeeze_local(op, args, kwargs, ctx: LocalContext):
    """squeeze() squeezes every size-1 dim, which would include a sharded dim whose local size
    is 1; squeeze exactly the dims of global size 1 instead."""
    ones = [d for d, n in enumerate(ctx.inputs[0].global_shape) if n == 1]
    return aten.squeeze.dims(args[0], ones)


LOCAL_SHAPE = {"local_shape": _call_with_local_shape}


# ---- samples ---------------------------------------------------------------------------------


def _rand(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(*shape, dtype=dtype)
    return torch.randint(0, 100, shape, dtype=dtype)


def _view_samples():
    yield (_rand(8, 8, 64), [8, 8, -1, 8]), {}  # heads split: [B, S, H] -> [B, S, nh, hd]
    yield (_rand(8, 8, 8, 8), [8, 8, -1]), {}  # heads merged
    yield (_rand(8, 8, 16), [-1, 16]), {}  # [B, S, H] -> [B*S, H]
    yield (_rand(64, 16), [8, 8, 16]), {}
    yield (_rand(8, 1, 8, 8), [8, 8, 8]), {}  # LLaMA's grouped-query expand, viewed back
    yield (_rand(16, 8), [8, 16]), {}  # runs that regroup
    yield (_rand(8, 8, dtype=torch.int64), [-1]), {}  # labels flattened for the loss


def _expand_samples():
    yield (_rand(1, 8, dtype=torch.int64), [8, -1]), {}  # position ids over the batch
    yield (_rand(8, 1, 1, 8, 8), [8, 1, 2, 8, 8]), {}  # grouped-query key/value heads
    yield (_rand(1, 1, 16), [8, -1, -1]), {}  # ViT class token
    yield (torch.rand(8, 1, 8, 8) > 0.5, [8, -1, 8, 8]), {}  # boolean mask
    yield (_rand(8, 8), [2, 8, 8]), {}  # new leading dim


def _permute_samples():
    yield (_rand(8, 8, 16), [2, 0, 1]), {}
    yield (_rand(8, 8, 8, 8), [0, 2, 1, 3]), {}


def _transpose_samples():
    yield (_rand(8, 8, 2, 8), 1, 2), {}
    yield (_rand(8, 16, 8), -2, -1), {}


def _t_samples():
    yield (_rand(8, 16),), {}
    yield (_rand(8),), {}


def _unsqueeze_samples():
    yield (_rand(8, 8), 0), {}
    yield (_rand(8, 8), -1), {}
    yield (_rand(8, dtype=torch.int64), 1), {}


def _squeeze_dim_samples():
    yield (_rand(8, 1, 8), 1), {}
    yield (_rand(8, 1, 8), -2), {}
    yield (_rand(8, 8), 0), {}  # squeezing a dim that is not size 1 does nothing


def _squeeze_dims_samples():
    yield (_rand(8, 1, 8, 1), [1, 3]), {}
    yield (_rand(8, 1, 8), [0, 1]), {}


def _squeeze_samples():
    yield (_rand(8, 1, 8, 1),), {}
    yield (_rand(2, 1, 8),), {}  # dim 0 sharded in two has local size 1 but must stay


def _flatten_samples():
    yield (_rand(8, 8, 16), 0, 1), {}
    yield (_rand(8, 2, 8), 1, -1), {}
    yield (_rand(8, 16, 2, 2), 2, 3), {}  # ViT patches


def _unflatten_samples():
    yield (_rand(64, 16), 0, [8, 8]), {}
    yield (_rand(8, 64), -1, [8, -1]), {}


def _identity_samples():
    yield (_rand(8, 8, 16),), {}


def _slice_samples():
    yield (_rand(8, 8, 16), 2, 0, 8), {}
    yield (_rand(8, 16), 1, 8, MAX_INDEX), {}
    yield (_rand(8, 9, dtype=torch.int64), 1, 1, MAX_INDEX), {}  # shifted labels
    yield (_rand(8, 8, dtype=torch.int64), 1, 0, 1), {}
    yield (_rand(8, 8, 8), 0, 0, MAX_INDEX), {}  # whole dim: may stay sharded
    yield (_rand(8, 8), 1, 0, 8), {}  # whole dim, end given exactly
    yield (_rand(16, 8), 0, -8), {}
    yield (_rand(8, 16), 1, 0, 16, 2), {}


def _select_samples():
    yield (_rand(8, 8, 16), 1, 0), {}  # ViT class token
    yield (_rand(8, 8, 16), -1, -1), {}


def _slice_scatter_samples():
    # shift_tokens_right: labels[:, :-1] written into zeros at [:, 1:]
    yield (_rand(8, 16, dtype=torch.int64), _rand(8, 15, dtype=torch.int64), 1, 1, MAX_INDEX), {}
    yield (_rand(8, 16, 8), _rand(8, 8, 8), 1, 0, 16, 2), {}
    yield (_rand(8, 8, 8), _rand(8, 8, 8), 0, 0, MAX_INDEX), {}  # the whole dim: src is the output
    yield (_rand(16, 8), _rand(8, 8), 0, -8), {}


def _select_scatter_samples():
    yield (_rand(8, 16, dtype=torch.int64), _rand(8, dtype=torch.int64), 1, 0), {}  # the start token
    yield (_rand(8, 8, 16), _rand(8, 16), 1, -1), {}


def _narrow_samples():
    yield (_rand(8, 16, 8), 1, 4, 8), {}


def _split_samples():
    yield (_rand(8, 8, 48), 16, 2), {}  # GPT-2 q, k, v
    yield (_rand(16, 8), 8), {}


def _split_with_sizes_samples():
    yield (_rand(8, 8, 24), [8, 16], -1), {}


def _chunk_samples():
    yield (_rand(8, 8, 24), 3, -1), {}


def _unbind_samples():
    yield (_rand(3, 8, 8),), {}
    yield (_rand(8, 2, 8), 1), {}


def _cat_samples():
    yield ([_rand(8, 8, 4), _rand(8, 8, 4)], -1), {}  # rotary halves
    yield ([_rand(8, 1, 16), _rand(8, 4, 16)], 1), {}  # ViT class token + patches
    yield ([_rand(8, 8, dtype=torch.int64), _rand(8, 8, dtype=torch.int64)],), {}
    yield ([torch.empty(0), _rand(8, 8)], 0), {}  # legacy empty input


def _stack_samples():
    yield ([_rand(8, 8), _rand(8, 8)],), {}
    yield ([_rand(8, 8), _rand(8, 8), _rand(8, 8)], -1), {}


def _pad_samples():
    yield (_rand(8, 8, dtype=torch.int64), [0, 1], "constant", -100.0), {}  # labels shifted
    yield (_rand(8, 8, 8), [1, 1]), {}
    yield (_rand(8, 8, 8), [0, 0, 2, 2]), {}
    yield (_rand(8, 8, 8), [2, 2], "reflect"), {}
    yield (_rand(8, 8, 8), [1, 0], "constant", 0.5), {}


def _constant_pad_samples():
    yield (_rand(8, 8, 8), [1, 2], 0.0), {}
    yield (_rand(8, 8), [0, 0, 1, 1], 1.5), {}


def _repeat_samples():
    yield (_rand(8, 8), [1, 2]), {}
    yield (_rand(8, 8), [2, 1, 1]), {}


def _repeat_interleave_samples():
    yield (_rand(8, 4, 8), 2, 1), {}
    yield (_rand(8, 8), 3, 0), {}
    yield (_rand(8, 4), 2), {}  # no dim: the flattened input


# ---- rules -----------------------------------------------------------------------------------


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, samples=_view_samples, local_ops=LOCAL_SHAPE)
def _view(spec: OpSpec) -> list[AxisOption]:
    return _reshape_options(spec, local="local_shape")


@register(aten.unsqueeze.default, samples=_unsqueeze_samples)
def _unsqueeze(spec: OpSpec) -> list[AxisOption]:
    return _reshape_options(spec)


@register(aten.squeeze.dim, samples=_squeeze_dim_samples)
def _squeeze_dim(spec: OpSpec) -> list[AxisOption]:
    # A listed dim that is not size 1 stays; sharded, its local size could become 1 and vanish.
    return _reshape_options(spec, frozen={_norm(spec.arg(1, "dim"), spec.inputs[0].ndim)})


@register(aten.squeeze.dims, samples=_squeeze_dims_samples)
def _squeeze_dims(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    return _reshape_options(spec, frozen={_norm(d, ndim) for d in spec.arg(1, "dim")})


@register(aten.squeeze.default, samples=_squeeze_samples, local_ops={"local_shape": _squeeze_local})
def _squeeze(spec: OpSpec) -> list[AxisOption]:
    return _reshape_options(spec, local="local_shape")


@register(aten.flatten.using_ints, samples=_flatten_samples)
def _flatten(spec: OpSpec) -> list[AxisOption]:
    return _reshape_options(spec)


@register(aten.unflatten.int, samples=_unflatten_samples, local_ops={"local_shape": _unflatten_local})
def _unflatten(spec: OpSpec) -> list[AxisOption]:
    return _reshape_options(spec, local="local_shape")


@register(aten.contiguous.default, samples=_identity_samples)  # alias: pointwise.py
def _identity(spec: OpSpec) -> list[AxisOption]:
    return _mapped(spec, {d: d for d in range(spec.inputs[0].ndim)}) + _partial(spec)


@register(aten.expand.default, samples=_expand_samples, local_ops=LOCAL_SHAPE)
def _expand(spec: OpSpec) -> list[AxisOption]:
    """A broadcast dim (size 1 -> n) stays replicated: every rank needs the one row."""
    src, dst = spec.inputs[0].shape, spec.outputs[0].shape
    off = len(dst) - len(src)
    dim_map = {d: d + off for d in range(len(src)) if src[d] == dst[d + off]}
    return _mapped(spec, dim_map, local="local_shape") + _partial(spec)


@register(aten.permute.default, samples=_permute_samples)
def _permute(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    order = [_norm(d, ndim) for d in spec.arg(1, "dims")]
    return _mapped(spec, {src: out for out, src in enumerate(order)}) + _partial(spec)


@register(aten.transpose.int, samples=_transpose_samples)
def _transpose(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    d0, d1 = _norm(spec.arg(1, "dim0"), ndim), _norm(spec.arg(2, "dim1"), ndim)
    swap = {d0: d1, d1: d0}
    return _mapped(spec, {d: swap.get(d, d) for d in range(ndim)}) + _partial(spec)


@register(aten.t.default, samples=_t_samples)
def _t(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    return _mapped(spec, {d: ndim - 1 - d for d in range(ndim)}) + _partial(spec)


def _slice_is_whole(size: int, start, end, step) -> bool:
    start = 0 if start is None else start
    end = size if end is None else end
    start = max(start + size, 0) if start < 0 else start
    end = end + size if end < 0 else end
    return step == 1 and start == 0 and end >= size


@register(aten.slice.Tensor, samples=_slice_samples)
def _slice(spec: OpSpec) -> list[AxisOption]:
    """Dims other than the sliced one pass through; so does the sliced dim if the slice takes
    all of it (captured graphs are full of ``x[:, 0:MAX]``), because a whole-dim slice of a
    shard is the whole shard."""
    ndim = spec.inputs[0].ndim
    dim = _norm(spec.arg(1, "dim", 0), ndim)
    whole = _slice_is_whole(spec.inputs[0].shape[dim], spec.arg(2, "start"), spec.arg(3, "end"), spec.arg(4, "step", 1))
    dims = [d for d in range(ndim) if d != dim or whole]
    return _mapped(spec, {d: d for d in dims}) + _partial(spec)


@register(aten.slice_scatter.default, samples=_slice_scatter_samples)
def _slice_scatter(spec: OpSpec) -> list[AxisOption]:
    """``x`` with ``x[dim][start:end:step]`` replaced by ``src``: every other dim shards in
    ``x``, ``src`` and the output alike; the written dim too where the slice takes all of it.
    The write is linear in ``x`` and ``src`` together."""
    x, src = spec.inputs
    dim = _norm(spec.arg(2, "dim", 0), x.ndim)
    whole = _slice_is_whole(x.shape[dim], spec.arg(3, "start"), spec.arg(4, "end"), spec.arg(5, "step", 1))
    return [AxisOption((Shard(d), Shard(d)), (Shard(d),)) for d in range(x.ndim)
            if (d != dim or whole) and x.shape[d] == src.shape[d] > 1] + _partial(spec)


@register(aten.select_scatter.default, samples=_select_scatter_samples)
def _select_scatter(spec: OpSpec) -> list[AxisOption]:
    """``x`` with ``x.select(dim, index)`` replaced by ``src`` (which lacks ``dim``): every other
    dim shards in ``x``, ``src`` and the output alike; linear in both together."""
    x, _ = spec.inputs
    dim = _norm(spec.arg(2, "dim"), x.ndim)
    return [AxisOption((Shard(d), Shard(d - (d > dim))), (Shard(d),)) for d in range(x.ndim)
            if d != dim and x.shape[d] > 1] + _partial(spec)


@register(aten.narrow.default, samples=_narrow_samples)
def _narrow(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    dim = _norm(spec.arg(1, "dim"), ndim)
    return _mapped(spec, {d: d for d in range(ndim) if d != dim}) + _partial(spec)


@register(aten.select.int, samples=_select_samples)
def _select(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    dim = _norm(spec.arg(1, "dim"), ndim)
    return _mapped(spec, {d: d - (d > dim) for d in range(ndim) if d != dim}) + _partial(spec)


def _split_like(spec: OpSpec, dim_index: int) -> list[AxisOption]:
    """split / split_with_sizes / chunk: every output keeps the dims other than the split dim."""
    ndim = spec.inputs[0].ndim
    dim = _norm(spec.arg(dim_index, "dim", 0), ndim)
    return _mapped(spec, {d: d for d in range(ndim) if d != dim}) + _partial(spec)


@register(aten.split.Tensor, samples=_split_samples)
def _split(spec: OpSpec) -> list[AxisOption]:
    return _split_like(spec, 2)


@register(aten.split_with_sizes.default, samples=_split_with_sizes_samples)
def _split_with_sizes(spec: OpSpec) -> list[AxisOption]:
    return _split_like(spec, 2)


@register(aten.chunk.default, samples=_chunk_samples)
def _chunk(spec: OpSpec) -> list[AxisOption]:
    return _split_like(spec, 2)


@register(aten.unbind.int, samples=_unbind_samples)
def _unbind(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    dim = _norm(spec.arg(1, "dim", 0), ndim)
    return _mapped(spec, {d: d - (d > dim) for d in range(ndim) if d != dim}) + _partial(spec)


def _join(spec: OpSpec, ndim: int, in_dims: list[int], to_out) -> list[AxisOption]:
    """cat / stack of ``ndim``-dim inputs: every input sharded alike on a dim the op does not
    join along. Legacy empty 1-D inputs of ``cat`` (which it ignores) stay replicated."""
    real = [t.ndim == ndim and t.shape != (0,) for t in spec.inputs]
    options = [
        AxisOption(tuple(Shard(d) if ok else R for ok in real), (Shard(to_out(d)),)) for d in in_dims
    ]
    if all(t.dtype.is_floating_point for t in spec.inputs):
        options.append(AxisOption(tuple(P if ok else R for ok in real), (P,)))
    return options


@register(aten.cat.default, aten.concatenate.default, aten.concat.default, samples=_cat_samples)
def _cat(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.outputs[0].ndim
    dim = _norm(spec.arg(1, "dim", 0), ndim)
    return _join(spec, ndim, [d for d in range(ndim) if d != dim], lambda d: d)


@register(aten.stack.default, samples=_stack_samples)
def _stack(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    dim = _norm(spec.arg(1, "dim", 0), ndim + 1)
    return _join(spec, ndim, list(range(ndim)), lambda d: d + (d >= dim))


def _padded_dims(ndim: int, pad) -> set[int]:
    return {ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}


@register(aten.pad.default, samples=_pad_samples)
def _pad(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    padded = _padded_dims(ndim, spec.arg(1, "pad"))
    mode, value = spec.arg(2, "mode", "constant"), spec.arg(3, "value")
    linear = mode != "constant" or not value
    return _mapped(spec, {d: d for d in range(ndim) if d not in padded}) + _partial(spec, linear=linear)


@register(aten.constant_pad_nd.default, samples=_constant_pad_samples)
def _constant_pad_nd(spec: OpSpec) -> list[AxisOption]:
    ndim = spec.inputs[0].ndim
    padded = _padded_dims(ndim, spec.arg(1, "pad"))
    linear = not spec.arg(2, "value", 0)
    return _mapped(spec, {d: d for d in range(ndim) if d not in padded}) + _partial(spec, linear=linear)


@register(aten.repeat.default, samples=_repeat_samples)
def _repeat(spec: OpSpec) -> list[AxisOption]:
    """Only dims repeated once pass through: a repeated shard is not a shard of the repeat."""
    repeats = spec.arg(1, "repeats")
    off = len(repeats) - spec.inputs[0].ndim
    dims = {d: d + off for d in range(spec.inputs[0].ndim) if repeats[d + off] == 1}
    return _mapped(spec, dims) + _partial(spec)


@register(aten.repeat_interleave.self_int, samples=_repeat_interleave_samples)
def _repeat_interleave(spec: OpSpec) -> list[AxisOption]:
    """Each element repeated in place: every dim passes through, the repeated one too (a block of
    elements becomes the block of their repeats); without ``dim`` the input is flattened first,
    so its first dim passes through as the result's."""
    dim = spec.arg(2, "dim")
    ndim = spec.inputs[0].ndim
    dims = {0: 0} if dim is None else {d: d for d in range(ndim)}
    return _mapped(spec, dims) + _partial(spec)


__all__ = ["view_dim_map"]
