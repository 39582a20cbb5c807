"""The graph's outputs, named and classified, the loss among them.

A user output is named by its pytree key path (``logits``, ``[0]``, ``output`` for a bare
tensor); other outputs (buffer mutations, ...) by the FQN they update. One user output is the
``"loss"``, found by :func:`~autopar.passes.capture.loss.loss_leaf` (the rule the runtime's
``loss_of`` uses too).
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

from autopar.passes.capture.graph import OUTPUT_KINDS, GraphOutput
from autopar.passes.capture.loss import leaf_names, loss_leaf


def graph_outputs(exported, gm: torch.fx.GraphModule) -> list[GraphOutput]:
    """One :class:`GraphOutput` per leaf of ``gm``'s output node, in order."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(pytree.tree_leaves(out_node.args))
    specs = exported.graph_signature.output_specs
    user_names = iter(leaf_names(exported.call_spec.out_spec))
    outputs: list[GraphOutput] = []
    for spec, value in zip(specs, values):
        node = value if isinstance(value, torch.fx.Node) else None
        meta = node.meta.get("autopar_tensor") if node is not None else None
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(GraphOutput("user_output", next(user_names, "output"),
                                       node.name if node else None, meta))
        else:
            kind = spec.kind.name.lower()
            outputs.append(GraphOutput(kind if kind in OUTPUT_KINDS else "user_output",
                                       spec.target or spec.arg.name,
                                       node.name if node else None, meta))
    user = [o for o in outputs if o.kind == "user_output"]
    index = loss_leaf([o.name for o in user], [o.meta for o in user])
    loss = user[index] if index is not None else None
    return [GraphOutput("loss", o.name, o.node, o.meta) if o is loss else o for o in outputs]


__all__ = ["graph_outputs"]
