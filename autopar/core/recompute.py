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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def node_layers(nodes: Sequence[torch.fx.Node]) -> list[str | None]:
    """The region layer of each of ``nodes`` (in graph order; module docstring)."""
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
    return layers


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


def recomputed_kernels(nodes: Sequence[torch.fx.Node]) -> set[str]:
    """Names of the nodes among ``nodes`` (graph order) whose kernels a recomputing stage runs
    again."""
    out: set[str] = set()
    for region in regions(nodes):
        out.update(n.name for n in rerun(region)[1])
    return out


def program_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes of a program's graph that regions are made of: all but its placeholders and output
    (a stage takes a layer's parameters after the values it receives)."""
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def regions(nodes: Sequence[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """The checkpointed regions among ``nodes`` (graph order): the runs of one layer."""
    out, previous = [], None
    for node, layer in zip(nodes, node_layers(nodes)):
        if layer is not None:
            if layer != previous:
                out.append([])
            out[-1].append(node)
        previous = layer
    return out


__all__ = ["node_layers", "program_nodes", "recomputed_kernels", "regions", "rerun"]
