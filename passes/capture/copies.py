"""Functional copies made differentiable: ``aten.copy(dst, src)`` becomes ``src`` cast to ``dst``'s
dtype, broadcast to its shape and cloned.

Functionalisation turns an in-place ``dst.copy_(src)`` (or ``dst[...] = src`` written through a
view) into ``aten.copy.default``, which has no autograd formula: a program that needs a gradient
through it failed with "derivative for aten::copy is not implemented". Its value is ``src`` at
``dst``'s dtype and shape whatever ``dst`` holds, so the rewrite computes the same tensor with ops
that have derivatives (``src`` gets the gradient; ``dst``, overwritten, gets none) and rules.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def differentiable_copies_pass(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite ``graph_module``'s ``aten.copy.default`` nodes in place; the count rewritten."""
    graph, count = graph_module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[0].meta.get("val"), node.args[1]
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(dst, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        with graph.inserting_before(node):
            out = src
            if val.dtype != dst.dtype:
                val = val.to(dst.dtype)
                out = _call(graph, node, aten._to_copy.default, (out,), {"dtype": dst.dtype}, val)
            if tuple(val.shape) != tuple(dst.shape):
                val = val.expand(dst.shape)
                out = _call(graph, node, aten.expand.default, (out, list(dst.shape)), {}, val)
            out = _call(graph, node, aten.clone.default, (out,), {}, node.meta.get("val"))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    if count:
        graph_module.recompile()
    return count


def _call(graph, like, target, args, kwargs, val):
    """A node of ``target`` carrying ``like``'s meta (module stack, trace) and the value ``val``."""
    new = graph.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    new.meta["val"] = val
    return new


__all__ = ["differentiable_copies_pass"]
