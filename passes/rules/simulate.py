"""Run one op under a strategy on a simulated mesh in one process, to check a sharding rule.

``distribute`` cuts a global tensor into per-rank pieces (axis by axis, so a dim sharded on two
axes is split axis-0-major), ``assemble`` inverts it (cat for ``Shard``, sum for ``Partial``,
and for ``Replicate`` it checks the copies agree). A strategy that names a local implementation
(``Strategy.local``) runs that implementation per rank instead of the op.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils import _pytree as pytree

from autopar.core.ir import Strategy
from autopar.core.layout import local_context
from autopar.core.placement import Partial, Replicate, Shard, Sharding
from autopar.passes.rules.registry import local_impl


def _coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def distribute(tensor: torch.Tensor, sharding: Sharding, mesh_shape, generator=None) -> dict:
    """``{rank coordinate: local tensor}``; ``Partial`` pieces are random and sum to the input."""
    pieces = {(): tensor}
    for axis, placement in enumerate(sharding):
        n = mesh_shape[axis]
        nxt = {}
        for prefix, t in pieces.items():
            if isinstance(placement, Shard):
                parts = list(torch.chunk(t, n, dim=placement.dim))
            elif isinstance(placement, Partial):
                rand = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for _ in range(n - 1)]
                parts = rand + [t - sum(rand)] if rand else [t]
            else:
                parts = [t] * n
            for i, part in enumerate(parts):
                nxt[prefix + (i,)] = part.contiguous()
        pieces = nxt
    return pieces


class ReplicaMismatch(AssertionError):
    """Ranks that should hold the same replicated value do not."""


def assemble(pieces: dict, sharding: Sharding, mesh_shape, *, rtol=1e-4, atol=1e-5) -> torch.Tensor:
    """Global tensor from ``{rank coordinate: local tensor}`` (inverse of :func:`distribute`)."""
    for axis in reversed(range(len(mesh_shape))):
        placement = sharding[axis]
        groups: dict = {}
        for coord, t in sorted(pieces.items()):
            groups.setdefault(coord[:axis], []).append(t)
        merged = {}
        for prefix, parts in groups.items():
            if isinstance(placement, Shard):
                merged[prefix] = torch.cat(parts, dim=placement.dim)
            elif isinstance(placement, Partial):
                merged[prefix] = sum(parts[1:], parts[0])
            else:
                for other in parts[1:]:
                    if not _close(parts[0], other, rtol, atol):
                        raise ReplicaMismatch(f"replicas differ on mesh axis {axis}")
                merged[prefix] = parts[0]
        pieces = merged
    return pieces[()]


def _close(a, b, rtol, atol) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return torch.equal(a, b)


def run_sharded(op, args, kwargs, strategy: Strategy, mesh_shape, seed: int = 0):
    """Run ``op`` per rank under ``strategy``; returns the assembled tensor outputs (a list).

    With ``strategy.local`` set, each rank runs the rule's local implementation of that name,
    given a :class:`~autopar.passes.rules.registry.LocalContext` for its coordinate.
    """
    gen = torch.Generator().manual_seed(seed)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    local = {
        pos: distribute(leaves[pos], sh, mesh_shape, gen)
        for pos, sh in zip(tensor_pos, strategy.inputs)
    }
    impl = None
    if strategy.local is not None:
        impl = local_impl(op, strategy.local)
        global_outs = [x for x in pytree.tree_leaves(op(*args, **kwargs)) if isinstance(x, torch.Tensor)]
        in_shapes = [tuple(leaves[pos].shape) for pos in tensor_pos]
        out_shapes = [tuple(x.shape) for x in global_outs]
    outs_per_rank: dict = {}
    for coord in _coords(mesh_shape):
        rank_leaves = list(leaves)
        for pos in tensor_pos:
            rank_leaves[pos] = local[pos][coord]
        a, k = pytree.tree_unflatten(rank_leaves, spec)
        if impl is None:
            result = op(*a, **k)
        else:
            ctx = local_context(
                input_shapes=in_shapes, output_shapes=out_shapes, strategy=strategy,
                mesh_shape=mesh_shape, coord=coord,
            )
            result = impl(op, a, k, ctx)
        outs_per_rank[coord] = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
    n_out = len(strategy.outputs)
    return [
        assemble({c: outs[i] for c, outs in outs_per_rank.items()}, strategy.outputs[i], mesh_shape)
        for i in range(n_out)
    ]


def check_strategy(op, args, kwargs, strategy: Strategy, mesh_shape, *, rtol=1e-4, atol=1e-5) -> None:
    """Raise AssertionError if ``strategy`` does not reproduce the unsharded op's outputs."""
    expected = [x for x in pytree.tree_leaves(op(*args, **kwargs)) if isinstance(x, torch.Tensor)]
    got = run_sharded(op, args, kwargs, strategy, mesh_shape)
    if len(got) != len(expected):
        raise AssertionError(f"{op}: {len(got)} outputs, expected {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        if not _close(g, e, rtol, atol):
            err = (g.double() - e.double()).abs().max().item() if g.shape == e.shape else "shape"
            raise AssertionError(
                f"{op} under {strategy.name} on mesh {tuple(mesh_shape)}: output {i} differs"
                f" (got shape {tuple(g.shape)}, expected {tuple(e.shape)}, max err {err})"
            )


__all__ = ["Replicate", "ReplicaMismatch", "assemble", "check_strategy", "distribute", "run_sharded"]
