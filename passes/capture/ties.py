"""Tied weights and the graph's placeholders.

A tied weight is one ``nn.Parameter`` (or buffer) registered under several FQNs. It is one
parameter: its canonical FQN is the first one ``model.named_parameters()`` yields, the graph
keeps one placeholder for it, and every other FQN maps to the canonical one
(``CapturedGraph.tied``).
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.core.errors import CaptureError
from autopar.passes.capture.graph import INPUT_KIND_OF, GraphInput, lazy_graph_module, tensor_meta


def tied_fqns(model: nn.Module) -> dict[str, str]:
    """alias FQN → canonical FQN for parameters (and buffers) registered under several names."""
    tied: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for fqn, tensor in named(remove_duplicate=False):
            canon = first.setdefault(id(tensor), fqn)
            if canon != fqn:
                tied[fqn] = canon
    return tied


def dedupe_tied(exported, ties: dict[str, str]) -> tuple[torch.fx.GraphModule, list[GraphInput]]:
    """A copy of the exported graph with one placeholder per tied weight, and its inputs."""
    graph = torch.fx.Graph()
    value_remap: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(exported.graph_module.graph, value_remap)
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    specs = exported.graph_signature.input_specs
    if len(placeholders) != len(specs):
        raise CaptureError(f"exported graph has {len(placeholders)} placeholders but "
                           f"{len(specs)} input specs", hint="report this torch.export mismatch")
    by_fqn: dict[str, torch.fx.Node] = {}
    inputs: list[GraphInput] = []
    for node, spec in zip(placeholders, specs):
        kind = INPUT_KIND_OF.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported graph input kind {spec.kind} ({node.name})",
                               hint="autopar plans parameters, buffers, constants and tensors")
        name = spec.target if spec.target is not None else spec.arg.name
        canon = ties.get(name) if kind in ("parameter", "buffer") else None
        if canon is not None and canon in by_fqn:
            node.replace_all_uses_with(by_fqn[canon])
            graph.erase_node(node)
            continue
        by_fqn[name] = node
        inputs.append(GraphInput(kind, name, node.name, tensor_meta(node.meta.get("val"), node)))
    return lazy_graph_module(exported.graph_module, graph), inputs


__all__ = ["dedupe_tied", "tied_fqns"]
