"""Shrink a cost graph before the ILP sees it, without losing the ability to expand the answer.

Three steps, each exact or a documented local choice:

1. *fixed* nodes (depending on no input and no parameter, e.g. attention-mask arithmetic) run
   replicated; their outgoing edge costs become per-strategy costs of their consumers.
2. *followers*: an op node with exactly one producer takes, for each strategy ``s`` of its
   producer, the strategy ``f(s)`` minimising edge cost + its own cost (Alpa's follower
   heuristic); it folds into the producer, whose costs and out-edges absorb it.
3. *repeated layers*: nodes carry a layer label (:attr:`CostNode.layer`: capture's repeat
   label, a repeated block or a loop iteration, or a window's ``first`` and ``layer`` parts).
   Labels whose remaining nodes have the same ops and strategy lists form a class (T5's
   encoder blocks, its decoder blocks, a scan's time steps); in each class of two or more,
   position ``p`` of every label becomes one solver node (costs summed, edges summed, edges
   inside a group added on the diagonal). Identical layers thus share one decision.

``Reduced.expand(choice)`` turns the solver's answer back into one strategy index per node.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from autopar.planner.costgraph import CostGraph


@dataclass
class Reduced:
    """The solver's view: one entry per group of tied cost-graph nodes."""

    groups: list[list[int]]
    costs: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    constant_cost: float
    constant_memory: float
    num_nodes: int
    fixed: dict[int, int] = field(default_factory=dict)
    followers: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (node, leader, map)
    tied_layers: int = 0

    def expand(self, choice) -> np.ndarray:
        """Strategy index for every cost-graph node from one index per group."""
        out = np.full(self.num_nodes, -1, dtype=np.int64)
        for g, members in enumerate(self.groups):
            out[members] = int(choice[g])
        for node, s in self.fixed.items():
            out[node] = s
        for node, leader, fmap in reversed(self.followers):
            out[node] = fmap[out[leader]]
        assert (out >= 0).all(), "every node gets a strategy"
        return out

    def with_memory(self, graph: CostGraph) -> Reduced:
        """This reduction with the memory of ``graph``, a graph whose strategies, costs and edges
        are those of the one reduced (:func:`~autopar.planner.costgraph.with_memory`): what
        :func:`simplify` makes of it, whose folds and ties depend on costs alone."""
        mem = [node.memory.astype(float) for node in graph.nodes]
        constant = 0.0
        for i in self.fixed:  # in the order simplify fixed them
            constant += float(mem[i][0])
        for node, leader, fmap in self.followers:
            mem[leader] = mem[leader] + mem[node][fmap]
        return dataclasses.replace(self, memory=[sum(mem[i] for i in members) for members in self.groups],
                                   constant_memory=constant)


def simplify(graph: CostGraph, *, fold_followers: bool = True, share_layers: bool = True) -> Reduced:
    n = len(graph.nodes)
    cost = [graph.nodes[i].cost() + graph.unary.get(i, 0) for i in range(n)]
    mem = [graph.nodes[i].memory.astype(float).copy() for i in range(n)]
    out_e: list[dict[int, np.ndarray]] = [dict() for _ in range(n)]
    in_e: list[dict[int, np.ndarray]] = [dict() for _ in range(n)]
    for e in graph.edges:
        m = out_e[e.src].get(e.dst)
        total = e.cost if m is None else m + e.cost
        out_e[e.src][e.dst] = total
        in_e[e.dst][e.src] = total
    alive = [True] * n
    red = Reduced([], [], [], {}, 0.0, 0.0, n)

    def remove(i):
        alive[i] = False
        for d in out_e[i]:
            in_e[d].pop(i, None)
        for s in in_e[i]:
            out_e[s].pop(i, None)

    # 1. fixed nodes run replicated (strategy 0 is always all-replicated).
    for i, node in enumerate(graph.nodes):
        if node.fixed and node.kind == "op":
            red.fixed[i] = 0
            red.constant_cost += float(cost[i][0])
            red.constant_memory += float(mem[i][0])
            for d, m in out_e[i].items():
                if not graph.nodes[d].fixed:
                    cost[d] = cost[d] + m[0, :]
            remove(i)

    # 2. followers fold into their only producer, in topological (index) order.
    if fold_followers:
        for v in range(n):
            if not alive[v] or graph.nodes[v].kind != "op" or len(in_e[v]) != 1:
                continue
            (u, m), = in_e[v].items()
            fmap = np.argmin(m + cost[v][None, :], axis=1)
            rows = np.arange(len(fmap))
            cost[u] = cost[u] + m[rows, fmap] + cost[v][fmap]
            mem[u] = mem[u] + mem[v][fmap]
            for w, mw in list(out_e[v].items()):
                folded = mw[fmap, :]
                total = out_e[u][w] + folded if w in out_e[u] else folded
                out_e[u][w] = total
                in_e[w][u] = total
            red.followers.append((v, u, fmap))
            remove(v)

    # 3. tie identical repeated layers position by position, each class of identical ones apart.
    group_of = {}
    alive_nodes = [i for i in range(n) if alive[i]]
    if share_layers:
        by_layer: dict[str, list[int]] = defaultdict(list)
        for i in alive_nodes:
            if graph.nodes[i].layer is not None:
                by_layer[graph.nodes[i].layer].append(i)
        for layers in _identical_classes(graph, list(by_layer.values())):
            red.tied_layers += len(layers)
            for pos in range(len(layers[0])):
                g = len(red.groups)
                red.groups.append([layer[pos] for layer in layers])
                for layer in layers:
                    group_of[layer[pos]] = g
    for i in alive_nodes:
        if i not in group_of:
            group_of[i] = len(red.groups)
            red.groups.append([i])
    for members in red.groups:
        red.costs.append(sum(cost[i] for i in members))
        red.memory.append(sum(mem[i] for i in members))
    for u in alive_nodes:
        for w, m in out_e[u].items():
            gu, gw = group_of[u], group_of[w]
            if gu == gw:
                red.costs[gu] = red.costs[gu] + np.diag(m)
            else:
                red.edges[(gu, gw)] = red.edges[(gu, gw)] + m if (gu, gw) in red.edges else m
    return red


def _identical_classes(graph: CostGraph, layers: list[list[int]]) -> list[list[list[int]]]:
    """``layers`` split into classes of at least two layers with the same ops and strategies
    position by position, in order of first appearance."""
    classes: dict[tuple, list[list[list[int]]]] = defaultdict(list)  # op sequence -> classes
    for layer in layers:
        same_ops = classes[tuple(graph.nodes[i].op for i in layer)]
        for members in same_ops:
            if all(graph.nodes[a].strategies == graph.nodes[b].strategies for a, b in zip(members[0], layer)):
                members.append(layer)
                break
        else:
            same_ops.append([layer])
    found = [members for same_ops in classes.values() for members in same_ops if len(members) > 1]
    return sorted(found, key=lambda members: members[0][0])
