"""What a plan records per node beyond its choice: FLOPs, forward seconds, activation bytes, and
the next-best strategies with what switching to each would change (for ``plan.explain``).

The change of switching node ``i`` from its chosen strategy ``c`` to ``s``, every other node's
choice held fixed, is read straight off the cost graph::

    Δtime(s) = cost_i[s] − cost_i[c] + unary_i[s] − unary_i[c]
             + Σ_{edges i→j} (E[s, c_j] − E[c, c_j]) + Σ_{edges j→i} (E[c_j, s] − E[c_j, c])
    Δmemory(s) = memory_i[s] − memory_i[c]

It can be negative: the solver may have passed over a locally faster strategy because of the
memory limit, because repeated layers share one decision, or because a folded follower takes
its producer's choice.
"""

from __future__ import annotations

import numpy as np

from autopar.core.ir import spec_of_node
from autopar.core.placement import format_sharding
from autopar.plan import Alternative

DEFAULT_TOP = 3


def incident_edges(graph) -> tuple[dict[int, list], dict[int, list]]:
    """Node index -> its outgoing edges, and -> its incoming edges."""
    out: dict[int, list] = {}
    inc: dict[int, list] = {}
    for e in graph.edges:
        out.setdefault(e.src, []).append(e)
        inc.setdefault(e.dst, []).append(e)
    return out, inc


def switch_costs(graph, choice, i: int, *, out_edges=(), in_edges=()) -> tuple[np.ndarray, np.ndarray]:
    """``(Δtime, own communication)`` per strategy of node ``i``, others fixed (module docstring);
    own communication is the node's collectives plus resharding into it, as NodeChoice counts it."""
    node = graph.nodes[i]
    c = choice[i]
    own_comm = node.communication.astype(float).copy()
    unary = graph.unary.get(i)
    if unary is not None:
        own_comm += unary
    delta = node.cost() - node.cost()[c]
    if unary is not None:
        delta += unary - unary[c]
    for e in out_edges:
        col = e.cost[:, choice[e.dst]]
        delta += col - col[c]
    for e in in_edges:
        row = e.cost[choice[e.src], :]
        delta += row - row[c]
        own_comm += row
    return delta, own_comm


def best_alternatives(graph, choice, i: int, *, out_edges, in_edges, top: int, text, scale: float = 1.0,
                      step_delta=None, memory_scale: float = 1.0) -> tuple[Alternative, ...]:
    """The ``top`` strategies of node ``i`` other than its choice with the smallest Δtime, as
    :class:`Alternative` records: ``text(strategy)`` gives its ``(inputs, outputs)`` text, its
    seconds are multiplied by ``scale``, its Δtime mapped by ``step_delta`` (default: as is) and
    its Δmemory multiplied by ``memory_scale``."""
    node = graph.nodes[i]
    if node.size < 2 or top <= 0:
        return ()
    c = int(choice[i])
    delta, own_comm = switch_costs(graph, choice, i, out_edges=out_edges, in_edges=in_edges)
    order = [int(s) for s in np.argsort(delta, kind="stable") if s != c][:top]
    return tuple(
        Alternative(
            inputs=text(node.strategies[s])[0], outputs=text(node.strategies[s])[1],
            compute_time=float(node.compute[s]) * scale, communication_time=float(own_comm[s]) * scale,
            step_time_delta=float(delta[s] if step_delta is None else step_delta(float(delta[s]))),
            memory_delta=float(node.memory[s] - node.memory[c]) * memory_scale,
        )
        for s in order
    )


def node_details(graph, choice, captured, cost_model, *, top: int = DEFAULT_TOP) -> dict[str, dict]:
    """Per op node name: NodeChoice's ``flops``, ``forward_compute_time``, ``activation_memory``
    and ``top_alternatives`` (the ``top`` strategies with the smallest Δtime)."""
    gm_nodes = None
    out_edges, in_edges = incident_edges(graph)
    details: dict[str, dict] = {}
    texts: dict[int, tuple] = {}  # id(strategy) -> (inputs, outputs) as text; layers share strategies

    def text(strategy):
        hit = texts.get(id(strategy))
        if hit is None:
            hit = texts[id(strategy)] = (tuple(format_sharding(x) for x in strategy.inputs),
                                         tuple(format_sharding(x) for x in strategy.outputs), strategy)
        return hit

    for i, node in enumerate(graph.nodes):
        if node.kind != "op":
            continue
        c = int(choice[i])
        flops, fwd = node.flops, None if node.forward is None else node.forward[c]
        if flops is None or fwd is None:  # not kept by the graph's builder: cost the op here
            spec = node.spec
            if spec is None:
                gm_nodes = gm_nodes or {n.name: n for n in captured.graph_module.graph.nodes}
                spec = spec_of_node(gm_nodes[node.name])
            flops = cost_model.op_flops(spec)
            fwd = cost_model.op_times(spec, node.strategies[c])[0]
        alternatives = best_alternatives(graph, choice, i, out_edges=out_edges.get(i, ()),
                                         in_edges=in_edges.get(i, ()), top=top, text=text)
        details[node.name] = dict(
            flops=float(flops), forward_compute_time=float(fwd),
            activation_memory=float(node.memory[c]), top_alternatives=alternatives,
        )
    return details
