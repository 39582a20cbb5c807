"""Mean-reduced cross entropy as sum / count, so that the loss shards over the batch.

``aten.cross_entropy_loss`` with ``reduction=1`` (mean) divides by the number of targets that
are not ``ignore_index``: on a batch shard that count is the rank's own, so no sharding rule can
give the mean (``passes/rules/loss.py`` offers none). :func:`mean_loss_pass` (run by capture
after decomposition) rewrites every such call with no class weights, no label smoothing and
class-index targets into::

    total = cross_entropy_loss(x, t, None, 2, ignore_index, 0.0)   # sum: batch shard -> Partial
    count = sum(_to_copy(ne(t, ignore_index), dtype=acc))          # batch shard -> Partial
    loss  = div(total, count)                                     # Partial / Replicate

``acc`` is x's dtype when it has at least 32 bits, else float32 (bf16 counts only to 256
exactly); then ``total`` is cast to float32 before the division and the quotient back to x's
dtype. The count is cast before it is summed because a float sum passes Partial on while the
cast of an integer Partial does not. Sharded over the batch, the count is all-reduced (one scalar)
before the division and the loss once after it. All targets ignored gives 0/0 = nan, as the mean
does. Class weights (the divisor is a sum of weights), label smoothing and probability targets
are left as they are. Every new node gets ``val`` (run on fake tensors), ``autopar_tensor`` and
the loss node's module path, layer and ``nn_module_stack``.
"""

from __future__ import annotations

import torch

from autopar.core.ir import TensorMeta

aten = torch.ops.aten

_NAMES = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_DEFAULTS = (None, None, None, 1, -100, 0.0)
MEAN, SUM = 1, 2


def _call_args(node: torch.fx.Node) -> list:
    values = list(_DEFAULTS)
    values[: len(node.args)] = node.args
    for key, value in node.kwargs.items():
        values[_NAMES.index(key)] = value
    return values


def _rewritable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
        return False
    x, t, weight, reduction, _, smoothing = _call_args(node)
    tval = t.meta.get("val") if isinstance(t, torch.fx.Node) else None
    return (weight is None and reduction == MEAN and smoothing == 0.0
            and isinstance(tval, torch.Tensor) and not tval.dtype.is_floating_point
            and isinstance(x.meta.get("val"), torch.Tensor))


def _val(target, args, kwargs):
    """The op run on the arguments' fake tensors."""
    vals = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    fake = next(v.fake_mode for v in torch.utils._pytree.tree_leaves(vals)
                if isinstance(v, torch._subclasses.FakeTensor))
    with fake:
        return target(*vals[0], **vals[1])


def _insert(graph: torch.fx.Graph, like: torch.fx.Node, target, args, kwargs=None):
    node = graph.call_function(target, tuple(args), kwargs or {})
    val = _val(target, node.args, node.kwargs)
    node.meta = {k: like.meta[k] for k in ("nn_module_stack", "stack_trace", "autopar_module",
                                           "autopar_layer") if k in like.meta}
    node.meta["val"] = val
    node.meta["autopar_tensor"] = TensorMeta(tuple(val.shape), val.dtype)
    return node


def mean_loss_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite mean cross entropy as sum / count in ``gm`` (in place; see the module docstring)."""
    graph = gm.graph
    targets = [n for n in graph.nodes if _rewritable(n)]
    for node in targets:
        x, t, _, _, ignore, _ = _call_args(node)
        dtype = x.meta["val"].dtype
        acc = dtype if torch.finfo(dtype).bits >= 32 else torch.float32
        node.args, node.kwargs = (x, t, None, SUM, ignore, 0.0), {}
        node.meta["val"] = _val(node.target, node.args, node.kwargs)
        node.meta["autopar_tensor"] = TensorMeta(tuple(node.meta["val"].shape), dtype)
        users = list(node.users)
        with graph.inserting_after(node):
            kept = _insert(graph, node, aten.ne.Scalar, (t, ignore))
        with graph.inserting_after(kept):
            mask = _insert(graph, node, aten._to_copy.default, (kept,), {"dtype": acc})
        with graph.inserting_after(mask):
            count = _insert(graph, node, aten.sum.default, (mask,))
        total = node
        if acc != dtype:
            with graph.inserting_after(count):
                total = _insert(graph, node, aten._to_copy.default, (node,), {"dtype": acc})
        with graph.inserting_after(total if total is not node else count):
            loss = _insert(graph, node, aten.div.Tensor, (total, count))
        if acc != dtype:
            with graph.inserting_after(loss):
                loss = _insert(graph, node, aten._to_copy.default, (loss,), {"dtype": dtype})
        for user in users:
            user.replace_input_with(node, loss)
    if targets:
        graph.lint()
        gm.recompile()
    return gm


__all__ = ["mean_loss_pass"]
