"""Cut a captured training graph into pipeline units: pre part, repeated layers, post part.

With repeated layers (``captured.layers``, found at capture) the graph is

    pre (embedding, masks) → segment 0 → segment 1 → … → segment L−1 → post (head, loss)

where segment ``ℓ`` holds layer ``ℓ``'s nodes and any loop-body nodes between it and layer
``ℓ+1``. When every segment has the same ops and shapes and reads only the pre part, the
previous segment, its own parameters and graph inputs (the first segment may differ from the
others when it hands the second values of the shapes each layer hands the next), :func:`split_layers` returns
:class:`Segments` and the planner costs a stage from a small *window* graph (:func:`window`):
pre, segments 0 and 1, and post (post's reads of the last segment are redirected to segment 1).
Segment 0 stands for a stage's first layer after the pre part, segment 1 for every other layer.
In a hybrid stack whose single layers differ, a segment is the shortest run of layers whose
pattern of kinds repeats (Jamba: 8 layers, one of them attention, every other one MoE), where
that makes at least three segments. Where the pattern does not repeat from the first layer to
the last (Zamba: hybrid layers at 2, 7, 13, ..., 67, 73 of 76; DeepSeek-V3: three dense layers
before the MoE ones), the longest periodic run of at least three segments makes the segments
where it leaves out at most a third of the layers, and the layers before it join the pre part (a
*prefix*), those after it the post part (a *suffix*).

Without repeated layers (or when their segments differ), :func:`balanced_groups` cuts the
compute nodes in graph order into groups of about equal FLOPs, and the window is the whole graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autopar.core.ir import spec_of_node
from autopar.cost_models.compute import node_flops
from autopar.passes.capture.repeats import LOOP

PRE, FIRST, LAYER, POST = "pre", "first", "layer", "post"


def window_label(part: str, repeat: str | None) -> str:
    """A window node's layer label: its part (``first``, ``layer``), with the loop iteration of its
    repeat label (``layer#0.17``) so that a loop's steps inside the layers tie like the layers."""
    return part + repeat[repeat.index(LOOP):] if repeat and LOOP in repeat else part


def part_of(label: str | None) -> str | None:
    """The window part of a :func:`window_label`."""
    return label.split(LOOP, 1)[0] if label else label


def _compute_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def _inputs_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(node.all_input_nodes)


@dataclass
class Segments:
    """The layered view of a graph (module docstring); node lists are in graph order. Each
    segment holds ``period`` consecutive layers of ``names`` (a hybrid stack's repeating pattern
    of layer kinds; one layer otherwise)."""

    names: tuple[str, ...]  # the segments' layers
    pre: list[torch.fx.Node]
    layers: list[list[torch.fx.Node]]
    post: list[torch.fx.Node]
    period: int = 1
    prefix: tuple[str, ...] = ()  # layers in the pre part, before the segments
    suffix: tuple[str, ...] = ()  # layers in the post part, after them

    @property
    def num_layers(self) -> int:
        """The segments (pipeline units are groups of them)."""
        return len(self.layers)

    def held(self, first: int, last: int) -> tuple[str, ...]:
        """The layers of segments ``first`` to ``last`` (inclusive), with the prefix where
        ``first`` is the first and the suffix where ``last`` is the last."""
        return ((self.prefix if first == 0 else ()) + self.names[first * self.period:(last + 1) * self.period]
                + (self.suffix if last == self.num_layers - 1 else ()))

    def representative(self, layer: str) -> str:
        """The layer of segment 0 or 1 (the window's) at ``layer``'s place in its segment."""
        k, q = divmod(self.names.index(layer), self.period)
        return self.names[q if k == 0 else self.period + q]


def split_layers(captured) -> Segments | None:
    """Pre / layer segments / post, or ``None`` when the graph has fewer than two repeated
    layers or its segments are not identical and self-contained (module docstring). Where single
    layers differ (a hybrid stack), segments of the shortest run of layers that repeats, in at
    least three segments (Jamba's 8 layers, Qwen3-Next's 4)."""
    names = tuple(captured.layers)
    if len(names) < 2:
        return None
    for period in range(1, max(2, len(names) // 3 + 1)):
        if len(names) % period == 0 and (period == 1 or len(names) // period >= 3):
            segments = _split(captured, names, period)
            if segments is not None:
                return segments
    run = _periodic_run(captured, names)
    if run is not None:
        first, period, count = run
        return _split(captured, names, period, first, first + period * count)
    return None


def _periodic_run(captured, names: tuple[str, ...]) -> tuple[int, int, int] | None:
    """(first layer, period, segments) of the longest run of layers whose ops repeat with a
    period in at least three segments (the shortest period, then the earliest, among equals)
    that leaves some layer out, and at most a third of them (the first and last stages carry
    those), or None."""
    ops: dict[str, list] = {name: [] for name in names}
    for n in _compute_nodes(captured.graph_module.graph):
        layer = n.meta.get("autopar_layer")
        if layer in ops:
            ops[layer].append((str(n.target), n.meta.get("autopar_tensor")))
    kinds: dict[tuple, int] = {}
    kind = [kinds.setdefault(tuple(ops[name]), len(kinds)) for name in names]
    best, covered = None, 0
    for period in range(1, len(names) // 3 + 1):
        for first in range(len(names) - 3 * period + 1):
            count = 1
            while (first + (count + 1) * period <= len(names)
                   and kind[first + count * period:first + (count + 1) * period] == kind[first:first + period]):
                count += 1
            if count >= 3 and covered < period * count < len(names) and 3 * period * count >= 2 * len(names):
                best, covered = (first, period, count), period * count
    return best


def _split(captured, names: tuple[str, ...], period: int, begin: int = 0, end: int | None = None) -> Segments | None:
    """:func:`split_layers` with ``period`` layers a segment, the layers before ``begin`` in the
    pre part and from ``end`` on in the post part, or None."""
    end = len(names) if end is None else end
    prefix, suffix, names_all, names = names[:begin], names[end:], names, names[begin:end]
    nodes = _compute_nodes(captured.graph_module.graph)
    layer_of = {n.name: n.meta.get("autopar_layer") for n in nodes}
    rank = {name: i for i, name in enumerate(names_all)}
    firsts, lasts = {}, {}
    for i, n in enumerate(nodes):
        lay = layer_of[n.name]
        if lay in rank:
            firsts.setdefault(lay, i)
            lasts[lay] = i
    if set(firsts) != set(names_all):
        return None
    starts = [firsts[x] for x in names_all]
    if starts != sorted(starts):
        return None
    starts = starts[begin:end:period]
    ends = starts[1:] + [firsts[suffix[0]] if suffix else lasts[names[-1]] + 1]
    segments = [nodes[a:b] for a, b in zip(starts, ends)]
    for k, seg in enumerate(segments):
        if any(layer_of[n.name] not in (None, *names[k * period:(k + 1) * period]) for n in seg):
            return None
    pre, post = nodes[:starts[0]], nodes[ends[-1]:]
    if any(layer_of[n.name] not in (None, *prefix) for n in pre) \
            or any(layer_of[n.name] not in (None, *suffix) for n in post):
        return None
    seg_of = {n.name: k for k, seg in enumerate(segments) for n in seg}
    pre_names, post_names = {n.name for n in pre}, {n.name for n in post}
    # Segments read the pre part, the previous segment, themselves and placeholders only.
    for k, seg in enumerate(segments):
        for n in seg:
            for a in _inputs_of(n):
                if a.op != "placeholder" and a.name not in pre_names and seg_of.get(a.name) not in (k, k - 1):
                    return None
    for n in post:
        for a in _inputs_of(n):
            if a.op != "placeholder" and a.name not in pre_names | post_names \
                    and seg_of.get(a.name) != len(segments) - 1:
                return None
    # Identical segments: same ops and shapes position by position, wired the same way. The
    # first may differ (a first layer that casts what it reads: Mamba's fp32 residual under bf16)
    # when it hands the second the values every layer hands the next.
    body = _ops(segments[1])
    if any(_ops(seg) != body for seg in segments[2:]):
        return None
    same = _ops(segments[0]) == body
    if not same and len(segments) > 2 and _handed(segments[1], segments[0]) != _handed(segments[2], segments[1]):
        return None
    start = 1 if same else 2
    wiring = _wiring(segments[start], segments[start - 1]) if start < len(segments) else None
    if any(_wiring(segments[k], segments[k - 1]) != wiring for k in range(start + 1, len(segments))):
        return None
    return Segments(names, pre, segments, post, period, prefix, suffix)


def _ops(seg: list[torch.fx.Node]) -> list[tuple]:
    """A segment's ops and output shapes, position by position."""
    return [(str(n.target), n.meta.get("autopar_tensor")) for n in seg]


def _handed(seg: list[torch.fx.Node], prev: list[torch.fx.Node]) -> list:
    """The shapes of the values of ``prev`` that ``seg``'s nodes read, in reading order."""
    before = {n.name for n in prev}
    return [a.meta.get("autopar_tensor") for n in seg for a in _inputs_of(n) if a.name in before]


def _wiring(seg: list[torch.fx.Node], prev: list[torch.fx.Node]) -> list[tuple]:
    """How a segment's nodes read their inputs: own position, previous segment's position, or
    the same outside node (pre part / graph input)."""
    own = {n.name: i for i, n in enumerate(seg)}
    before = {n.name: i for i, n in enumerate(prev)}
    out = []
    for n in seg:
        refs = []
        for a in _inputs_of(n):
            if a.name in own:
                refs.append(("own", own[a.name]))
            elif a.name in before:
                refs.append(("prev", before[a.name]))
            elif a.op == "placeholder" and a.meta.get("autopar_layer") is not None:
                refs.append(("param", a.meta.get("autopar_tensor")))
            else:
                refs.append(("outside", a.name))
        out.append((str(n.target), tuple(refs)))
    return out


@dataclass
class Window:
    """A small graph standing for the whole model when costing stages.

    ``part`` labels every compute node and every layer parameter of the window (``pre``,
    ``first``, ``layer``, ``post``, or a group index as a string); ``source`` maps each window
    node back to the nodes of the captured graph it stands for.
    """

    graph: torch.fx.Graph
    inputs: dict[str, object]  # placeholder name -> GraphInput of the captured graph
    part: dict[str, str]
    parts: tuple[str, ...]
    losses: tuple[str, ...]
    source: dict[str, list[str]] = field(default_factory=dict)


def window(captured, segments: Segments) -> Window:
    """Pre + segments 0 and 1 + post as one graph (module docstring)."""
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    kinds = {i.node: i for i in captured.inputs}
    inputs, part = {}, {}
    last, second = segments.layers[-1], segments.layers[1]
    redirect = {a.name: b for a, b in zip(last, second)}

    def arg(a: torch.fx.Node) -> torch.fx.Node:
        name = redirect[a.name].name if a.name in redirect else a.name
        if name not in env:
            src = a if a.name not in redirect else redirect[a.name]
            if src.op != "placeholder":
                raise AssertionError(f"window: {name} read before it is defined")
            env[name] = graph.node_copy(src, lambda x: x)
            inputs[name] = kinds[name]
        return env[name]

    copied = [(PRE, n) for n in segments.pre] + [(FIRST, n) for n in segments.layers[0]] \
        + [(LAYER, n) for n in second] + [(POST, n) for n in segments.post]
    for label, node in copied:
        for a in _inputs_of(node):
            arg(a)
        env[node.name] = graph.node_copy(node, lambda a: env[redirect[a.name].name if a.name in redirect else a.name])
        part[node.name] = label
    period, names = segments.period, segments.names
    first, second_layers = names[:period], names[period:2 * period]  # a prefix's layers are the pre part's
    for name, inp in inputs.items():
        layer = env[name].meta.get("autopar_layer")
        if layer in first:
            part[name] = FIRST
        elif layer in second_layers:
            part[name] = LAYER
    losses = tuple(o.node for o in captured.outputs if o.kind == "loss" and o.node in env)
    graph.output(tuple(env[n] for n in losses))
    source = {n.name: [n.name] for n in segments.pre + segments.post}
    for seg_index, seg in enumerate(segments.layers):
        rep = segments.layers[0] if seg_index == 0 else second
        for a, b in zip(seg, rep):
            source.setdefault(b.name, []).append(a.name)
    return Window(graph, inputs, part, (PRE, FIRST, LAYER, POST), losses, source)


def balanced_groups(captured, *, groups: int) -> Window:
    """The whole graph as a window whose compute nodes are cut, in graph order, into ``groups``
    contiguous groups of about equal forward+backward FLOPs."""
    gm = captured.graph_module
    nodes = _compute_nodes(gm.graph)
    flops = []
    for n in nodes:
        try:
            f, b = node_flops(spec_of_node(n)) if isinstance(n.target, torch._ops.OpOverload) else (0, 0)
        except Exception:  # noqa: BLE001 - an op the meta kernels cannot run weighs nothing here
            f, b = 0, 0
        flops.append(float(f + b) + 1.0)
    total = sum(flops)
    groups = max(1, min(groups, len(nodes)))
    part, acc = {}, 0.0
    for n, f in zip(nodes, flops):
        g = min(groups - 1, int(math.floor(acc / total * groups)))
        part[n.name] = str(g)
        acc += f
    labels = tuple(dict.fromkeys(part.values()))
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    inputs = {}
    kinds = {i.node: i for i in captured.inputs}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
        if node.op == "placeholder":
            inputs[node.name] = kinds[node.name]
    losses = tuple(o.node for o in captured.outputs if o.kind == "loss" and o.node in env)
    graph.output(tuple(env[n] for n in losses))
    source = {n.name: [n.name] for n in nodes}
    return Window(graph, inputs, part, labels, losses, source)


def layer_units(num_layers: int, *, num_devices: int, max_units: int) -> int:
    """How many pipeline units (groups of consecutive layers) the stage search works on.

    A divisor ``U`` of ``num_layers`` with ``U ≤ max_units``, chosen to allow the most pipeline
    depths ``pp`` that divide both ``U`` and ``num_devices`` (ties: the larger ``U``), so that
    every evenly split Megatron configuration of the grid is a split at unit boundaries.
    """
    best, best_key = 1, (-1, -1)
    for units in range(1, min(num_layers, max_units) + 1):
        if num_layers % units:
            continue
        depths = sum(1 for pp in range(1, units + 1) if units % pp == 0 and num_devices % pp == 0)
        key = (depths, units)
        if key > best_key:
            best, best_key = units, key
    return best


__all__ = ["Segments", "Window", "balanced_groups", "layer_units", "split_layers", "window",
           "PRE", "FIRST", "LAYER", "POST", "part_of", "window_label"]
