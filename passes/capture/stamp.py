"""Layer stamping: capture a deep model by tracing its first repeated layers and copying the rest.

Tracing costs time per graph node and a deep transformer is mostly identical layers, so
:func:`autopar.passes.capture.capture` traces the model with each repeated-layer container cut to
its first ``TRACED`` (3) units and builds the other units' nodes by copying ("stamping") those of
the last traced unit. A unit is one layer, or in a hybrid stack that repeats with a period of
``P`` layers (Qwen3-Next: three linear-attention layers, then one attention layer) ``P`` layers::

    with truncated(model, containers) as accesses:    # model.layers holds layers 0, 1, 2 only
        exported = trace(model)
    check_accesses(accesses, containers)               # forward iterated over every layer
    gm, inputs = stamp(gm, inputs, containers)         # layers 3 .. N-1 copied from layer 2

**A last unit unlike the others.** Export drops what only a next unit would read (Zaya hands
each layer's router state to the next), so the last traced unit may be shorter than the one
before it, and three units do not stamp. Capture then traces one unit more (:meth:`Stack.spare`,
where the container has more than four): units 1 and 2 are compared, unit 2 is the template of
units 3 .. N-2, and the traced unit 3 becomes the model's last, unit N-1 (its parameters renamed,
its reads of the unit before it moved to unit N-2's copies).

**Segments.** In the traced graph (execution order), segment ``j`` runs from unit ``j``'s first
compute node up to unit ``j+1``'s; it holds the unit's nodes and the loop body around them
(e.g. ``aux_total = aux_total + aux``). The last segment is as long as the one before it; a
spare one (the model's last unit) ends after its layers' last node, or after the last node that
reads both it and the segment before it (the running sum after the last layer); a tail's nodes
end it.

**When it stamps.** A container is stamped only if all of these hold, else the model is traced
whole (the reason is logged at debug level on ``autopar.passes.capture.stamp``), so the result always
equals the full trace:

- between a prefix and a tail of at most a quarter of its children each (the shortest tail,
  then the shortest prefix that allow it; both traced as they are), it has more than ``TRACED``
  units (its period ``P``: the smallest that divides the number of children between them, such
  that children ``P`` apart are structurally alike and alike in the per-layer lists of the
  config that modules hold, ``config.layer_types``), and the plain attributes of children ``P``
  apart are equal, except integers that count up by the same step from unit to unit (like
  ``layer_idx``); an attribute such as ``attention_type`` or ``is_sliding`` that varies
  otherwise gives a longer period or stops it. With a tail (Flint's last unit is a layer
  short) it has more than ``TRACED + 1`` units: the tail is traced after a spare unit, and the
  model's last unit and tail are those traced. Forward often looks a layer's settings up by the
  loop's index (``config.layer_types[i]``), which a cut container shifts for the tail, so
  then the per-layer lists are cut alike while tracing (:func:`truncated`);
- no parameter or buffer of a unit is the one that others are tied to: a unit may use one tied
  to something before the units (Zamba's hybrid layers share the block of its first, in the
  prefix), which every unit then reads as a node from before the layers;
- forward reached the children only by iterating over the whole container (``for``, ``zip``,
  ``enumerate``, or a slice covering all of it, as HF's ``self.layers[:num_hidden_layers]``), to
  the end, never by index (``self.layers[3]``); or forward never touched the container (not
  iterated, indexed nor measured with ``len``: an audio tower text inputs do not run) and no node
  but its placeholders is in it: the trace is kept and the cut children's parameters and
  buffers are added as unread placeholders, as a full trace has them (:func:`add_untouched`);
- every traced layer ran once, its nodes inside its unit's segment, in order;
- segments 1 and 2 are as long and isomorphic: position by position the same op, the same non-tensor
  arguments, output shapes and dtypes and module paths (up to the layer prefix, by place in the
  unit), and each tensor argument plays the same role: a node of the same segment or of the one
  before (same position), the unit's own parameter (same place and relative name), or the same
  node from before the layers;
- a segment reads only itself and the one before it (the last may read the unit's parameters and
  nodes from before the layers too); nothing after the layers reads a segment other than the
  last, and no graph output other than
  a user output (say, a buffer update) comes from a segment.

Not detected: a forward that branches on a layer's index in Python (``if self.layer_idx % 4 ==
3``) while the layers' attributes and the traced layers agree, and a loop that stops at a fixed
count of at least ``TRACED`` layers (``if i == 40: break``): the cut container ends before it.

**The stamped graph** lists placeholders in the model's parameter (buffer) order, as a full trace
does; names new placeholders the way export does (``p_model_layers_17_mlp_up_proj_weight``);
renames every compute node in graph order (``linear``, ``linear_1``, ...); and gives each new
node a copy of its template's meta with a fresh fake tensor as ``val``, module paths (and
``nn_module_stack``) moved to the layer at its place in the new unit, and ``autopar_layer`` set
to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import typing

import torch
from torch import nn
from torch.fx.node import map_arg

from autopar.passes.capture.graph import GraphInput, lazy_graph_module, tensor_meta
from autopar.passes.capture.layers import layer_of, prefix_lengths, signature

log = logging.getLogger(__name__)

TRACED = 3  # units traced per container: 0 (read from before), 1 and 2 compared

_DROPPED_META = ("from_node", "seq_nr", "desc")


class NotStampable(Exception):
    """Internal: stamping does not apply (the message says why); capture traces in full."""


# ----------------------------------------------------------------------------- containers


def _plain_attrs(module: nn.Module) -> dict:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool
        return False


class Stack(typing.NamedTuple):
    """A container to stamp: its children's FQNs, its period (layers per unit), the number of
    children before its first unit (a prefix, traced as it is: DeepSeek-V3's dense layers), the
    units traced (``TRACED``, or one more: the spare is the model's last unit) and the number of
    children after the last unit (a tail, traced as it is with the spare: Flint's last unit a
    layer short)."""

    children: tuple[str, ...]
    period: int
    offset: int = 0
    traced_units: int = TRACED
    tail: int = 0

    @property
    def spared(self) -> bool:
        return self.traced_units > TRACED

    def spare(self) -> Stack | None:
        """This stack traced one unit further, or None where that leaves nothing to copy."""
        return self._replace(traced_units=TRACED + 1) if self.units > TRACED + 1 else None

    def unit(self, j: int) -> tuple[str, ...]:
        start = self.offset + j * self.period
        return self.children[start:start + self.period]

    @property
    def units(self) -> int:
        return (len(self.children) - self.offset - self.tail) // self.period

    @property
    def tail_children(self) -> tuple[str, ...]:
        return self.children[len(self.children) - self.tail:]

    @property
    def traced(self) -> tuple[str, ...]:
        """The children a truncated trace runs: the prefix, the first ``traced_units`` and the tail."""
        return self.children[:self.offset + self.traced_units * self.period] + self.tail_children


def _uniform_reason(children: list[nn.Module]) -> str | None:
    """Why the children's plain attributes differ beyond an index counter (an integer that
    counts up by the same step from child to child), or ``None``."""
    per_child = [list(c.named_modules()) for c in children]
    for pos, (name, _) in enumerate(per_child[0]):
        attrs = [_plain_attrs(mods[pos][1]) for mods in per_child]
        for key, v0 in attrs[0].items():
            values = [a.get(key, _MISSING) for a in attrs]
            if all(_same(v, v0) for v in values):
                continue
            if _counts_up(values):
                continue  # a layer index (layer_idx): what it indexes, the segments' isomorphism checks
            where = f"{name}.{key}" if name else key
            i = next(i for i, v in enumerate(values) if not _same(v, v0))
            return (f"children differ in attribute {where!r}: {v0!r} in the first, "
                    f"{values[i]!r} in #{i}")
    return None


_MISSING = object()


def _offset_period(modules: list[nn.Module], settings: list) -> tuple[int, int | None, int, str]:
    """``(offset, period, tail)``: the shortest tail, then the shortest prefix, between which
    ``modules`` (and their per-layer ``settings``: :func:`_layer_settings`) repeat with a period
    that leaves more than ``TRACED`` units (one more with a tail: it is traced with a spare unit),
    and the smallest such period (:func:`_period`); a prefix and a tail are each at most a
    quarter of the stack (:func:`prefix_lengths`). ``(0, None, 0, why)`` where none does."""
    reason = ""
    kinds: dict = {}  # signature -> a small int: periods compare ints
    signatures = [kinds.setdefault((signature(m), tuple(values[k] for values in settings)), len(kinds))
                  for k, m in enumerate(modules)]
    n = len(modules)
    for tail in prefix_lengths(n):
        for offset in prefix_lengths(n):
            body = slice(offset, n - tail)
            period, why = _period(modules[body], signatures[body], TRACED + 1 + (tail > 0))
            if period is not None:
                return offset, period, tail, ""
            reason = reason or why
    return 0, None, 0, reason


def _period(modules: list[nn.Module], signatures: list, least_units: int) -> tuple[int | None, str]:
    """The smallest period of ``modules`` (their ``signatures``: structure and settings) that leaves at least
    ``least_units`` units (module docstring), or ``(None, why none does)``."""
    reason = "a hybrid stack that does not repeat"
    for period in range(1, len(modules) // least_units + 1):
        if len(modules) % period or any(signatures[k] != signatures[k % period] for k in range(len(modules))):
            continue
        reason = next(filter(None, (_uniform_reason(modules[r::period]) for r in range(period))), None)
        if reason is None:
            return period, ""
    return None, reason


def stampable(model: nn.Module, containers: dict[str, tuple[str, ...]],
              ties: dict[str, str]) -> dict[str, Stack]:
    """The containers (path → :class:`Stack`) worth and fit for stamping."""
    canonical = set(ties.values())
    out = {}
    for path, children in containers.items():
        if len(children) <= TRACED:
            continue
        settings = [values for _, _, values in _layer_settings(model, len(children))]
        offset, period, tail, reason = _offset_period([model.get_submodule(c) for c in children], settings)
        if period is not None and any(f == c or f.startswith(c + ".") for f in canonical for c in children[offset:]):
            period, reason = None, "a parameter or buffer of its units is tied (the units would not own it)"
        if period is None:
            log.debug("layer stamping skips %r: %s", path, reason)
            continue
        out[path] = Stack(tuple(children), period, offset, TRACED + (tail > 0), tail)
    return out


def _layer_settings(model: nn.Module, n: int) -> list[tuple[object, str, list | tuple]]:
    """The per-layer settings of the configs the model's modules hold (``config.layer_types``):
    ``(config, attribute, values)`` for each list or tuple of ``n`` plain values, except lists
    of layer indices (``moe_layers``: every layer's, counting up)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    return [(c, key, v) for c in configs.values() for key, v in getattr(c, "__dict__", {}).items()
            if isinstance(v, (list, tuple)) and len(v) == n and all(isinstance(x, _PLAIN) for x in v)
            and not _counts_up(v)]


def _counts_up(values) -> bool:
    """Whether ``values`` are integers that count up by the same step (layer indices)."""
    return (len(values) > 1 and all(type(v) is int for v in values) and values[1] > values[0]
            and all(v - values[0] == i * (values[1] - values[0]) for i, v in enumerate(values)))


_PLAIN = (str, int, float, bool, type(None))


def with_spare_unit(stacks: dict[str, Stack]) -> dict[str, Stack]:
    """``stacks`` traced with a spare unit, those with one to spare (none where they were)."""
    if any(s.spared for s in stacks.values()):
        return {}
    return {path: s.spare() for path, s in stacks.items() if s.spare() is not None}


class _Refused(RuntimeError):
    """Raised inside forward to stop a truncated trace that cannot be stamped."""


def _recording_class(cls: type, path: str, size: int, accesses: dict) -> type:
    """A subclass of the container's class that records how forward reaches its children."""

    def covers_all(idx: slice) -> bool:
        return (idx.start in (None, 0) and idx.step in (None, 1)
                and (idx.stop is None or idx.stop >= size))

    def __iter__(self):
        accesses[path]["iterations"] += 1
        inner = cls.__iter__(self)

        def walk():
            yield from inner
            accesses[path]["exhausted"] += 1

        return walk()

    def __len__(self):
        accesses[path]["measured"] = True
        return cls.__len__(self)

    def __getitem__(self, idx):
        if not (isinstance(idx, slice) and covers_all(idx)):
            accesses[path]["refused"] = f"forward indexes it explicitly ([{idx!r}])"
            raise _Refused(f"{path}[{idx!r}]: layer stamping needs forward to iterate over it")
        return cls.__getitem__(self, idx)

    return type(cls.__name__, (cls,), {"__iter__": __iter__, "__getitem__": __getitem__, "__len__": __len__,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _cut_settings(model: nn.Module, containers: dict[str, Stack]) -> dict[tuple[int, str], tuple]:
    """``(config, attribute) -> (config, full values, cut values)``: the per-layer settings
    (:func:`_layer_settings`) of stacks with a tail cut to the traced children, so that forward's
    lookups by the loop's index (``config.layer_types[i]``) find the tail's own (before the
    tail, a cut container keeps every traced child's index)."""
    cuts: dict[tuple[int, str], tuple] = {}
    for stack in (s for s in containers.values() if s.tail):
        traced = set(stack.traced)
        for config, key, values in _layer_settings(model, len(stack.children)):
            cut = type(values)(v for c, v in zip(stack.children, values) if c in traced)
            if cuts.setdefault((id(config), key), (config, values, cut))[2] != cut:
                raise NotStampable(f"config attribute {key!r} has one entry per layer of two stacks")
    return cuts


@contextlib.contextmanager
def truncated(model: nn.Module, containers: dict[str, Stack]):
    """Within the block each container holds its traced children only and records how forward
    reaches them, and the configs' per-layer settings are cut alike where a tail follows the
    units; restored on exit, also on errors. Yields the access record."""
    accesses = {p: {"iterations": 0, "exhausted": 0, "refused": None, "measured": False} for p in containers}
    saved = []
    settings = _cut_settings(model, containers)
    try:
        for (_, key), (config, _, cut) in settings.items():
            setattr(config, key, cut)
        for path, stack in containers.items():
            module = model.get_submodule(path)
            items = list(module._modules.items())
            saved.append((module, items, module.__class__))
            cut = set(stack.children) - set(stack.traced)
            for name, _ in items:  # in place: a WithLoss shares this table
                if (f"{path}.{name}" if path else name) in cut:
                    del module._modules[name]
            module.__class__ = _recording_class(module.__class__, path, len(stack.children), accesses)
        yield accesses
    finally:
        for module, items, cls in reversed(saved):
            module._modules.clear()
            module._modules.update(items)
            module.__class__ = cls
        for (_, key), (config, values, _) in settings.items():
            setattr(config, key, values)


def unreached(accesses: dict) -> dict[str, str]:
    """The containers (path -> how) that forward did not iterate over to their end."""
    out = {}
    for path, acc in accesses.items():
        if acc["refused"]:
            out[path] = acc["refused"]
        elif acc["iterations"] == 0:
            out[path] = "forward never iterated over it"
        elif acc["exhausted"] != acc["iterations"]:
            out[path] = "forward stopped iterating over it before the end"
    return out


def untouched(accesses: dict) -> set[str]:
    """The containers forward never iterated over, read by index or took the length of: their
    cut children cannot have changed the trace (:func:`add_untouched` checks that none ran)."""
    return {path for path, acc in accesses.items()
            if acc["iterations"] == 0 and not acc["refused"] and not acc["measured"]}


def check_accesses(accesses: dict) -> None:
    """Raise :class:`NotStampable` unless forward iterated over every container to its end or
    never touched it (:func:`untouched`)."""
    missed = {p: how for p, how in unreached(accesses).items() if p not in untouched(accesses)}
    if missed:
        raise NotStampable("; ".join(f"{path}: {how}" for path, how in missed.items()))


# ----------------------------------------------------------------------------- segments


@dataclasses.dataclass
class _Segments:
    nodes: list[torch.fx.Node]
    starts: list[int]  # start index of each traced segment
    end: int  # end index of the last traced segment
    length: int  # length of segments 1 and 2
    pos: dict[torch.fx.Node, tuple[int, int]]  # node -> (segment, position)
    own: list[dict[torch.fx.Node, tuple[int, str]]]  # per traced unit: parameter placeholder -> (place, rel FQN)


def _last_end(nodes: list, before: int, start: int, layers: set) -> int:
    """The end of the last traced segment (from ``start``): after its layers' last node, or
    after the last node that reads both the segment before it (from ``before``) and this one
    (a loop's running sum after the last layer: ``aux_total + aux``)."""
    index = {n: i for i, n in enumerate(nodes)}
    end = start + 1
    for i in range(start, len(nodes)):
        node = nodes[i]
        if node.meta.get("autopar_layer") in layers:
            end = i + 1
            continue
        read = [index[a] for a in node.all_input_nodes]
        if any(before <= k < start for k in read) and any(start <= k < i for k in read):
            end = i + 1
    return end


def _segments(gm: torch.fx.GraphModule, stack: Stack, inputs) -> _Segments:
    nodes = list(gm.graph.nodes)
    traced = stack.traced[stack.offset:]  # the traced units' layers and the tail (the prefix runs before them)
    units = stack.children[stack.offset:len(stack.children) - stack.tail]
    unit_of = {c: j // stack.period for j, c in enumerate(units)}
    unit_of.update(dict.fromkeys(stack.tail_children, stack.traced_units - 1))  # the tail ends the last segment
    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        layer = node.meta.get("autopar_layer")
        if node.op != "placeholder" and layer in unit_of:
            if unit_of[layer] >= stack.traced_units:
                raise NotStampable(f"layer {layer} ran although the container was cut")
            first.setdefault(layer, i)
    if list(first) != list(traced):
        raise NotStampable(f"the traced layers ran in order {list(first)}, not {list(traced)}")
    starts = [first[stack.unit(j)[0]] for j in range(stack.traced_units)]
    length = starts[2] - starts[1]
    if stack.spared:
        if starts[3] - starts[2] != length:
            raise NotStampable(f"segments 1 and 2 differ in length ({length}, {starts[3] - starts[2]})")
        end = _last_end(nodes, starts[2], starts[3], {*stack.unit(3), *stack.tail_children})
    else:
        end = starts[2] + length
        if end > next(i for i, n in enumerate(nodes) if n.op == "output"):
            raise NotStampable("the graph ends inside the last traced segment")
    bounds = starts + [end]
    pos = {}
    for j in range(stack.traced_units):
        for p, node in enumerate(nodes[bounds[j]:bounds[j + 1]]):
            pos[node] = (j, p)
            layer = node.meta.get("autopar_layer")
            if layer is not None and unit_of.get(layer) != j:
                raise NotStampable(f"segment of unit {j} holds node {node.name} of {layer}")
    for node in nodes:
        layer = node.meta.get("autopar_layer")
        if node.op != "placeholder" and layer in unit_of and pos.get(node, (-1,))[0] != unit_of[layer]:
            raise NotStampable(f"node {node.name} of {layer} runs outside its segment")
    by_name = {n.name: n for n in nodes if n.op == "placeholder"}
    own = [{} for _ in range(stack.traced_units)]
    for inp in inputs:
        for k, c in enumerate(units[:stack.traced_units * stack.period]):
            if inp.kind in ("parameter", "buffer") and inp.name.startswith(c + "."):
                own[k // stack.period][by_name[inp.node]] = (k % stack.period, inp.name[len(c) + 1:])
    return _Segments(nodes, starts, bounds[-1], length, pos, own)


def _role(seg: _Segments, j: int, arg: torch.fx.Node):
    """What ``arg`` is to segment ``j``: a node of it or of the one before (by position), one
    of the layer's own parameters (by relative FQN) or a node from before the layers."""
    where = seg.pos.get(arg)
    if where is not None:
        if where[0] == j:
            return ("this", where[1])
        if where[0] == j - 1:
            return ("previous", where[1])
        raise NotStampable(f"segment {j} reads {arg.name} of segment {where[0]}")
    for k, own in enumerate(seg.own):
        if arg in own:
            if k != j:
                raise NotStampable(f"segment {j} reads {arg.name}, a parameter of another layer")
            return ("own", own[arg])
    return ("outside", arg)


def _place(module: str, unit: tuple[str, ...]) -> int | None:
    """The place in ``unit`` of the layer that runs ``module``, or None (outside the unit)."""
    return next((r for r, layer in enumerate(unit) if module == layer or module.startswith(layer + ".")), None)


def _relative(module: str, unit: tuple[str, ...]) -> str:
    r = _place(module, unit)
    return module if r is None else f"<layer {r}>" + module[len(unit[r]):]


def _check_isomorphic(seg: _Segments, stack: Stack, output_specs) -> None:
    a, b = 1, 2
    for p in range(seg.length):
        n1, n2 = seg.nodes[seg.starts[a] + p], seg.nodes[seg.starts[b] + p]
        if n1.op != "call_function" or n2.op != "call_function" or n1.target != n2.target:
            raise NotStampable(f"{n1.name} and {n2.name} differ in op")
        s1 = map_arg((n1.args, n1.kwargs), lambda x: _role(seg, a, x))
        s2 = map_arg((n2.args, n2.kwargs), lambda x: _role(seg, b, x))
        if s1 != s2:
            raise NotStampable(f"{n1.name} and {n2.name} differ in their arguments")
        if tensor_meta(n1.meta.get("val"), n1) != tensor_meta(n2.meta.get("val"), n2):
            raise NotStampable(f"{n1.name} and {n2.name} differ in shape or dtype")
        if (_relative(n1.meta["autopar_module"], stack.unit(a))
                != _relative(n2.meta["autopar_module"], stack.unit(b))):
            raise NotStampable(f"{n1.name} and {n2.name} run in different modules")
    for node, (j, _) in seg.pos.items():
        for user in node.users:
            where = seg.pos.get(user, (None,))[0]
            if where not in (j, j + 1) and not (j == stack.traced_units - 1 and where is None):
                raise NotStampable(f"{user.name} reads {node.name} of segment {j}")
    out = seg.nodes[-1]
    leaves = torch.utils._pytree.tree_leaves(out.args)
    for spec, leaf in zip(output_specs, leaves):
        if leaf in seg.pos and spec.kind != torch.export.graph_signature.OutputKind.USER_OUTPUT:
            raise NotStampable(f"graph output {spec.kind.name} {leaf.name} comes from a layer")


# ----------------------------------------------------------------------------- stamping


def _fresh(val):
    """A new fake tensor like ``val`` (shape, strides, dtype, device, requires_grad), built from
    a meta tensor: ten times faster than allocating one under the fake mode."""
    if isinstance(val, torch._subclasses.FakeTensor):
        meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta",
                                   requires_grad=val.requires_grad)
        return torch._subclasses.FakeTensor(val.fake_mode, meta, val.device)
    if isinstance(val, (tuple, list)):
        return type(val)(_fresh(v) for v in val)
    return val


def _move(text: str, old: str, new: str) -> str:
    if text == old or text.startswith(old + "."):
        return new + text[len(old):]
    return text


def _stamped_meta(meta: dict, old_unit: tuple[str, ...], new_unit: tuple[str, ...]) -> dict:
    """``meta`` of a node of ``old_unit`` for its copy in ``new_unit`` (the layer at its place)."""
    layer = meta.get("autopar_layer")
    r = old_unit.index(layer) if layer in old_unit else _place(meta["autopar_module"], old_unit)
    old, new = (old_unit[0], old_unit[0]) if r is None else (old_unit[r], new_unit[r])
    out = {k: v for k, v in meta.items() if k not in _DROPPED_META}
    out["val"] = _fresh(meta.get("val"))
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {
            key.replace(old, new, 1) if old in key else key: (_move(path, old, new), kind)
            for key, (path, kind) in stack.items()}
    out["autopar_module"] = _move(meta["autopar_module"], old, new)
    if meta.get("autopar_layer") == old:
        out["autopar_layer"] = new
    return out


_SUFFIX = re.compile(r"_\d+$")


def _placeholder_name(kind: str, fqn: str) -> str:
    """As export names it: ``p_`` / ``b_`` and the lower-cased FQN, other characters as ``_``."""
    return {"parameter": "p_", "buffer": "b_"}[kind] + re.sub(r"[^a-z0-9]", "_", fqn.lower())


def _unit_placeholder(graph: torch.fx.Graph, kind: str, fqn: str, like: torch.fx.Node,
                      old_unit: tuple[str, ...], new_unit: tuple[str, ...]) -> torch.fx.Node:
    """A placeholder for ``fqn`` of ``new_unit``, named as export names it, its meta that of
    ``like`` (the same parameter or buffer of ``old_unit``)."""
    node = graph.placeholder(_placeholder_name(kind, fqn))
    node.meta = _stamped_meta(like.meta, old_unit, new_unit)
    desc = like.meta.get("desc")
    if dataclasses.is_dataclass(desc) and hasattr(desc, "target"):
        node.meta["desc"] = dataclasses.replace(desc, target=fqn)
    return node


def stamp_container(gm: torch.fx.GraphModule, inputs: list, stack: Stack,
                    output_specs) -> tuple[torch.fx.GraphModule, list]:
    """Grow the traced graph of ``stack``'s traced units to all of them (see the docstring).

    ``inputs`` are capture's :class:`GraphInput` rows in placeholder order; returns the new
    graph module and rows. Raises :class:`NotStampable` when the checks fail.
    """
    seg = _segments(gm, stack, inputs)
    _check_isomorphic(seg, stack, output_specs)
    mid, final = TRACED - 1, stack.units - 1
    spare = TRACED if stack.spared else None  # the traced unit that is the model's last
    template = seg.nodes[seg.starts[mid]: seg.starts[mid] + seg.length]
    copies = range(TRACED, final if stack.spared else final + 1)
    by_name = {n.name: n for n in seg.nodes}

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    new_inputs: list = []
    own_new: dict[int, dict[tuple, torch.fx.Node]] = {c: {} for c in range(TRACED, final + 1)}  # (place, rel) -> placeholder
    after_template = {kind: max((k for k, i in enumerate(inputs) if i.kind == kind
                                 and by_name[i.node] in seg.own[mid]), default=None)
                      for kind in ("parameter", "buffer")}
    for k, inp in enumerate(inputs):
        old = by_name[inp.node]
        if spare is not None and old in seg.own[spare]:  # renamed to the model's last unit's
            place, rel = seg.own[spare][old]
            fqn = f"{stack.unit(final)[place]}.{rel}"
            new = _unit_placeholder(graph, inp.kind, fqn, old, stack.unit(spare), stack.unit(final))
            own_new[final][place, rel] = new
            new_inputs.append(GraphInput(inp.kind, fqn, new.name, inp.meta))
        else:
            new = graph.create_node("placeholder", old.target, old.args, name=old.name)
            new.meta = dict(old.meta)
            new_inputs.append(inp)
        env[old] = new
        if k != after_template.get(inp.kind):
            continue
        rows = [(seg.own[mid][by_name[i.node]], i) for i in inputs
                if i.kind == inp.kind and by_name[i.node] in seg.own[mid]]
        for c in copies:
            for (place, rel), row in rows:
                fqn = f"{stack.unit(c)[place]}.{rel}"
                node = _unit_placeholder(graph, inp.kind, fqn, by_name[row.node], stack.unit(mid), stack.unit(c))
                own_new[c][place, rel] = node
                new_inputs.append(GraphInput(inp.kind, fqn, node.name, row.meta))

    def copy(node: torch.fx.Node, args, kwargs, meta) -> torch.fx.Node:
        name = _SUFFIX.sub("", node.name)
        new = graph.create_node(node.op, node.target, args, kwargs, name=name)
        new.meta = meta
        return new

    def stamp_unit(nodes: list, j: int, c: int, previous: list) -> list:
        """Copies of segment ``j``'s ``nodes`` for unit ``c``, after unit ``c - 1``'s ``previous``."""
        current: list = []

        def resolve(arg):
            role = _role(seg, j, arg)
            if role[0] == "this":
                return current[role[1]]
            if role[0] == "previous":
                return previous[role[1]]
            if role[0] == "own":
                return own_new[c][role[1]]
            return env[arg]

        for node in nodes:
            args, kwargs = map_arg((node.args, node.kwargs), resolve)
            current.append(copy(node, args, kwargs, _stamped_meta(node.meta, stack.unit(j), stack.unit(c))))
        return current

    for node in seg.nodes[:seg.starts[mid] + seg.length]:
        if node.op != "placeholder":
            args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = copy(node, args, kwargs, dict(node.meta))
    current = [env[n] for n in template]
    for c in copies:
        current = stamp_unit(template, mid, c, current)
    if spare is None:
        env.update(zip(template, current))
    else:
        last = seg.nodes[seg.starts[spare]: seg.end]
        env.update(zip(last, stamp_unit(last, spare, final, current)))
    for node in seg.nodes[seg.end:]:
        if node.op == "output":
            graph.output(map_arg(node.args[0], env.__getitem__))
            graph.output_node().meta = dict(node.meta)
        else:
            args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = copy(node, args, kwargs, dict(node.meta))
    return lazy_graph_module(gm, graph), new_inputs


def add_untouched(gm: torch.fx.GraphModule, inputs: list, stack: Stack, model: nn.Module,
                  ties: dict[str, str]) -> tuple[torch.fx.GraphModule, list]:
    """The traced graph with placeholders for the parameters and buffers of ``stack``'s cut
    children, where forward never ran its container (:func:`untouched`), as a full trace has
    them: unread, after the traced children's, each with the meta of the same tensor of a traced
    child of its shape and dtype. Raises :class:`NotStampable` where a node but those
    placeholders is in the container, or a tensor is tied or has no like."""
    children, kept = frozenset(stack.children), frozenset(stack.traced)
    traced = [c for c in stack.children if c in kept]
    for node in gm.graph.nodes:
        inside = layer_of(node.meta.get("autopar_module", ""), children) is not None
        if inside and (node.op != "placeholder" or node.users):
            raise NotStampable(f"{node.name} runs in a container forward never iterated over")
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    inputs = list(inputs)
    for kind, named in (("parameter", nn.Module.named_parameters), ("buffer", nn.Module.named_buffers)):
        rows = {i.name: k for k, i in enumerate(inputs) if i.kind == kind}
        at = max((k for fqn, k in rows.items() if layer_of(fqn, children)), default=None)
        for child in (c for c in stack.children if c not in kept):
            for rel, tensor in named(model.get_submodule(child)):
                like = next((t for t in reversed(traced) if f"{t}.{rel}" in rows
                             and _alike(by_name[inputs[rows[f"{t}.{rel}"]].node], tensor)), None)
                if like is None or f"{child}.{rel}" in ties:
                    raise NotStampable(f"{child}.{rel} is tied or has no traced {kind} of its shape and dtype")
                row = inputs[rows[f"{like}.{rel}"]]
                with gm.graph.inserting_after(by_name[inputs[at].node]):
                    node = _unit_placeholder(gm.graph, kind, f"{child}.{rel}", by_name[row.node], (like,), (child,))
                by_name[node.name] = node
                at += 1
                inputs.insert(at, GraphInput(kind, f"{child}.{rel}", node.name, row.meta))
    gm.recompile()
    return gm, inputs


def _alike(node: torch.fx.Node, tensor: torch.Tensor) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.shape, val.dtype, val.requires_grad) == \
        (tensor.shape, tensor.dtype, tensor.requires_grad)


def check_order(model: nn.Module, inputs: list, stacks) -> None:
    """Raise :class:`NotStampable` unless parameters and buffers follow the model's order from
    layer to layer of ``stacks`` (within a layer export may order them otherwise: DeepSeek-V4's
    non-persistent rotary buffers, as they are used; a stamped unit copies its template's order)."""
    children = frozenset(c for stack in stacks for c in stack.children)
    for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
        order = {fqn: i for i, (fqn, _) in enumerate(named())}
        layer_first: dict[str, int] = {}
        for fqn, i in order.items():
            layer = layer_of(fqn, children)
            if layer is not None:
                layer_first.setdefault(layer, i)
        got = []
        for row in (i for i in inputs if i.kind == kind):
            layer = layer_of(row.name, children)
            got.append(order.get(row.name, -1) if layer is None else layer_first.get(layer, -1))
        if got != sorted(got) or -1 in got:
            raise NotStampable(f"stamped {kind}s are not in the model's order")


__all__ = ["NotStampable", "Stack", "TRACED", "add_untouched", "check_accesses", "check_order",
           "stamp_container", "stampable", "truncated", "unreached", "untouched", "with_spare_unit"]
