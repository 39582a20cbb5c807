"""Elementwise rules derived from torch's own op metadata, for every op no family lists by hand.

An ATen overload is elementwise when torch tags it ``torch.Tag.pointwise`` (``min.other``,
``fmod.Scalar``, ``bitwise_xor.Tensor``, ... every dtype signature), or when it is a composite
op whose registered decomposition (its ``CompositeImplicitAutograd`` kernel, traced once on
small sample arguments) calls only elementwise ops on its tensors (``type_as``,
``where.ScalarOther``, ...).
Such an op gets :func:`~autopar.passes.rules.pointwise.elementwise_options` (shard any dim,
inputs follow by broadcasting; no ``Partial``, which needs linearity the tags do not state) and
samples built from its schema, so the rule checker runs it like the hand-written rules.
In-place, ``out=`` and random (``nondeterministic_seeded``) overloads are left out.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from autopar.passes.rules.pointwise import elementwise_options
from autopar.passes.rules.registry import RuleEntry, explicit_entry, set_deriver

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.int64, torch.bool)


def _tensor(shape, dtype):
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.rand(shape) + 0.5  # positive: log, sqrt, pow stay finite
    return torch.randint(1, 5, shape, dtype=dtype)


def _value(kind: str, dtype, shape):
    """A sample value of a schema type, or ``KeyError``."""
    if kind == "TensorType":
        return _tensor(shape, dtype)
    return {"NumberType": 2, "IntType": 1, "FloatType": 0.5, "BoolType": False}[kind]


def _call(op, dtypes, fill_optional: bool, broadcast: bool):
    """``(args, kwargs)`` of one call of ``op`` from its schema: tensors of ``dtypes`` in turn,
    shaped (4, 8) (the others (8,) when ``broadcast``); optional arguments given a value when
    ``fill_optional`` (else None), kwarg-only ones with a default left out."""
    args, kwargs, tensors = [], {}, iter(dtypes)
    for arg in op._schema.arguments:
        kind = arg.type.kind()
        if arg.kwarg_only and arg.has_default_value():
            continue
        if kind == "OptionalType":
            inner = arg.type.getElementType().kind()
            value = _value(inner, next(tensors) if inner == "TensorType" else None,
                           (8,) if broadcast else (4, 8)) if fill_optional else None
        else:
            value = _value(kind, next(tensors) if kind == "TensorType" else None,
                           (8,) if broadcast and args else (4, 8))
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


@functools.cache
def _calls(op) -> list[tuple[tuple, dict]]:
    """Calls of ``op`` on small real tensors that run, from its schema: the first combination of
    tensor dtypes (:data:`_DTYPES`) and optional arguments that works, with all tensors of one
    shape and, where it runs too, broadcasting."""
    n = sum(a.type.kind() == "TensorType" or (a.type.kind() == "OptionalType"
            and a.type.getElementType().kind() == "TensorType") for a in op._schema.arguments)
    for fill, dtypes in itertools.product((False, True), itertools.product(_DTYPES, repeat=n)):
        calls = []
        for broadcast in (False, True):
            try:
                args, kwargs = _call(op, dtypes, fill, broadcast)
                op(*args, **kwargs)
            except Exception:  # these dtypes (or this schema) do not suit the op: try the next
                break
            calls.append((args, kwargs))
        if calls:
            return calls
    return []


def _is_elementwise(op) -> bool:
    return torch.Tag.pointwise in op.tags or (
        (ent := explicit_entry(op)) is not None and ent.rule is elementwise_options)


def _decomposes_elementwise(op) -> bool:
    """``op``'s composite kernel, traced on its sample, calls only elementwise ops."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return False
    calls = _calls(op)
    if not calls:
        return False
    args, kwargs = calls[0]
    flat, tree = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]

    def run(*ts):
        values = list(flat)
        for i, t in zip(tensors, ts):
            values[i] = t
        a, k = pytree.tree_unflatten(values, tree)
        return op.decompose(*a, **k)

    try:
        graph = make_fx(run, tracing_mode="fake")(*(flat[i] for i in tensors)).graph
    except Exception:  # a kernel that cannot be traced is not derived
        return False
    # a call on no traced tensor makes a constant (where.ScalarOther's scalar_tensor)
    calls = [n for n in graph.nodes if n.op == "call_function" and n.all_input_nodes]
    return all(isinstance(n.target, torch._ops.OpOverload) and _is_elementwise(n.target) for n in calls)


@functools.cache
def derived_entry(op) -> RuleEntry | None:
    """The derived elementwise rule of ``op``, or ``None`` (see the module docstring)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    schema = op._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags or not schema.returns:
        return None
    if not all(r.type.kind() == "TensorType" for r in schema.returns):
        return None
    if torch.Tag.pointwise not in op.tags and not _decomposes_elementwise(op):
        return None
    return RuleEntry(op, elementwise_options, functools.partial(_calls, op))


@functools.cache
def pointwise_ops() -> tuple:
    """Every ATen overload tagged pointwise that gets a derived rule (no hand-written one)."""
    names = {(s.name[len("aten::"):], s.overload_name or "default")
             for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")}
    ops = []
    for name, overload in sorted(names):
        op = getattr(getattr(aten, name, None), overload, None)
        if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags \
                and explicit_entry(op) is None and derived_entry(op) is not None:
            ops.append(op)
    return tuple(ops)


set_deriver(derived_entry)

__all__ = ["derived_entry", "pointwise_ops"]
