"""What keeping the parameters on the host and fetching them per layer (ZeRO-Infinity's parameter
offload) changes in a one-program plan; the runtime's side is :mod:`autopar.runtime.fetch`.

The parameters are grouped as the runtime fetches them: by the run of one layer's nodes reading
them (:func:`~autopar.core.recompute.node_layers`; the embedding and the head are runs of their
own), in graph order. The device keeps no parameter, gradient or optimizer state between uses:

- **memory**: while the backward of a group's nodes runs, that group's pieces (fetched again) and
  the previous group's (prefetched) are on the device, beside what the backward walk holds
  (:func:`~autopar.planner.peak.backward_walk`: saved activations, the node's own gradients and
  scratch); each parameter gradient leaves for the host when made. The host holds the optimizer's
  copies (:mod:`autopar.planner.offload`) and, under mixed precision, the program's bf16 pieces.
- **time**: each group is fetched in forward and again in backward, and its gradients copied down,
  over ``cluster.host_link_bandwidth``. A fetch made ahead overlaps the compute between the two
  fetches (the runtime copies on a side CUDA stream); only what it exceeds that compute by is
  paid, and the first fetch of each pass in full. The gradients go down on the compute stream
  (paid in full), and the CPUs step every element (no link traffic at the step)::

    seconds = t(b_0) + sum_j max(0, t(b_j+1) - forward_j)            forward fetches
            + t(b_k) + sum_j max(0, t(b_j-1) - backward_j)           backward fetches
            + t(gradients) + elements / host_step_rate               gradients down, CPU step
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autopar.core.recompute import node_layers, program_nodes
from autopar.planner.costgraph import copied
from autopar.planner.tiling import tile_seconds, tiled_weights


@dataclass(frozen=True)
class Fetched:
    """A plan's parameter offload: ``groups`` (parameter FQNs per fetch, in order) and their
    device ``bytes``, the device bytes fetched beside each op node's backward (cost-graph index ->
    bytes), and the link seconds paid (``seconds``: exposed fetches and gradients down)."""

    groups: tuple[tuple[str, ...], ...]
    bytes: tuple[float, ...]
    window: dict
    seconds: float


def fetch_groups(graph, captured, tiled=frozenset()) -> list[tuple[int, dict]]:
    """``(index of its first user in the cost graph, {parameter FQN: index of its last user})``
    per group the runtime fetches at once (module docstring), in graph order; floating trainable
    or frozen parameters only, and not the weights of the ``tiled`` nodes (names), which fetch
    their own tiles (:mod:`autopar.planner.tiling`)."""
    nodes = program_nodes(captured.graph_module.graph)
    run, runs, previous = {}, -1, object()
    for node, layer in zip(nodes, node_layers(nodes)):
        if layer != previous:
            runs, previous = runs + 1, layer
        run[node.name] = runs
    groups: dict[int, dict] = {}  # run -> {fqn: [first user index, last user index]}
    for e in graph.edges:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        if (src.kind != "parameter" or dst.kind != "op" or dst.name in tiled
                or not captured.parameters[src.target].dtype.is_floating_point):
            continue
        users = groups.setdefault(run[dst.name], {}).setdefault(src.target, [e.dst, e.dst])
        users[0], users[1] = min(users[0], e.dst), max(users[1], e.dst)
    out = [(min(u[0] for u in m.values()), {f: u[1] for f, u in sorted(m.items(), key=lambda kv: kv[1][0])})
           for m in groups.values()]
    return sorted(out, key=lambda g: g[0])


def fetched(graph, choice, captured, cluster, param_memory: dict, tiles: dict | None = None) -> Fetched:
    """The :class:`Fetched` of ``graph`` under ``choice`` (``param_memory``: FQN -> (parameter,
    gradient, optimizer) bytes per device were they kept on the device; ``tiles``: node name ->
    tiles of the linears and embeddings run tile by tile, :mod:`autopar.planner.tiling`)."""
    tiles = tiles or {}
    weights = tiled_weights(graph, captured, tiles)
    groups = fetch_groups(graph, captured, frozenset(tiles))
    starts = [first for first, _ in groups]
    sizes = [sum(param_memory[f][0] for f in members) for _, members in groups]
    grads = sum(param_memory[f][0] for _, members in groups for f in members if param_memory[f][1])
    # in backward a piece is on the device from its group's successor's fetch (which prefetches
    # it) until the backward of its last user has run; the last group's from that backward only
    change = np.zeros(len(graph.nodes) + 1)
    for g, (_, members) in enumerate(groups):
        for fqn, last in members.items():
            held_from = max(groups[g + 1][1].values()) if g + 1 < len(groups) else last
            change[last] += param_memory[fqn][0]
            change[held_from + 1] -= param_memory[fqn][0]
    window = dict(enumerate(np.cumsum(change[:-1])))
    forward = np.zeros(len(groups))
    backward = np.zeros(len(groups))
    link = cluster.host_link_bandwidth
    seconds, g = 0.0, -1
    for i, (node, c) in enumerate(zip(graph.nodes, choice)):
        while g + 1 < len(starts) and starts[g + 1] <= i:
            g += 1
        if node.kind != "op":
            continue
        fwd = float(node.forward[c]) if node.forward is not None else float(node.compute[c]) / 3
        if node.name in tiles:  # the link carries its tiles meanwhile: no group's prefetch hides here
            fqn, k = weights[node.name], tiles[node.name]
            tile = param_memory[fqn][0] / k
            window[i] += 3 * tile - param_memory[fqn][0]  # two tiles and a tile's gradient, not the whole
            seconds += tile_seconds(tile / link, k, fwd) + tile_seconds(tile / link, k, float(node.compute[c]) - fwd)
            grads += param_memory[fqn][0] if param_memory[fqn][1] else 0.0
        elif g >= 0:
            forward[g] += fwd
            backward[g] += float(node.compute[c]) - fwd
    t = [b / link for b in sizes]
    if groups:
        seconds += t[0] + sum(max(0.0, t[j + 1] - forward[j]) for j in range(len(t) - 1))
        seconds += t[-1] + sum(max(0.0, t[j - 1] - backward[j]) for j in range(1, len(t)))
    seconds += grads / link
    return Fetched(tuple(tuple(m) for _, m in groups), tuple(sizes), window, seconds)


def fetched_graph(graph, cost_model, captured):
    """``graph`` with its floating parameters' memory taken out (they live on the host) and, on
    each strategy of theirs, the seconds its piece costs every step whatever is fetched when: its
    elements' CPU step and, trainable, its gradient down the link (:func:`fetched`'s last line):
    what the ILP bounds and minimises for a plan fetching them (the fetched window is part of
    the step peak's excess over that sum, which the re-solve bounds; the fetches the compute
    does not hide are left to the plan). Its costs differ from ``graph``'s, so it is simplified
    afresh; kept in ``graph``'s memo for every saver that fetches."""
    view = graph.memo.get("fetched view")
    if view is not None:
        return view
    cluster = cost_model.cluster
    rate, link = cluster.host_step_rate(cost_model.options.optimizer), cluster.host_link_bandwidth
    read = {e.src for e in graph.edges if graph.nodes[e.dst].kind == "op"}  # fetched: their gradients go down
    nodes = []
    for i, n in enumerate(graph.nodes):
        if n.kind != "parameter" or not captured.parameters[n.target].dtype.is_floating_point:
            nodes.append(n)
            continue
        meta = captured.parameters[n.target]
        pieces = [cost_model.parameter_split(meta, s.outputs[0], frozen=not n.requires_grad) for s in n.strategies]
        itemsize = cost_model.precision.dtype(meta.dtype).itemsize
        seconds = np.array([p / itemsize / rate + (p / link if g and i in read else 0.0) for p, g, _ in pieces])
        nodes.append(copied(n, memory=np.zeros_like(n.memory), compute=n.compute + seconds))
    view = graph.memo["fetched view"] = dataclasses.replace(graph, nodes=nodes)
    return view


__all__ = ["Fetched", "fetch_groups", "fetched", "fetched_graph"]
