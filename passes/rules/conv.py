"""Sharding rules for convolutions (1-, 2-, 3-d, plain and transposed).

Input ``[N, C, *spatial]`` (or unbatched ``[C, *spatial]``), weight ``[O, C/g, *k]`` (transposed:
``[C, O/g, *k]``), optional bias ``[O]``. One mesh axis can

- shard the batch N (weight and bias replicated): data parallel;
- shard the output channels O (input replicated, weight and bias sharded on O);
- shard the input channels C (input and weight sharded on C): the output is ``Partial(sum)``
  and the bias ``Partial`` too, so it is added once in the sum;
- pass a ``Partial`` input or weight through (the other replicated, bias ``Partial``):
  convolution with zero padding is linear in each.

Channel sharding as above needs ``groups == 1``. A depthwise conv (one input channel per group,
``groups == C``) can instead shard whole groups: input, weight and bias on channels, output on
channels; the rank must then pass its own group count, so the option names the local
implementation ``"groups"``. Other grouped convs get batch sharding and ``Partial`` only: a shard
count that does not divide the groups would split a group, and a rule cannot see the mesh.
Spatial sharding needs halo exchange between neighbours and is not offered.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.layout import LocalContext
from autopar.core.placement import P, R, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten

# op -> (index of `groups` in the schema, whether the weight is laid out transposed)
_CONV_OPS = {
    aten.conv1d.default: (6, False),
    aten.conv2d.default: (6, False),
    aten.conv3d.default: (6, False),
    aten.conv1d.padding: (6, False),
    aten.conv2d.padding: (6, False),
    aten.conv3d.padding: (6, False),
    aten.conv_transpose1d.default: (6, True),
    aten.conv_transpose2d.input: (6, True),
    aten.conv_transpose3d.input: (6, True),
}


def conv_options(spec: OpSpec, *, groups: int, transposed: bool) -> list[AxisOption]:
    """The one-axis options of a convolution call (see the module docstring)."""
    x, w, *rest = spec.inputs
    has_bias = bool(rest)
    batched = x.ndim == w.ndim
    c = 1 if batched else 0  # channel dim of input and output
    w_out, w_in = (1, 0) if transposed else (0, 1)
    floating = x.dtype.is_floating_point

    def option(xp, wp, bp, op):
        return AxisOption((xp, wp) + ((bp,) if has_bias else ()), (op,))

    options = []
    if batched:
        options.append(option(Shard(0), R, R, Shard(0)))
    if groups == 1:
        options.append(option(R, Shard(w_out), Shard(0), Shard(c)))
        if floating:
            options.append(option(Shard(c), Shard(w_in), P, P))
    elif groups == x.shape[c]:  # depthwise: shard whole groups, run with the local group count
        opt = option(Shard(c), Shard(0), Shard(0), Shard(c))
        options.append(AxisOption(opt.inputs, opt.outputs, local="groups"))
    if floating:
        options.append(option(P, R, P, P))
        options.append(option(R, P, P, P))
    return options


def groups_index(op) -> int:
    """Where ``op`` (a convolution) takes ``groups``."""
    return _CONV_OPS[op][0] if op in _CONV_OPS else 8


def with_local_groups(op, args, kwargs, local_channels: int, channels: int) -> tuple[list, dict]:
    """``op``'s arguments with ``groups`` scaled to a rank's ``local_channels`` of the input's
    ``channels`` (whole groups, as the depthwise option guarantees)."""
    index, args, kwargs = groups_index(op), list(args), dict(kwargs)
    groups = args[index] if index < len(args) else kwargs.get("groups", 1)
    local = groups * local_channels // channels
    if index < len(args):
        args[index] = local
    else:
        kwargs["groups"] = local
    return args, kwargs


def channel_dim(x, weight) -> int:
    """The input's channel dim: 1 for a batched input, 0 for an unbatched one."""
    return 1 if len(x.shape) == len(weight.shape) else 0


def _local_groups(op, args, kwargs, ctx: LocalContext) -> torch.Tensor:
    """The local implementation ``"groups"``: the conv with ``groups`` scaled to the rank's share
    of the input channels."""
    c, piece = channel_dim(args[0], args[1]), ctx.inputs[0]
    args, kwargs = with_local_groups(op, args, kwargs, piece.shape[c], piece.global_shape[c])
    return op(*args, **kwargs)


def _rule(groups_index: int, transposed: bool):
    def rule(spec: OpSpec) -> list[AxisOption]:
        return conv_options(spec, groups=int(spec.arg(groups_index, "groups", 1)), transposed=transposed)

    return rule


def _convolution(spec: OpSpec) -> list[AxisOption]:
    groups = int(spec.arg(8, "groups", 1))
    return conv_options(spec, groups=groups, transposed=bool(spec.arg(6, "transposed", False)))


# ---- samples the rule checker runs: channels and batch divisible by 8 ----
# float64: Partial operands are split into random unit-size addends, and on the 3-axis mesh the
# float32 rounding of a convolution's sums alone exceeds the checker's tolerance.


def _r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _samples_conv1d():
    yield (_r(8, 8, 6), _r(16, 8, 3), _r(16)), {}
    yield (_r(8, 8, 6), _r(8, 1, 3), None, [1], [1], [1], 8), {}  # depthwise


def _samples_conv2d():
    yield (_r(8, 8, 5, 5), _r(16, 8, 3, 3), _r(16), [1, 1], [1, 1]), {}
    yield (_r(8, 16, 4, 4), _r(8, 16, 2, 2), None, [2, 2]), {}
    yield (_r(8, 16, 4, 4), _r(16, 4, 3, 3), _r(16), [1, 1], [1, 1], [1, 1], 4), {}  # grouped
    yield (_r(8, 4, 4), _r(16, 8, 3, 3), _r(16)), {}  # unbatched
    yield (_r(8, 8, 5, 5), _r(16, 1, 3, 3), _r(16), [1, 1], [1, 1], [1, 1], 8), {}  # depthwise x2


def _samples_conv3d():
    yield (_r(8, 8, 3, 3, 3), _r(8, 8, 2, 2, 2)), {}


def _samples_conv2d_padding():
    yield (_r(8, 8, 5, 5), _r(16, 8, 3, 3), _r(16), [1, 1], "same"), {}


def _samples_conv1d_padding():
    yield (_r(8, 8, 6), _r(16, 8, 3), _r(16), [1], "same"), {}


def _samples_conv3d_padding():
    yield (_r(8, 8, 3, 3, 3), _r(8, 8, 3, 3, 3), None, [1, 1, 1], "same"), {}


def _samples_conv_transpose1d():
    yield (_r(8, 8, 5), _r(8, 16, 3), _r(16), [2]), {}


def _samples_conv_transpose2d():
    yield (_r(8, 8, 4, 4), _r(8, 16, 2, 2), _r(16), [2, 2]), {}
    yield (_r(8, 8, 4, 4), _r(8, 2, 3, 3), _r(8), [1, 1], [1, 1], [0, 0], 4), {}  # grouped
    yield (_r(8, 8, 4, 4), _r(8, 2, 3, 3), _r(16), [1, 1], [1, 1], [0, 0], 8), {}  # depthwise


def _samples_conv_transpose3d():
    yield (_r(8, 8, 2, 2, 2), _r(8, 8, 2, 2, 2)), {}


def _samples_convolution():
    yield (_r(8, 8, 5, 5), _r(16, 8, 3, 3), _r(16), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}
    yield (_r(8, 8, 4, 4), _r(8, 16, 2, 2), _r(16), [2, 2], [0, 0], [1, 1], True, [0, 0], 1), {}
    yield (_r(8, 8, 5, 5), _r(8, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8), {}


_SAMPLES = {
    aten.conv1d.default: _samples_conv1d,
    aten.conv2d.default: _samples_conv2d,
    aten.conv3d.default: _samples_conv3d,
    aten.conv1d.padding: _samples_conv1d_padding,
    aten.conv2d.padding: _samples_conv2d_padding,
    aten.conv3d.padding: _samples_conv3d_padding,
    aten.conv_transpose1d.default: _samples_conv_transpose1d,
    aten.conv_transpose2d.input: _samples_conv_transpose2d,
    aten.conv_transpose3d.input: _samples_conv_transpose3d,
}

for _op, (_groups_index, _transposed) in _CONV_OPS.items():
    register(_op, samples=_SAMPLES[_op], local_ops={"groups": _local_groups})(
        _rule(_groups_index, _transposed)
    )

register(aten.convolution.default, samples=_samples_convolution, local_ops={"groups": _local_groups})(
    _convolution
)
