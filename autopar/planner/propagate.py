"""Greedy forward propagation of shardings: a quick way to hand-force a sharding assignment.

It is not a planner: no baseline and no planner calls it, and it weighs nothing but the bytes a
resharding moves. Tests use it to build programs with chosen shardings (codegen's error for an
unplanned node suggests it for a partial plan).

Fix the storage sharding of some placeholders (``x: S(0)`` and every parameter ``R`` is data
parallelism; a weight ``S(0)`` and the next ``S(1)`` is Megatron's MLP) and walk the graph in
order: each op takes the first registry strategy whose inputs are exactly what its producers
give, else the one whose forward resharding sends the fewest bytes (ties: the earlier strategy,
so the all-replicated one wins), and ``getitem`` follows its tuple element. Strategies given in
``node_strategies`` are kept as they are::

    assignment = propagate(gm, (2,), {"x": (Shard(0),)})
"""

from __future__ import annotations

import operator
from typing import Mapping

import torch

from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import CodegenError
from autopar.core.ir import IGNORED_OPS, Strategy, output_leaves, spec_of_node, tensor_inputs
from autopar.core.placement import Partial, R, Sharding
from autopar.core.reshard import price
from autopar.cost_models.communication import bus_factor
from autopar.passes.rules.registry import strategies


def _cost(strategy: Strategy, current: list[Sharding], nodes, mesh_shape) -> float:
    """Bytes one rank sends (ring collectives) to reshard the inputs in forward."""
    total = 0.0
    for want, have, node in zip(strategy.inputs, current, nodes):
        if want != have:
            val = node.meta["val"]
            for c in price(have, want, shape=tuple(val.shape), itemsize=val.element_size(), mesh_shape=mesh_shape):
                total += bus_factor(c.kind, mesh_shape[c.axis]) * c.nbytes
    return total


def propagate(
    graph_module: torch.fx.GraphModule,
    mesh_shape: tuple[int, ...],
    placeholder_shardings: Mapping[str, Sharding] | None = None,
    *,
    node_strategies: Mapping[str, Strategy] | None = None,
    output_shardings=None,
) -> ShardingAssignment:
    """A :class:`ShardingAssignment` by greedy forward propagation (see the module docstring).

    Placeholders missing from ``placeholder_shardings`` are replicated; ``output_shardings``
    defaults to each output as its producer leaves it, pending sums reduced (so a scalar loss is
    replicated and a data-parallel ``logits`` output stays sharded on the batch).
    """
    mesh_shape = tuple(mesh_shape)
    k = len(mesh_shape)
    forced = dict(node_strategies or {})
    holders = dict(placeholder_shardings or {})
    graph = graph_module.graph
    names = {n.name for n in graph.nodes}
    unknown = sorted((set(holders) | set(forced)) - names)
    if unknown:
        raise CodegenError(f"propagate: no graph node is named {unknown}; names are FX node names")
    out_sh: dict = {}  # value node -> sharding; multi-output node -> tuple of shardings
    chosen: dict[str, Strategy] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            sh = holders.setdefault(node.name, (R,) * k)
            out_sh[node] = sh
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            vals = src.meta.get("val")
            if src in out_sh and isinstance(vals, (tuple, list)) and isinstance(vals[idx], torch.Tensor):
                out_sh[node] = out_sh[src][sum(1 for v in vals[:idx] if isinstance(v, torch.Tensor))]
        elif node.op == "call_function" and node.target not in IGNORED_OPS:
            ins = tensor_inputs(node)
            current = [out_sh[x] for x in ins]
            strat = forced.get(node.name)
            if strat is None:
                options = strategies(spec_of_node(node), mesh_shape, warn=False)
                exact = [s for s in options if list(s.inputs) == current]
                strat = exact[0] if exact else min(
                    options, key=lambda s: _cost(s, current, ins, mesh_shape))
            chosen[node.name] = strat
            val = node.meta.get("val")
            out_sh[node] = strat.outputs[0] if isinstance(val, torch.Tensor) else tuple(strat.outputs)
    if output_shardings is None:  # as produced, with pending sums reduced
        output_shardings = tuple(tuple(R if isinstance(p, Partial) else p for p in out_sh[x])
                                 for x in output_leaves(graph))
    return ShardingAssignment(mesh_shape=mesh_shape, node_strategies=chosen,
                              placeholder_shardings=holders, output_shardings=tuple(output_shardings))


__all__ = ["propagate"]
