"""A linear or an embedding run tile by tile from its weight on the host (``Plan.tiles``,
:mod:`autopar.planner.tiling`).

The weight's rows are cut into ``tiles`` nearly equal tiles (a linear's output features, an
embedding's vocabulary). Forward fetches each tile (the next one prefetched: :class:`~autopar.runtime.fetch.Fetcher`),
computes its part of the output and frees it; it saves only the op's input. Backward fetches the
tiles again, adds each tile's share of the input's gradient in fp32 (one matmul's kernel
accumulates so and rounds once; bf16 tile sums rounded k times, which bf16 AdamW runs showed as
sign flips in 13 % of the next layer's weight; the cost model still prices these matmuls at the
compute dtype's rate), and makes the tile's weight gradient on the device and copies it into the
host gradient. The device holds two tiles and a
tile's gradient at a time; the values are the untiled op's (each output element is the same dot
product or lookup).
"""

from __future__ import annotations

import torch
from torch.autograd import Function
from torch.nn import functional as F


def _bounds(rows: int, tiles: int) -> list[tuple[int, int]]:
    cuts = [rows * k // tiles for k in range(tiles + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _tiles(fetcher, weight, bounds):
    """Each tile of ``weight`` (on the host) fetched in turn, the next one prefetched."""
    for k, (a, b) in enumerate(bounds):
        tile = fetcher.take(weight[a:b])
        if k + 1 < len(bounds):
            fetcher.prefetch((weight[slice(*bounds[k + 1])],))
        yield a, b, tile


def _remember(ctx, weight, fetcher, tiles: int, saved) -> None:
    """Keep what backward needs: the host weight (no device memory), its tiles, ``saved``."""
    ctx.fetcher, ctx.bounds, ctx.weight = fetcher, _bounds(weight.shape[0], tiles), weight.detach()
    ctx.save_for_backward(saved)


class _TiledLinear(Function):
    @staticmethod
    def forward(ctx, x, weight, fetcher, tiles):
        _remember(ctx, weight, fetcher, tiles, x)
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for a, b, tile in _tiles(fetcher, ctx.weight, ctx.bounds):
            out[..., a:b] = F.linear(x, tile)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        # the input's gradient sums every tile's share: in fp32, as one matmul's kernel would
        grad_x = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32)) \
            if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        rows = x.reshape(-1, x.shape[-1])
        for a, b, tile in _tiles(ctx.fetcher, weight, ctx.bounds):
            part = grad[..., a:b]
            if grad_x is not None:
                grad_x += part.to(grad_x.dtype) @ tile.to(grad_x.dtype)
            if grad_w is not None:
                grad_w[a:b].copy_(part.reshape(-1, b - a).t() @ rows)
        return (None if grad_x is None else grad_x.to(x.dtype)), grad_w, None, None


class _TiledEmbedding(Function):
    @staticmethod
    def forward(ctx, weight, indices, fetcher, tiles):
        _remember(ctx, weight, fetcher, tiles, indices)
        out = None
        for a, b, tile in _tiles(fetcher, ctx.weight, ctx.bounds):
            inside = (indices >= a) & (indices < b)
            rows = F.embedding((indices - a).clamp(0, b - a - 1), tile)
            out = torch.where(inside.unsqueeze(-1), rows, 0 if out is None else out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        weight = ctx.weight
        grad_w = torch.empty_like(weight)
        flat, rows = indices.reshape(-1), grad.reshape(-1, grad.shape[-1])
        for a, b in ctx.bounds:  # rows of other tiles add zeros (no data-dependent shapes: fake tensors run it)
            inside = ((flat >= a) & (flat < b)).unsqueeze(-1)
            tile = rows.new_zeros(b - a, rows.shape[-1])
            tile.index_add_(0, (flat - a).clamp(0, b - a - 1), torch.where(inside, rows, 0))
            grad_w[a:b].copy_(tile)
        return grad_w, None, None, None


def autopar_tiled_linear(fetcher, x, weight, bias=None, *, tiles: int):
    """``aten.linear(x, weight, bias)`` with ``weight`` on the host, run in ``tiles`` tiles of its
    rows (module docstring); ``bias`` is a fetched device copy."""
    out = _TiledLinear.apply(x, weight, fetcher, tiles)
    return out if bias is None else out + bias


def autopar_tiled_embedding(fetcher, weight, indices, *args, tiles: int):
    """``aten.embedding(weight, indices)`` with ``weight`` on the host, run in ``tiles`` tiles of
    its vocabulary (module docstring)."""
    return _TiledEmbedding.apply(weight, indices, fetcher, tiles)


TILED = {"aten.linear.default": autopar_tiled_linear, "aten.embedding.default": autopar_tiled_embedding}


def tiled_weight(node: torch.fx.Node):
    """The weight a tiled op reads from the host (its placeholder), None for other nodes."""
    if node.op != "call_function" or node.target not in (autopar_tiled_linear, autopar_tiled_embedding):
        return None
    return node.args[2 if node.target is autopar_tiled_linear else 1]


def tile_nodes(graph: torch.fx.Graph, tiles: dict, offloaded: set[str], fetcher_node_of) -> None:
    """Replace each node named in ``tiles`` (a linear or an embedding whose weight is a placeholder
    named in ``offloaded``) by its tiled op; ``fetcher_node_of(node)`` inserts the node reading
    the fetcher before ``node``."""
    for node in list(graph.nodes):
        if node.name not in tiles:
            continue
        tiled = TILED.get(str(node.target))
        weight = node.args[1 if str(node.target) == "aten.linear.default" else 0] if tiled else None
        if weight is None or weight.op != "placeholder" or weight.name not in offloaded:
            raise ValueError(f"node {node.name} ({node.target}) is no linear or embedding reading an offloaded"
                             " weight: it cannot run tile by tile")
        with graph.inserting_before(node):
            source = fetcher_node_of(node)
            source.meta["autopar_layer"] = node.meta.get("autopar_layer")
            new = graph.call_function(tiled, (source, *node.args), {"tiles": tiles[node.name]})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


__all__ = ["TILED", "autopar_tiled_embedding", "autopar_tiled_linear", "tile_nodes", "tiled_weight"]
