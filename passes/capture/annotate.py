"""Node meta: every node of the captured graph gets its shapes, module path and layer.

- ``meta["autopar_tensor"]``: a :class:`TensorMeta`, a tuple of them (``None`` for non-tensor
  entries) for multi-output nodes and the output node, or ``None`` for non-tensor values;
- ``meta["autopar_module"]``: the plain FQN of the module the node ran in (``""`` for the root);
  parameter and buffer placeholders get the module owning their FQN;
- ``meta["autopar_layer"]``: the repeated layer containing that module, or ``None``.
"""

from __future__ import annotations

import re

import torch
from torch.utils import _pytree as pytree

from autopar.passes.capture.graph import GraphInput, tensor_meta
from autopar.passes.capture.layers import layer_of

_PATH_TOKEN = re.compile(r"\[\s*['\"]?([^\]'\"]+?)['\"]?\s*\]")


def plain_fqn(path: str) -> str:
    """Export's module path as a plain FQN: ``L['self'].h[0].attn`` → ``h.0.attn``.

    Paths that are already plain (what non-strict export writes in torch 2.13) come back unchanged.
    """
    path = re.sub(r"^(L\[['\"]self['\"]\]|L__self__|self)\.?", "", path)
    path = _PATH_TOKEN.sub(r".\1", path).replace("._modules.", ".")
    return path.strip(".").replace("..", ".")


def _module_of_fqn(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def annotate(gm: torch.fx.GraphModule, inputs: list[GraphInput], layers: frozenset[str]) -> None:
    """Write the three ``autopar_*`` meta entries on every node of ``gm`` (see the module docstring)."""
    by_node = {i.node: i for i in inputs}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        meta = tensor_meta(node.meta.get("val"), node)
        if node.op == "placeholder":
            inp = by_node[node.name]
            module = _module_of_fqn(inp.name) if inp.kind in ("parameter", "buffer") else ""
        else:
            stack = node.meta.get("nn_module_stack") or {}
            module = plain_fqn(list(stack.values())[-1][0]) if stack else ""
        node.meta["autopar_tensor"] = meta
        node.meta["autopar_module"] = module
        node.meta["autopar_layer"] = layer_of(module, layers)
    annotate_output(gm)


def annotate_output(gm: torch.fx.GraphModule) -> None:
    """The output node's meta: one tensor meta per output leaf, the root module, no layer."""
    node = gm.graph.output_node()
    node.meta["autopar_tensor"] = tuple(
        a.meta.get("autopar_tensor") if isinstance(a, torch.fx.Node) else None
        for a in pytree.tree_leaves(node.args))
    node.meta["autopar_module"] = ""
    node.meta["autopar_layer"] = None


__all__ = ["annotate", "annotate_output", "plain_fqn"]
