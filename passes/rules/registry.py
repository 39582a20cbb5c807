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

Some shardings are exact only if each rank runs something other than the plain op on its
pieces (an embedding whose vocabulary rows are sharded must mask and shift its indices; a view
must be given its local shape). Such an option names a *local implementation*
(``AxisOption(..., local="vocab")``) that the rule registers with
``register(op, local_ops={"vocab": fn})``; ``fn(op, args, kwargs, ctx)`` gets the rank's local
tensors and a :class:`LocalContext` saying which part of each global tensor the rank holds.
The simulator and code generation call it instead of the op for strategies that carry its name.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from autopar.core.errors import ShardingError, UnsupportedOpWarning
from autopar.core.ir import IGNORED_OPS, OpSpec, Strategy
from autopar.core.layout import LocalContext
from autopar.core.placement import Placement, R, fits


@dataclass(frozen=True)
class AxisOption:
    """What one mesh axis does for an op: a placement per tensor input and per tensor output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    local: str | None = None  # name of the local implementation ranks must run (None: the op)


Rule = Callable[[OpSpec], list[AxisOption]]
SampleFn = Callable[[], Iterable[tuple[tuple, dict]]]
LocalOp = Callable[[Any, tuple, dict, LocalContext], Any]  # (op, local args, kwargs, ctx) -> result


@dataclass(frozen=True)
class RuleEntry:
    op: Any
    rule: Rule
    samples: SampleFn | None
    local_ops: dict = field(default_factory=dict)  # {name: LocalOp}


_REGISTRY: dict[Any, RuleEntry] = {}
_DERIVERS: list[Callable[[Any], RuleEntry | None]] = []  # rules made from torch's op metadata

def register(*ops, samples: SampleFn | None = None, local_ops: dict | None = None):
    """Decorator registering ``rule`` for ``ops``; ``samples`` yields real ``(args, kwargs)``
    for the rule checker; ``local_ops`` maps the names options use in ``AxisOption.local`` to
    local implementations ``fn(op, args, kwargs, ctx)``."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            if op in _REGISTRY:
                raise RuntimeError(f"two sharding rules registered for {op}")
            _REGISTRY[op] = RuleEntry(op, rule, samples, dict(local_ops or {}))
        return rule

    return deco


def registered_ops() -> list:
    """Every op with a rule, sorted by name."""
    return sorted(_REGISTRY, key=str)


def set_deriver(derive: Callable[[Any], RuleEntry | None]) -> None:
    """Add ``derive(op) -> RuleEntry | None``, asked for ops with no registered rule."""
    _DERIVERS.append(derive)


def explicit_entry(op) -> RuleEntry | None:
    """The rule registered for ``op`` by hand (no derived one)."""
    return _REGISTRY.get(op)


def entry(op) -> RuleEntry | None:
    """``op``'s rule: the registered one, else one derived from torch's metadata, else None."""
    ent = _REGISTRY.get(op)
    for derive in _DERIVERS:
        if ent is not None:
            break
        ent = derive(op)
    return ent


def has_rule(op) -> bool:
    return op in IGNORED_OPS or entry(op) is not None


def local_impl(op, name: str) -> LocalOp:
    """The local implementation ``name`` registered with ``op``'s rule."""
    ent = entry(op)
    if ent is None or name not in ent.local_ops:
        raise ShardingError(
            f"{op} has no local implementation {name!r}; a strategy naming it was not built by"
            " this registry (re-plan, or register it with register(..., local_ops=...))"
        )
    return ent.local_ops[name]


def _replicated_option(spec: OpSpec) -> AxisOption:
    return AxisOption((R,) * len(spec.inputs), (R,) * len(spec.outputs))


def axis_options(spec: OpSpec, *, warn: bool = True) -> list[AxisOption]:
    """The rule's one-axis options plus all-replicated; unknown ops warn and get replicated only."""
    ent = entry(spec.op)
    rep = _replicated_option(spec)
    if ent is None:
        if warn and spec.op not in IGNORED_OPS:
            warnings.warn(
                f"no sharding rule for {spec.op}; it will run replicated on every rank (correct,"
                " but possibly slow). To shard it, register a rule for it with"
                " autopar.passes.rules.registry.register (the rules of the other ops are the"
                " modules of autopar.passes.rules, one per op family).",
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
        if opt.local is not None and opt.local not in ent.local_ops:
            raise RuntimeError(f"rule for {spec.op} names local implementation {opt.local!r} but registers none")
        if opt not in options:
            options.append(opt)
    return options


def strategies(spec: OpSpec, mesh_shape: tuple[int, ...], *, warn: bool = True) -> list[Strategy]:
    """All strategies of ``spec`` on a mesh of ``mesh_shape`` whose shards divide evenly.

    Mesh axes of size 1 only replicate. The all-replicated strategy is always first. Axes whose
    options name different local implementations do not combine (a rank runs one).
    """
    options = axis_options(spec, warn=warn)
    rep = options[0]
    per_axis = [options if n > 1 else [rep] for n in mesh_shape]
    result: list[Strategy] = []
    seen = set()
    for combo in itertools.product(*per_axis):
        locals_ = {o.local for o in combo if o.local is not None}
        if len(locals_) > 1:
            continue
        ins = tuple(tuple(o.inputs[i] for o in combo) for i in range(len(spec.inputs)))
        outs = tuple(tuple(o.outputs[i] for o in combo) for i in range(len(spec.outputs)))
        if not all(fits(t.shape, s, mesh_shape) for t, s in zip(spec.inputs, ins)):
            continue
        if not all(fits(t.shape, s, mesh_shape) for t, s in zip(spec.outputs, outs)):
            continue
        strat = Strategy(ins, outs, locals_.pop() if locals_ else None)
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
    "LocalOp",
    "RuleEntry",
    "axis_options",
    "coverage",
    "entry",
    "explicit_entry",
    "has_rule",
    "local_impl",
    "register",
    "registered_ops",
    "set_deriver",
    "strategies",
]
