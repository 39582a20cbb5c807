"""Sharding rules: elementwise ops, as tables grouped by math property.

Every elementwise op shards any output dim; each input follows on its aligned dim (inputs align
to the output from the right, as broadcasting does) and stays ``Replicate`` where it is missing
or has size 1 there. ``Partial`` flows only through ops that are linear in the arguments that
carry it, with every other tensor argument replicated::

    neg(P) -> P      add(P, P) -> P      mul(P, R) -> P      where(R, P, P) -> P
    add(P, R), mul(P, P), exp(P), x > P:  not offered

The helpers at the top (:func:`tensor_arg_names`, :func:`option`, :func:`broadcast_shards`)
are shared by the reduction, softmax, norm and loss families.

Dropout is sharded like the identity. Its sharded and ``Partial`` options run
:func:`dropout_from_global_mask`: every rank draws the mask of the whole tensor, as one device
would, and keeps its piece. With every rank's RNG seeded alike this is exactly one device's
dropout (the same mask for ``Replicate``/``Partial``, the matching slice for ``Shard``), at the
price of drawing the whole mask on each rank. The all-replicated option draws the whole mask
anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from autopar.core.ir import OpSpec, TensorMeta
from autopar.core.placement import P, Placement, R, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten

# ---------------------------------------------------------------- helpers shared by the families


def tensor_arg_names(spec: OpSpec) -> list[str]:
    """Schema name of each tensor input of ``spec`` in pytree order (a list argument repeats
    its name once per tensor)."""
    schema_args = spec.op._schema.arguments
    names = []
    for path, leaf in pytree.tree_flatten_with_path((spec.args, spec.kwargs))[0]:
        if isinstance(leaf, TensorMeta):
            key = path[1]
            names.append(schema_args[key.idx].name if path[0].idx == 0 else key.key)
    return names


def option(spec: OpSpec, inputs: Mapping[str, Placement], outputs: Sequence[Placement]) -> AxisOption:
    """An :class:`AxisOption` placing tensor arguments by schema name (unnamed ones, and
    ``None`` optional tensors, are ``Replicate``)."""
    return AxisOption(tuple(inputs.get(n, R) for n in tensor_arg_names(spec)), tuple(outputs))


def broadcast_shards(spec: OpSpec, shape: Sequence[int]) -> list[tuple[int, tuple[Placement, ...]]]:
    """``(d, input placements)`` for each dim ``d`` of the broadcast result ``shape``: inputs
    right-aligned with ``d`` and of the same size shard on it, the rest (size 1, missing) replicate."""
    out = []
    for d, size in enumerate(shape):
        if size <= 1:
            continue
        placements = []
        for t in spec.inputs:
            j = d - (len(shape) - t.ndim)
            placements.append(Shard(j) if j >= 0 and t.shape[j] == size else R)
        out.append((d, tuple(placements)))
    return out


def is_float(t) -> bool:
    return isinstance(t, TensorMeta) and t.dtype.is_floating_point


# ---------------------------------------------------------------- the tables

UNARY = [  # y = f(x), nonlinear in x
    aten.abs.default, aten.cos.default, aten.erf.default, aten.exp.default, aten.expm1.default,
    aten.gelu.default, aten.log.default, aten.log1p.default, aten.reciprocal.default,
    aten.relu.default, aten.rsqrt.default, aten.sigmoid.default, aten.silu.default,
    aten.sin.default, aten.sqrt.default, aten.tanh.default, aten.clamp.default,
    aten.pow.Tensor_Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar,
]
LINEAR_UNARY = [  # y = f(x), linear in x: Partial passes through
    aten.neg.default, aten.mul.Scalar, aten.div.Scalar, aten.clone.default, aten.alias.default,
    aten._to_copy.default,
]
DROPOUT = [aten.dropout.default, aten.native_dropout.default]  # linear in x for a given mask
BINARY = [  # broadcasting z = f(x, y)
    aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor, aten.mul.Tensor, aten.div.Tensor,
    aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default,
]
COPY_INTO = [aten.copy_.default]  # self <- src (broadcast), in place: buffer updates in graphs
SELECT = [aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor]  # pick by a mask
COMPARE = [  # -> bool
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.le.Tensor, aten.le.Scalar,
    aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar,
]
LOGICAL = [  # bool/int -> bool/int
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.bitwise_not.default, aten.logical_not.default, aten.logical_and.default,
    aten.logical_or.default,
]


def _widening(spec: OpSpec) -> bool:
    """A float-to-float copy of the last tensor input that loses nothing (same dtype, or more
    precision and range)."""
    src, dst = spec.inputs[-1], spec.outputs[0]
    if not (is_float(src) and is_float(dst)):
        return False
    a, b = torch.finfo(src.dtype), torch.finfo(dst.dtype)
    return b.eps <= a.eps and b.max >= a.max


# op -> (groups of schema names that may carry Partial together, condition on the call)
_LINEAR: dict = {
    aten.neg.default: ((("self",),), None),
    aten.mul.Scalar: ((("self",),), None),
    aten.div.Scalar: ((("self",),), None),
    aten.clone.default: ((("self",),), None),
    aten.alias.default: ((("self",),), None),
    aten.dropout.default: ((("input",),), None),
    aten.native_dropout.default: ((("input",),), None),
    aten._to_copy.default: ((("self",),), _widening),
    aten.copy_.default: ((("self", "src"),), _widening),  # self is overwritten: its pieces are moot
    aten.add.Tensor: ((("self", "other"),), None),
    aten.sub.Tensor: ((("self", "other"),), None),
    aten.rsub.Tensor: ((("self", "other"),), None),
    aten.mul.Tensor: ((("self",), ("other",)), None),
    aten.div.Tensor: ((("self",),), None),
    aten.where.self: ((("self", "other"),), None),
    aten.masked_fill.Tensor: ((("self", "value"),), None),
    aten.masked_fill.Scalar: ((("self",),), lambda spec: spec.arg(2, "value") == 0),
}


def partial_options(spec: OpSpec) -> list[AxisOption]:
    """Options where a linear op's Partial arguments give a Partial result.

    A group applies when all its names are float tensors here; the other tensor arguments are
    replicated. Float outputs are Partial, the rest (native_dropout's mask) replicated.
    """
    groups, condition = _LINEAR.get(spec.op, ((), None))
    if condition is not None and not condition(spec):
        return []
    names = tensor_arg_names(spec)
    meta_of = dict(zip(names, spec.inputs))
    outs = tuple(P if is_float(t) else R for t in spec.outputs)
    if not any(o == P for o in outs):
        return []
    return [
        option(spec, {n: P for n in group}, outs)
        for group in groups
        if all(is_float(meta_of.get(n)) for n in group)
    ]


def elementwise_options(spec: OpSpec) -> list[AxisOption]:
    """Shard any dim of the result (inputs follow, broadcast dims replicate), plus Partial
    options of linear ops. A call without output metadata (an unlifted ``copy_`` node) gets
    none: its output shape is unknown."""
    if not spec.outputs:
        return []
    shape = spec.outputs[0].shape
    outs = [
        AxisOption(ins, tuple(Shard(d) if o.shape == tuple(shape) else R for o in spec.outputs))
        for d, ins in broadcast_shards(spec, shape)
    ]
    return outs + partial_options(spec)


def _dropout_options(spec: OpSpec) -> list[AxisOption]:
    return [dataclasses.replace(o, local="global_mask") for o in elementwise_options(spec)]


def dropout_from_global_mask(op, args, kwargs, ctx) -> torch.Tensor | tuple:
    """``dropout`` / ``native_dropout`` on this rank's piece, with the piece of the mask one
    device draws for the whole tensor (``empty_like(whole).bernoulli_(1 - p)`` scaled by
    ``1 / (1 - p)``, as eager CPU dropout does), so ranks seeded alike match one device."""
    names = ("input", "p", "train")
    x, p, train = (args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names))
    if train is False or p == 0 or p == 1 or x.numel() == 0:
        return op(*args, **kwargs)
    piece = ctx.inputs[0]
    noise = torch.empty(piece.global_shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    for d, (a, b) in enumerate(zip(piece.starts, piece.stops)):
        if (a, b) != (0, piece.global_shape[d]):
            noise = noise.narrow(d, a, b - a)
    out = x * (noise / (1 - p))
    return (out, noise != 0) if op is aten.native_dropout.default else out


# ---------------------------------------------------------------- samples


def _randn(*shape):
    return torch.randn(shape)


def _positive(*shape):
    return torch.rand(shape) + 0.5


_POSITIVE = {aten.log.default, aten.log1p.default, aten.reciprocal.default, aten.rsqrt.default,
             aten.sqrt.default}
_SCALAR_ARGS = {  # the non-tensor arguments of the unary ops' usual calls
    aten.clamp.default: (-0.5, 0.5),
    aten.pow.Tensor_Scalar: (2,),
    aten.add.Scalar: (1.0,),
    aten.sub.Scalar: (1.0,),
    aten.rsub.Scalar: (1.0,),
    aten.mul.Scalar: (0.5,),
    aten.div.Scalar: (8,),
    aten.dropout.default: (0.0, True),
    aten.native_dropout.default: (0.0, True),
}
_MORE_UNARY = {  # further calls seen in captured graphs
    aten.gelu.default: lambda: [((_randn(8, 16),), {"approximate": "tanh"})],
    aten.clamp.default: lambda: [((_randn(8, 16),), {"min": -0.5})],
    aten.pow.Tensor_Scalar: lambda: [((_positive(8, 16), 0.5), {}), ((_randn(2, 8, 16), 3.0), {})],
    aten.clone.default: lambda: [
        ((_randn(2, 8, 2, 8),), {"memory_format": torch.contiguous_format}),
        ((torch.randint(0, 9, (2, 8)),), {"memory_format": torch.contiguous_format}),
    ],
    aten.dropout.default: lambda: [((_randn(8, 16), 0.5, False), {})],
    aten.native_dropout.default: lambda: [((_randn(2, 8, 16), 0.1, False), {})],
}


def _unary_samples(op):
    make = _positive if op in _POSITIVE else _randn
    scalars = _SCALAR_ARGS.get(op, ())

    def samples():
        for shape in ((8, 16), ()):
            yield (make(*shape),) + scalars, {}
        yield from _MORE_UNARY.get(op, list)()

    return samples


def _to_copy_samples():
    yield (_randn(8, 16),), {"dtype": torch.float64}
    yield (_randn(8, 16),), {"dtype": torch.bfloat16}
    yield (torch.randint(0, 2, (2, 8)),), {"dtype": torch.bool, "device": torch.device("cpu")}
    yield (torch.randint(0, 9, (1, 8, 1)),), {"dtype": torch.float32}
    yield (_randn(8, 8),), {}


def _binary_samples(op):
    make = _positive if op in (aten.pow.Tensor_Tensor, aten.div.Tensor) else _randn

    def samples():
        yield (_randn(8, 16), make(8, 16)), {}
        yield (_randn(2, 8, 8), make(1, 8, 8)), {}  # broadcast over the batch (GPT-2 h + wpe)
        yield (_randn(8, 16), make(16)), {}  # missing leading dim
        yield (_randn(8, 1), make(1, 16)), {}  # both broadcast
        yield (_randn(8, 16), make()), {}  # 0-dim tensor
        if op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor):
            yield (_randn(8, 16), 0.5), {}  # Python scalar, as HF GELU/RoPE graphs call mul/add
        if op is aten.add.Tensor:
            yield (torch.randint(0, 9, (8,)), 0), {}  # GPT-2 position ids
        if op in (aten.add.Tensor, aten.sub.Tensor):
            yield (_randn(8, 16), _randn(8, 16)), {"alpha": 2}

    return samples


def _copy_samples():
    yield (torch.zeros(8, 16), _randn(8, 16)), {}
    yield (torch.zeros(8, 16), _randn(16)), {}  # src broadcasts
    yield (torch.zeros(8, 16, dtype=torch.float64), _randn(8, 16)), {}
    yield (torch.tensor(3), torch.tensor(4)), {}  # BatchNorm's num_batches_tracked update


def _mask(*shape):
    return torch.rand(shape) > 0.5


def _select_samples(op):
    def samples():
        if op is aten.where.self:
            yield (_mask(8, 16), _randn(8, 16), _randn(8, 16)), {}
            yield (_mask(1, 1, 8, 8), _randn(2, 2, 8, 8), torch.tensor(-1e4)), {}
            yield (_mask(8, 1), _randn(8, 16), _randn(16)), {}
        elif op is aten.masked_fill.Scalar:
            yield (_randn(2, 2, 8, 8), _mask(2, 1, 8, 8), float("-inf")), {}
            yield (_randn(8, 16), _mask(8, 16), 0.0), {}
            yield (torch.randint(0, 9, (8, 8)), _mask(8, 8), 0), {}
        else:
            yield (_randn(2, 2, 8, 8), _mask(2, 1, 8, 8), torch.tensor(-1e4)), {}
            yield (_randn(8, 16), _mask(16), torch.tensor(0.0)), {}

    return samples


def _compare_samples(op):
    scalar = op._overloadname == "Scalar"

    def samples():
        ints = torch.randint(0, 4, (8, 16))
        if scalar:
            yield (ints, 2), {}
            yield (_randn(8, 16), 0.0), {}
            yield (torch.arange(8).view(1, 1, 8, 1), 0), {}  # as BERT's mask code calls ge
        else:
            yield (ints, torch.randint(0, 4, (8, 16))), {}
            yield (_randn(2, 8, 16), _randn(1, 8, 16)), {}
            yield (torch.arange(8).view(1, 1, 1, 8), torch.arange(8).view(1, 1, 8, 1)), {}  # causal mask

    return samples


def _logical_samples(op):
    unary = op in (aten.bitwise_not.default, aten.logical_not.default)

    def samples():
        if unary:
            yield (_mask(8, 16),), {}
            yield (torch.randint(0, 4, (8, 8)),), {}
            return
        yield (_mask(8, 16), _mask(8, 16)), {}
        yield (torch.tensor(True), _mask(1, 1, 8, 8)), {}  # as GPT-2's mask code calls __and__
        yield (_mask(1, 1, 8, 8), _mask(2, 1, 1, 8)), {}
        yield (torch.randint(0, 4, (8, 8)), torch.randint(0, 4, (8, 8))), {}

    return samples


def _broadcast_tensors_options(spec: OpSpec) -> list[AxisOption]:
    """Each output is its input expanded: dims shard like elementwise ops, and a float input
    may be Partial on its own (its output is then Partial, the others replicated)."""
    partials = [
        AxisOption(tuple(P if j == i else R for j in range(len(spec.inputs))),
                   tuple(P if j == i else R for j in range(len(spec.outputs))))
        for i, t in enumerate(spec.inputs) if is_float(t)
    ]
    return elementwise_options(spec) + partials


def _broadcast_tensors_samples():
    yield ([_randn(8, 1, 8), _randn(1, 8, 8)],), {}
    yield ([_randn(8, 8), _randn(8, 8)],), {}
    yield ([_randn(8, 8), torch.randint(0, 4, (8,))],), {}


# ---------------------------------------------------------------- registration


def _register_all():
    for op in UNARY + LINEAR_UNARY:
        samples = _to_copy_samples if op is aten._to_copy.default else _unary_samples(op)
        register(op, samples=samples)(elementwise_options)
    for op in BINARY:
        register(op, samples=_binary_samples(op))(elementwise_options)
    for op in SELECT:
        register(op, samples=_select_samples(op))(elementwise_options)
    for op in DROPOUT:
        register(op, samples=_unary_samples(op), local_ops={"global_mask": dropout_from_global_mask})(
            _dropout_options)
    register(aten.copy_.default, samples=_copy_samples)(elementwise_options)
    register(aten.broadcast_tensors.default, samples=_broadcast_tensors_samples)(_broadcast_tensors_options)
    for op in COMPARE:
        register(op, samples=_compare_samples(op))(elementwise_options)
    for op in LOGICAL:
        register(op, samples=_logical_samples(op))(elementwise_options)


_register_all()

__all__ = [
    "BINARY",
    "COMPARE",
    "COPY_INTO",
    "LINEAR_UNARY",
    "DROPOUT",
    "LOGICAL",
    "SELECT",
    "UNARY",
    "broadcast_shards",
    "elementwise_options",
    "is_float",
    "option",
    "partial_options",
    "tensor_arg_names",
]
