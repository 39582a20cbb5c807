"""Sharding rules for matmul-like ops, each written as an einsum equation (see ``einsum.py``).

The options of one mesh axis are the Alpa/Megatron ones: shard a batch or row dim (data
parallel), shard the weight's output features (column parallel), shard the contracted dim
(row parallel, output ``Partial(sum)``), or pass a ``Partial`` operand through. Combinations on
2- and 3-axis meshes come from the registry's product over axes.

Bias terms (``addmm``, ``baddbmm``, ``linear`` with bias, ...) follow the output: sharded with it
where they have that dim, ``Partial`` when the output is ``Partial`` (each rank adds its share).
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec, TensorMeta
from autopar.core.placement import P
from autopar.passes.rules.einsum import addend_placement, einsum_options, parse_equation
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


def _is_float(t: TensorMeta) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def einsum_rule(
    equation: str,
    operands: list[TensorMeta],
    out: TensorMeta,
    *,
    bias: TensorMeta | None = None,
    bias_index: int = 0,
) -> list[AxisOption]:
    """AxisOptions of an op computing ``equation`` over ``operands`` (its tensor inputs in order),
    plus ``bias`` (added to the output) at tensor input ``bias_index`` when given.

    ``Partial`` operands are offered for floating point only (a ``Partial`` integer bias is
    never needed and the checker cannot split integers into random addends).
    """
    eq = parse_equation(equation, ndims=[t.ndim for t in operands])
    floating = all(_is_float(t) for t in operands) and (bias is None or _is_float(bias))
    result = []
    for opt in einsum_options(eq, shapes=[t.shape for t in operands], partial_inputs=floating):
        ins = list(opt.operands)
        if bias is not None:
            placement = addend_placement(opt.output, addend_shape=bias.shape, out_shape=out.shape)
            if placement == P and not floating:
                continue
            ins.insert(bias_index, placement)
        result.append(AxisOption(tuple(ins), (opt.output,)))
    return result


# ---- samples the rule checker runs: shardable dims divisible by 8, tensors tiny ----
# float64 mostly: Partial operands are split into random unit-size addends, and on the 3-axis
# mesh float32 rounding of the sums alone can reach the checker's tolerance.


def _rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def _samples_mm():
    yield (_rand(8, 16), _rand(16, 24)), {}
    yield (_rand(8, 8, dtype=torch.float32), _rand(8, 8, dtype=torch.float32)), {}
    yield (torch.randint(-4, 4, (8, 16)), torch.randint(-4, 4, (16, 8))), {}


def _samples_bmm():
    yield (_rand(8, 8, 16), _rand(8, 16, 8)), {}


def _samples_mv():
    yield (_rand(8, 16), _rand(16)), {}


def _samples_dot():
    yield (_rand(16), _rand(16)), {}


def _samples_matmul():
    yield (_rand(8, 8, 16), _rand(16, 8)), {}  # linear-like: batch dims on one side
    yield (_rand(8, 1, 8, 16), _rand(8, 16, 8)), {}  # broadcast batch dims
    yield (_rand(16), _rand(8, 16, 8)), {}
    yield (_rand(8, 8, 16), _rand(16)), {}
    yield (_rand(16), _rand(16)), {}


def _samples_addmm():
    yield (_rand(24), _rand(8, 16), _rand(16, 24)), {}
    yield (_rand(8, 24), _rand(8, 16), _rand(16, 24)), {"beta": 0.5, "alpha": 2.0}
    yield (_rand(8, 1), _rand(8, 16), _rand(16, 24)), {}
    ints = lambda *s: torch.randint(-4, 4, s)  # noqa: E731
    yield (ints(24), ints(8, 16), ints(16, 24)), {}


def _samples_baddbmm():
    yield (_rand(8, 8, 8), _rand(8, 8, 16), _rand(8, 16, 8)), {"beta": 0.5, "alpha": 2.0}
    yield (_rand(8), _rand(8, 8, 16), _rand(8, 16, 8)), {}


def _samples_addbmm():
    yield (_rand(8, 24), _rand(8, 8, 16), _rand(8, 16, 24)), {}


def _samples_addmv():
    yield (_rand(8), _rand(8, 16), _rand(16)), {"alpha": 3.0}


def _samples_linear():
    yield (_rand(8, 8, 16), _rand(24, 16), _rand(24)), {}
    yield (_rand(8, 16), _rand(24, 16)), {}
    yield (_rand(16), _rand(24, 16), _rand(24)), {}


EINSUM_SAMPLE_EQUATIONS = (
    ("bsd,de->bse", ((8, 8, 16), (16, 8))),
    ("bhqd,bhkd->bhqk", ((8, 8, 8, 4), (8, 8, 8, 4))),
    ("sec,sm->ecm", ((16, 8, 8), (16, 8))),  # MoE dispatch (GShard)
    ("sec,ecm->sm", ((16, 8, 8), (8, 8, 8))),  # MoE combine
    ("ecm,emh->ech", ((8, 8, 16), (8, 16, 8))),  # per-expert FFN
    ("...d,de->...e", ((8, 8, 16), (16, 8))),
    ("ij,jk", ((8, 16), (16, 8))),  # implicit output
    ("ij->j", ((8, 16),)),
    ("bi,bj->bij", ((8, 8), (8, 16))),
)


def _samples_einsum():
    for equation, shapes in EINSUM_SAMPLE_EQUATIONS:
        yield (equation, [_rand(*s) for s in shapes]), {}


def _matmul_equation(a: int, b: int) -> str:
    """``torch.matmul`` of operands with ``a`` and ``b`` dims as an einsum (batch dims broadcast)."""
    if a == 1 and b == 1:
        return "k,k->"
    if b == 1:
        return "...mk,k->...m"
    if a == 1:
        return "k,...kn->...n"
    return "...mk,...kn->...mn"


@register(aten.mm.default, samples=_samples_mm)
def _mm(spec: OpSpec) -> list[AxisOption]:
    a, b = spec.inputs
    return einsum_rule("ij,jk->ik", [a, b], spec.outputs[0])


@register(aten.bmm.default, samples=_samples_bmm)
def _bmm(spec: OpSpec) -> list[AxisOption]:
    a, b = spec.inputs
    return einsum_rule("bij,bjk->bik", [a, b], spec.outputs[0])


@register(aten.mv.default, samples=_samples_mv)
def _mv(spec: OpSpec) -> list[AxisOption]:
    a, b = spec.inputs
    return einsum_rule("ij,j->i", [a, b], spec.outputs[0])


@register(aten.dot.default, samples=_samples_dot)
def _dot(spec: OpSpec) -> list[AxisOption]:
    a, b = spec.inputs
    return einsum_rule("i,i->", [a, b], spec.outputs[0])


@register(aten.matmul.default, samples=_samples_matmul)
def _matmul(spec: OpSpec) -> list[AxisOption]:
    a, b = spec.inputs
    return einsum_rule(_matmul_equation(a.ndim, b.ndim), [a, b], spec.outputs[0])


def _add_product_rule(equation: str):
    def rule(spec: OpSpec) -> list[AxisOption]:
        bias, a, b = spec.inputs
        return einsum_rule(equation, [a, b], spec.outputs[0], bias=bias, bias_index=0)

    return rule


register(aten.addmm.default, samples=_samples_addmm)(_add_product_rule("ij,jk->ik"))
register(aten.baddbmm.default, samples=_samples_baddbmm)(_add_product_rule("bij,bjk->bik"))
register(aten.addbmm.default, samples=_samples_addbmm)(_add_product_rule("bij,bjk->ik"))
register(aten.addmv.default, samples=_samples_addmv)(_add_product_rule("ij,j->i"))


@register(aten.linear.default, samples=_samples_linear)
def _linear(spec: OpSpec) -> list[AxisOption]:
    x, w, *rest = spec.inputs
    bias = rest[0] if rest else None
    return einsum_rule("...i,oi->...o", [x, w], spec.outputs[0], bias=bias, bias_index=2)


@register(aten.einsum.default, samples=_samples_einsum)
def _einsum(spec: OpSpec) -> list[AxisOption]:
    equation = spec.arg(0, "equation")
    return einsum_rule(equation, spec.inputs, spec.outputs[0])
