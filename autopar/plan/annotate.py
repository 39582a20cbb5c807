"""annotate_pass: attach the assignment to the graph as node meta, and check it covers the graph.

After it, every node that carries tensors has

- ``meta["autopar_strategy"]`` (compute nodes): the chosen :class:`Strategy`; ops without a
  rule that the assignment leaves out get the all-replicated one;
- ``meta["autopar_sharding"]`` (placeholders, single-output compute nodes, ``getitem``): the
  sharding of the value the node produces;
- ``meta["autopar_requires_grad"]``: whether the value depends on a trainable parameter;
- ``meta["autopar_shape"]``: its global shape (``None`` for non-tensors).

Asserts on tensor metadata (``aten._assert_tensor_metadata``) are dropped: they check global
shapes that ranks no longer have.
"""

from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree

from autopar.core.errors import CodegenError
from autopar.core.ir import (
    IGNORED_OPS,
    Strategy,
    drop_unread_asserts,
    gradient_values,
    output_leaves,
    remembered_inputs,
    spec_of_node,
)
from autopar.core.placement import R, format_sharding
from autopar.passes.rules.registry import has_rule


def _tensor_output_index(node: torch.fx.Node) -> int | None:
    """For ``getitem(op, k)``: the index of element ``k`` among the op's tensor outputs."""
    src, k = node.args
    vals = src.meta.get("val")
    if not isinstance(vals, (tuple, list)) or not isinstance(vals[k], torch.Tensor):
        return None
    return sum(1 for v in vals[:k] if isinstance(v, torch.Tensor))


def _all_replicated(node: torch.fx.Node, ndim: int) -> Strategy:
    spec = spec_of_node(node)
    return Strategy(tuple((R,) * ndim for _ in spec.inputs), tuple((R,) * ndim for _ in spec.outputs))


def annotate_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    a = ctx.assignment
    k = len(a.mesh_shape)
    graph = gm.graph
    drop_unread_asserts(graph)
    grads = gradient_values(graph, ctx.trainable)
    for node in graph.nodes:
        val = node.meta.get("val")
        node.meta["autopar_shape"] = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        node.meta["autopar_requires_grad"] = node.name in grads
        if node.op == "placeholder":
            sh = a.placeholder_shardings.get(node.name, (R,) * k)
            node.meta["autopar_sharding"] = sh
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src = node.args[0]
            strat = src.meta.get("autopar_strategy")
            idx = _tensor_output_index(node)
            if strat is None or idx is None:
                raise CodegenError(f"getitem {node.name} does not pick a tensor of a planned op")
            node.meta["autopar_sharding"] = strat.outputs[idx]
            continue
        strat = a.node_strategies.get(node.name)
        if strat is None:
            if has_rule(node.target) and node.target not in IGNORED_OPS:
                raise CodegenError(
                    f"the assignment has no strategy for node {node.name} ({node.target}), which"
                    " has a sharding rule; plan every node (or propagate() a partial plan)"
                )
            strat = _all_replicated(node, k)
        ins = remembered_inputs(node, getattr(ctx, "inputs_memo", None))
        outs = sum(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(val))
        if len(strat.inputs) != len(ins) or len(strat.outputs) != outs:
            raise CodegenError(
                f"node {node.name} ({node.target}) has {len(ins)} tensor inputs and"
                f" {outs} outputs but its strategy {strat.name} has"
                f" {len(strat.inputs)} and {len(strat.outputs)}"
            )
        node.meta["autopar_strategy"] = strat
        node.meta["autopar_input_shapes"] = [tuple(x.meta["val"].shape) for x in ins]
        if isinstance(val, torch.Tensor):
            node.meta["autopar_sharding"] = strat.outputs[0]
    outs = output_leaves(graph)
    if len(a.output_shardings) != len(outs):
        raise CodegenError(
            f"the graph returns {len(outs)} tensors but the assignment gives"
            f" {len(a.output_shardings)} output shardings"
        )
    for i in ctx.loss_outputs:
        sh = a.output_shardings[i]
        if any(p != R for p in sh):
            raise CodegenError(
                f"output {i} is the loss but is assigned {format_sharding(sh)}; a loss must be"
                " replicated on every mesh axis"
            )
    return gm


__all__ = ["annotate_pass"]
