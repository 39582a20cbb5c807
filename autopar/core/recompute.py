"""What activation recomputation runs again: the layer regions a recomputing stage checkpoints and,
inside each, the ops torch's non-reentrant checkpoint reruns in backward.

A region is a contiguous run of one layer's nodes (``meta["autopar_layer"]``); a node without a
layer between two nodes of one layer (a collective code generation inserted) belongs to it
(:func:`node_layers`). :mod:`autopar.runtime.recompute` runs each region under
:func:`torch.utils.checkpoint.checkpoint`.

In backward the first unpack of a region's saved tensor runs the region's forward again until it
has saved as many tensors as the first forward did, then stops (the checkpoint's *early stop*).
An op saves its inputs before its kernel runs and its outputs after, so (:func:`rerun`):

- every op before the region's last op that saves anything runs again;
- that last saving op runs again only if it saves something it made (an output, a statistic),
  not when it saves only inputs (a linear that ends a layer is not run again);
- the ops after it (a residual add) are not run again; the collectives in front of every op up
  to the last saving one are.

**Selective** recomputation (``recompute="selective"``) keeps what the matmuls, convolutions
and attention kernels make (:func:`keeps_output`) and recomputes the cheap chains between them
(norms, activations, dropout, softmax, residual adds): a layer's run is cut at each such op,
which runs outside any checkpoint, and each run between them is a region of its own. A region's
inputs (those ops' outputs) are kept, so what the model saves for the kept ops is kept too; the
region's own saved tensors (an activation's output, a dropout mask, a norm's statistics) are
made again in backward at the price of their cheap kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "einsum", "convolution", "_convolution",
                     "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                     "_grouped_mm", "grouped_mm_fallback"})


def keeps_output(node: torch.fx.Node) -> bool:
    """Whether selective recomputation keeps ``node``'s output: a matmul, a convolution or an
    attention kernel (module docstring)."""
    name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
    return name is not None and (name in MATMULS or "attention" in name)


def node_layers(nodes: Sequence[torch.fx.Node], *, selective: bool = False) -> list[str | None]:
    """The region of each of ``nodes`` (in graph order; module docstring): its layer, None
    outside the layers; ``selective``: None for a kept op and its layer and segment between kept
    ops otherwise."""
    layers = [n.meta.get("autopar_layer") for n in nodes]
    after, following = [None] * len(nodes), None
    for k in range(len(nodes) - 1, -1, -1):
        following = layers[k] if layers[k] is not None else following
        after[k] = following
    before = None
    for k, layer in enumerate(layers):
        if layer is None and before is not None and before == after[k]:
            layers[k] = before
        before = layers[k] if layers[k] is not None else before
    return _segments(nodes, layers) if selective else layers


def _segments(nodes: Sequence[torch.fx.Node], layers: list) -> list[str | None]:
    """Selective regions: each layer cut at its kept ops, which with the nodes code generation put
    right before or after them (their collectives) belong to no region."""
    kept = [layer is not None and keeps_output(n) for n, layer in zip(nodes, layers)]
    inserted = [layer is not None and n.meta.get("autopar_layer") is None for n, layer in zip(nodes, layers)]
    beside = list(kept)
    for order in (range(len(nodes)), range(len(nodes) - 1, -1, -1)):
        previous = False
        for k in order:
            if inserted[k]:
                beside[k] = beside[k] or previous
            else:
                previous = kept[k]
    out, segment = [], 0
    for k, layer in enumerate(layers):
        if kept[k]:
            segment += 1
        out.append(None if layer is None or beside[k] else f"{layer}#{segment}")
    return out


def _saves(node: torch.fx.Node) -> bool:
    return bool(node.meta.get("autopar_saved") or node.meta.get("autopar_saved_inputs"))


def _saves_its_own(node: torch.fx.Node) -> bool:
    return any(part.where == "output" for part in node.meta.get("autopar_saved", ()))


def rerun(region: Sequence[torch.fx.Node]) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """``(reached, kernels)`` of one region's nodes in graph order (capture's saved-tensor meta on
    them): the nodes the recomputation reaches (the collectives in front of them run again) and
    those whose kernels run again (module docstring)."""
    last = max((k for k, n in enumerate(region) if _saves(n)), default=-1)
    if last < 0:
        return [], []
    reached = list(region[:last + 1])
    return reached, reached if _saves_its_own(region[last]) else reached[:-1]


def recomputed_kernels(nodes: Sequence[torch.fx.Node], *, selective: bool = False) -> set[str]:
    """Names of the nodes among ``nodes`` (graph order) whose kernels a recomputing stage runs
    again."""
    out: set[str] = set()
    for region in regions(nodes, selective=selective):
        out.update(n.name for n in rerun(region)[1])
    return out


def program_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes of a program's graph that regions are made of: all but its placeholders and output
    (a stage takes a layer's parameters after the values it receives)."""
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def regions(nodes: Sequence[torch.fx.Node], *, selective: bool = False) -> list[list[torch.fx.Node]]:
    """The checkpointed regions among ``nodes`` (graph order): the runs of one layer
    (``selective``: of one segment between kept ops)."""
    out, previous = [], None
    for node, layer in zip(nodes, node_layers(nodes, selective=selective)):
        if layer is not None:
            if layer != previous:
                out.append([])
            out[-1].append(node)
        previous = layer
    return out


__all__ = ["MATMULS", "keeps_output", "node_layers", "program_nodes", "recomputed_kernels", "regions", "rerun"]
