"""The sharding-rule registry: one rule per ATen op, expanded to strategies on a logical mesh.

A *rule* describes what an op can do on ONE mesh axis: a list of :class:`AxisOption` (one
placement per tensor input, one per tensor output). :func:`strategies` takes the cartesian
product of those options over the mesh axes, keeps the ones whose shards divide evenly, and
always includes the all-replicated strategy. An op's own communication shows up as a
``Partial`` output: a pending reduction that resharding turns into a collective.

Tensor inputs and outputs are counted in pytree order of ``(args, kwargs)`` and of the result.
Rules are registered per family in the sibling modules::

    @register(aten.relu.default, samples=unary_samples)
    def _relu(spec: OpSpec) -> list[AxisOption]: ...
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from autopar.errors import UnsupportedOpWarning
from autopar.placement import R, Placement, Sharding, fits


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor, standing in for it where rules look at an op's arguments."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpSpec:
    """One call of an op as a rule sees it: tensors replaced by :class:`TensorMeta`."""

    op: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[TensorMeta, ...] = ()

    @property
    def inputs(self) -> list[TensorMeta]:
        """The tensor inputs in pytree order."""
        return [x for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, TensorMeta)]

    def arg(self, index: int, name: str, default=None):
        """Positional-or-keyword argument ``index``/``name``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class AxisOption:
    """What one mesh axis does for an op: a placement per tensor input and per tensor output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    """A full-mesh strategy: a sharding (placement per mesh axis) per tensor input and output."""

    inputs: tuple[Sharding, ...]
    outputs: tuple[Sharding, ...]

    @property
    def name(self) -> str:
        from autopar.placement import format_sharding

        ins = " ".join(f"[{format_sharding(s)}]" for s in self.inputs)
        outs = " ".join(f"[{format_sharding(s)}]" for s in self.outputs)
        return f"{ins} -> {outs}"


Rule = Callable[[OpSpec], list[AxisOption]]
SampleFn = Callable[[], Iterable[tuple[tuple, dict]]]


@dataclass(frozen=True)
class RuleEntry:
    op: Any
    rule: Rule
    samples: SampleFn | None


_REGISTRY: dict[Any, RuleEntry] = {}

# Ops that compute nothing planning cares about (asserts); they never need a rule.
IGNORED_OPS: set = {torch.ops.aten._assert_tensor_metadata.default}


def register(*ops, samples: SampleFn | None = None):
    """Decorator registering ``rule`` for ``ops``; ``samples`` yields real ``(args, kwargs)``
    for the rule checker."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            if op in _REGISTRY:
                raise RuntimeError(f"two sharding rules registered for {op}")
            _REGISTRY[op] = RuleEntry(op, rule, samples)
        return rule

    return deco


def registered_ops() -> list:
    """Every op with a rule, sorted by name."""
    return sorted(_REGISTRY, key=str)


def entry(op) -> RuleEntry | None:
    return _REGISTRY.get(op)


def has_rule(op) -> bool:
    return op in _REGISTRY or op in IGNORED_OPS


def to_meta(value):
    """Replace tensors (real, fake or meta) in a pytree by :class:`TensorMeta`."""

    def conv(x):
        if isinstance(x, torch.Tensor):
            return TensorMeta(tuple(int(s) for s in x.shape), x.dtype)
        return x

    return pytree.tree_map(conv, value)


def spec_of_call(op, args, kwargs, result) -> OpSpec:
    """An :class:`OpSpec` from a call's real (or fake) arguments and result."""
    outs = tuple(x for x in pytree.tree_leaves(to_meta(result)) if isinstance(x, TensorMeta))
    return OpSpec(op, to_meta(tuple(args)), to_meta(dict(kwargs)), outs)


def spec_of_node(node: torch.fx.Node) -> OpSpec:
    """An :class:`OpSpec` from an FX node whose args carry ``meta["val"]``."""

    def val(x):
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x

    args = pytree.tree_map(val, tuple(node.args))
    kwargs = pytree.tree_map(val, dict(node.kwargs))
    return spec_of_call(node.target, args, kwargs, node.meta.get("val"))


def _replicated_option(spec: OpSpec) -> AxisOption:
    return AxisOption((R,) * len(spec.inputs), (R,) * len(spec.outputs))


def axis_options(spec: OpSpec, *, warn: bool = True) -> list[AxisOption]:
    """The rule's one-axis options plus all-replicated; unknown ops warn and get replicated only."""
    ent = _REGISTRY.get(spec.op)
    rep = _replicated_option(spec)
    if ent is None:
        if warn and spec.op not in IGNORED_OPS:
            warnings.warn(
                f"no sharding rule for {spec.op}; it will run replicated on every rank (correct,"
                " but possibly slow). Add a rule under autopar/passes/rules/ to shard it.",
                UnsupportedOpWarning,
                stacklevel=2,
            )
        return [rep]
    options = [rep]
    n_in, n_out = len(spec.inputs), len(spec.outputs)
    for opt in ent.rule(spec):
        if len(opt.inputs) != n_in or len(opt.outputs) != n_out:
            raise RuntimeError(
                f"rule for {spec.op} returned {len(opt.inputs)}/{len(opt.outputs)} placements for"
                f" an op with {n_in} tensor inputs and {n_out} outputs"
            )
        if opt not in options:
            options.append(opt)
    return options


def strategies(spec: OpSpec, mesh_shape: tuple[int, ...], *, warn: bool = True) -> list[Strategy]:
    """All strategies of ``spec`` on a mesh of ``mesh_shape`` whose shards divide evenly.

    Mesh axes of size 1 only replicate. The all-replicated strategy is always first.
    """
    options = axis_options(spec, warn=warn)
    rep = options[0]
    per_axis = [options if n > 1 else [rep] for n in mesh_shape]
    result: list[Strategy] = []
    seen = set()
    for combo in itertools.product(*per_axis):
        ins = tuple(tuple(o.inputs[i] for o in combo) for i in range(len(spec.inputs)))
        outs = tuple(tuple(o.outputs[i] for o in combo) for i in range(len(spec.outputs)))
        if not all(fits(t.shape, s, mesh_shape) for t, s in zip(spec.inputs, ins)):
            continue
        if not all(fits(t.shape, s, mesh_shape) for t, s in zip(spec.outputs, outs)):
            continue
        strat = Strategy(ins, outs)
        if strat not in seen:
            seen.add(strat)
            result.append(strat)
    return result


def coverage(graph_module: torch.fx.GraphModule) -> dict[str, bool]:
    """``{op name: has a rule}`` for every ATen op called in ``graph_module``."""
    out: dict[str, bool] = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target in IGNORED_OPS:
                continue
            out[str(node.target)] = has_rule(node.target)
    return dict(sorted(out.items()))


__all__ = [
    "AxisOption",
    "OpSpec",
    "RuleEntry",
    "Strategy",
    "TensorMeta",
    "axis_options",
    "coverage",
    "entry",
    "has_rule",
    "register",
    "registered_ops",
    "spec_of_call",
    "spec_of_node",
    "strategies",
]
