"""From a Plan (data) back to the ShardingAssignment that code generation consumes."""

from __future__ import annotations

import operator

import torch

from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import PlanError
from autopar.core.ir import Strategy, output_leaves
from autopar.core.placement import R, parse_placement, parse_sharding


def assignment_of(plan, captured, *, strategies: dict | None = None) -> ShardingAssignment:
    """Every node's strategy, every placeholder's storage and every output's sharding (a
    non-tensor user input, a constant of the trace, is replicated; the loss and a buffer's new
    value, stored replicated, end replicated). ``strategies``: node name -> :class:`Strategy`
    where the caller has them (the plan's nodes' text need not be parsed again)."""
    mesh = tuple(plan.mesh_shape)
    replicated = (R,) * len(mesh)
    if strategies is None:
        strategies = {
            n.node: Strategy(tuple(parse_sharding(s) for s in n.inputs),
                             tuple(parse_sharding(s) for s in n.outputs), n.local)
            for n in plan.nodes
        }
    placeholders = {}
    for inp in captured.inputs:
        table = {"parameter": plan.parameter_placements, "user_input": plan.input_placements}.get(inp.kind)
        if table is None or inp.name not in table:
            if inp.kind == "parameter" or inp.kind == "user_input" and inp.meta is not None:
                raise PlanError(f"the plan has no placement for {inp.kind} {inp.name!r}: re-plan this model")
            placeholders[inp.node] = replicated
            continue
        placeholders[inp.node] = tuple(parse_placement(p) for p in table[inp.name])
    replicated_out = {o.node for o in captured.outputs if o.kind in ("loss", "buffer_mutation")}  # as stored
    outputs = []
    for leaf in output_leaves(captured.graph_module.graph):
        outputs.append(replicated if leaf.name in replicated_out
                       else _produced(leaf, strategies, placeholders, replicated))
    return ShardingAssignment(mesh_shape=mesh, node_strategies=strategies,
                              placeholder_shardings=placeholders, output_shardings=tuple(outputs))


def _produced(node: torch.fx.Node, strategies, placeholders, default):
    """The sharding a node's output has under the plan (the outputs :func:`assignment_of` does not
    replicate stay put)."""
    if node.name in placeholders:
        return placeholders[node.name]
    if node.name in strategies:
        return strategies[node.name].outputs[0]
    if node.target is operator.getitem:
        src, k = node.args
        if src.name in strategies:
            return strategies[src.name].outputs[k]
    return default
