"""The graph's outputs, named and classified, the loss among them.

A user output is named by its pytree key path (``logits``, ``[0]``, ``output`` for a bare
tensor); other outputs (buffer mutations, ...) by the FQN they update. A user output is a
``"loss"`` when its pytree key is ``loss`` (HF ModelOutput) or, if no output is keyed so, when
the whole model output is one 0-dim floating tensor.
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

from autopar.core.ir import TensorMeta
from autopar.passes.capture.graph import OUTPUT_KINDS, GraphOutput


def _leaf_names(spec, prefix: str = "") -> list[str]:
    if spec.is_leaf():
        return [prefix or "output"]
    ctx = spec.context
    n = spec.num_children
    if isinstance(ctx, (list, tuple)) and len(ctx) == n and all(isinstance(k, str) for k in ctx):
        keys = [f"{prefix}.{k}" if prefix else k for k in ctx]
    elif isinstance(ctx, type) and len(getattr(ctx, "_fields", ())) == n:  # namedtuple
        keys = [f"{prefix}.{k}" if prefix else k for k in ctx._fields]
    else:
        keys = [f"{prefix}[{i}]" for i in range(n)]
    return [name for child, key in zip(spec.children(), keys) for name in _leaf_names(child, key)]


def graph_outputs(exported, gm: torch.fx.GraphModule) -> list[GraphOutput]:
    """One :class:`GraphOutput` per leaf of ``gm``'s output node, in order."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(pytree.tree_leaves(out_node.args))
    specs = exported.graph_signature.output_specs
    user_names = iter(_leaf_names(exported.call_spec.out_spec))
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
    keyed = [o for o in user if o.name.rsplit(".", 1)[-1] == "loss"]
    if not keyed and len(user) == 1 and user[0].name == "output":
        meta = user[0].meta
        if isinstance(meta, TensorMeta) and meta.ndim == 0 and meta.dtype.is_floating_point:
            keyed = user
    loss_ids = {id(o) for o in keyed}
    return [GraphOutput("loss", o.name, o.node, o.meta) if id(o) in loss_ids else o
            for o in outputs]


__all__ = ["graph_outputs"]
