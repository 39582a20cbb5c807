"""Uninitialised tensors made defined: ``empty_like`` becomes ``zeros_like`` and ``new_empty``
``new_zeros`` in the captured graph.

An ``empty`` tensor's values are whatever its memory held, so no sharding rule can be checked
against the unsharded op, and the planner ran such ops replicated. Zeros are one of the values
an ``empty`` tensor may hold, so the program still computes what the model does (it writes
every element it reads: routed-MoE layers fill a ``empty_like`` buffer by ``index_put``); the
zeros' rules shard them like their input.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
DEFINED = {aten.empty_like.default: aten.zeros_like.default, aten.new_empty.default: aten.new_zeros.default}


def defined_empties_pass(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite ``graph_module``'s uninitialised-tensor ops in place; the count rewritten."""
    count = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in DEFINED:
            node.target = DEFINED[node.target]
            count += 1
    if count:
        graph_module.recompile()
    return count
