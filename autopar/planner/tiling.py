"""Layers too large for one device, run tile by tile (ZeRO-Infinity's memory-centric tiling); the
runtime's side is :mod:`autopar.runtime.tiles`.

In a plan whose parameters live on the host (:mod:`autopar.planner.fetched`), a linear or an
embedding whose weight is larger than :data:`TILE_SHARE` of the device limit may run as ``k``
tiles of its weight's rows (a linear's output features, an embedding's vocabulary) one after
another: each tile is fetched (the next one prefetched), used and freed, and in backward fetched
again, its gradient made and sent to the host. The device then holds two tiles and a tile's
gradient where it held the weight and its gradient. The link moves the same bytes; within the
op a tile's fetch hides behind the previous tile's compute::

    seconds(pass) = t(tile) + (k - 1) * max(0, t(tile) - compute(pass) / k)

Tiling is offered on one-device meshes (where the weight reaches the op as stored; sharding it
over devices is the other answer to a layer too large for one), and the search keeps the tiled
plan only where it fits and the untiled one does not, or where it is faster
(:func:`autopar.planner.intra.plan_intra`).
"""

from __future__ import annotations

import math

TILE_SHARE = 1 / 16  # a tile holds at most this share of the device limit
WEIGHT_INPUT = {"aten.linear.default": 1, "aten.embedding.default": 0}  # the weight's tensor input


def tileable(graph, captured) -> dict[str, str]:
    """Node name -> its weight's FQN, for each linear or embedding of ``graph`` (a cost graph of
    ``captured``) reading a floating parameter as its weight (an embedding: without padding index,
    frequency scaling or sparse gradients)."""
    fx = {n.name: n for n in captured.graph_module.graph.nodes}
    out = {}
    for e in graph.edges:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        op = str(getattr(fx.get(dst.name), "target", ""))
        if (src.kind != "parameter" or dst.kind != "op" or WEIGHT_INPUT.get(op) != e.in_index
                or not captured.parameters[src.target].dtype.is_floating_point):
            continue
        if op == "aten.embedding.default" and tuple(fx[dst.name].args[2:]) not in ((), (-1,), (-1, False),
                                                                                    (-1, False, False)):
            continue
        out[dst.name] = src.target
    return out


def tile_counts(graph, captured, param_memory: dict, limit: float) -> dict[str, int]:
    """Node name -> tiles for each tileable node (:func:`tileable`) whose weight (``param_memory``:
    FQN -> device bytes were it kept there) is larger than :data:`TILE_SHARE` of ``limit``: the
    fewest tiles each within it."""
    share = TILE_SHARE * limit
    return {name: math.ceil(param_memory[fqn][0] / share) for name, fqn in tileable(graph, captured).items()
            if param_memory[fqn][0] > share}


def tiled_weights(graph, captured, tiles: dict) -> dict[str, str]:
    """Node name -> its weight's FQN for the ``tiles`` nodes."""
    weights = tileable(graph, captured)
    return {name: weights[name] for name in tiles}


def tile_seconds(fetch: float, k: int, compute: float) -> float:
    """Link seconds not hidden in one pass over ``k`` tiles each fetched in ``fetch`` seconds,
    the op's ``compute`` seconds shared among them."""
    return fetch + (k - 1) * max(0.0, fetch - compute / k)


__all__ = ["TILE_SHARE", "WEIGHT_INPUT", "tile_counts", "tile_seconds", "tileable", "tiled_weights"]
