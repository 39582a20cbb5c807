"""plan_steps: every pair of shardings on a 2x2 mesh, executed on simulated ranks in one process."""

from __future__ import annotations

import itertools

import pytest
import torch

from autopar.core.errors import ShardingError
from autopar.core.placement import Partial, Replicate, Shard, format_sharding
from autopar.core.reshard import Step, plan_steps, reshard_bytes
from autopar.passes.rules.simulate import assemble, distribute

R, P = Replicate(), Partial()
MESH = (2, 2)


def _groups(pieces, axis):
    """Coordinates grouped by everything but ``axis``, each group ordered along ``axis``."""
    groups: dict = {}
    for coord in sorted(pieces):
        groups.setdefault(coord[:axis] + coord[axis + 1 :], []).append(coord)
    return groups.values()


def _apply(step: Step, pieces: dict) -> dict:
    """Run one step on every simulated rank (the semantics the runtime collectives implement)."""
    out = {}
    for group in _groups(pieces, step.axis):
        parts = [pieces[c] for c in group]
        for i, c in enumerate(group):
            if step.kind == "all_reduce":
                out[c] = sum(parts[1:], parts[0])
            elif step.kind == "all_gather":
                out[c] = torch.cat(parts, step.dim)
            elif step.kind == "chunk":
                out[c] = parts[i].chunk(len(group), step.dim)[i]
            elif step.kind == "reduce_scatter":
                out[c] = sum(parts[1:], parts[0]).chunk(len(group), step.dim)[i]
            elif step.kind == "all_to_all":
                out[c] = torch.cat([p.chunk(len(group), step.dim2)[i] for p in parts], step.dim)
            elif step.kind == "to_partial":
                out[c] = parts[i] if i == 0 else torch.zeros_like(parts[i])
    return out


SHARDINGS = list(itertools.product([R, P, Shard(0), Shard(1)], repeat=2))


@pytest.mark.parametrize("src", SHARDINGS, ids=format_sharding)
def test_plan_steps_turns_every_sharding_into_every_other(src):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(4, 8, generator=gen)
    for dst in SHARDINGS:
        pieces = distribute(full, src, MESH, gen)
        steps = plan_steps(src, dst, ndim=2)
        for step in steps:
            pieces = _apply(step, pieces)
        torch.testing.assert_close(assemble(pieces, dst, MESH), full, rtol=1e-5, atol=1e-5)
        if not any(isinstance(p, Partial) for p in dst):  # the pieces are exactly dst's pieces
            want = distribute(full, dst, MESH)
            for coord, piece in pieces.items():
                torch.testing.assert_close(piece, want[coord], rtol=1e-5, atol=1e-5)
        if src == dst:
            assert steps == []


def test_plan_steps_reduces_before_gathering_and_gathers_innermost_first():
    assert [str(s) for s in plan_steps((P, Shard(0)), (R, R), ndim=2)] == [
        "all_reduce(axis=0)", "all_gather(axis=1, dim=0)"]
    # dim 0 split over both axes (axis-0-major): to keep only axis 1's split, undo both, re-cut
    assert [str(s) for s in plan_steps((Shard(0), Shard(0)), (R, Shard(0)), ndim=2)] == [
        "all_gather(axis=1, dim=0)", "all_gather(axis=0, dim=0)", "chunk(axis=1, dim=0)"]


def test_plan_steps_uses_one_collective_per_simple_change():
    assert plan_steps((P,), (Shard(1),), ndim=2) == [Step("reduce_scatter", 0, 1)]
    assert plan_steps((Shard(0),), (Shard(1),), ndim=2) == [Step("all_to_all", 0, 0, 1)]
    assert plan_steps((R,), (P,), ndim=2) == [Step("to_partial", 0)]
    assert plan_steps((R,), (Shard(1),), ndim=2) == [Step("chunk", 0, 1)]


def test_reshard_bytes_prices_ring_collectives_and_free_cuts():
    # 8x8 fp32 = 256 bytes; mesh axis of 4
    kw = dict(shape=(8, 8), itemsize=4, mesh_shape=(4,))
    assert reshard_bytes((P,), (R,), **kw) == pytest.approx(2 * 3 / 4 * 256)
    assert reshard_bytes((Shard(0),), (R,), **kw) == pytest.approx(3 * 64)
    assert reshard_bytes((P,), (Shard(0),), **kw) == pytest.approx(3 / 4 * 256)
    assert reshard_bytes((R,), (Shard(0),), **kw) == 0
    assert reshard_bytes((R,), (P,), **kw) == 0


def test_plan_steps_rejects_a_dim_the_tensor_lacks():
    with pytest.raises(ShardingError, match="dim 2"):
        plan_steps((Shard(2),), (R,), ndim=2)
    with pytest.raises(ShardingError, match="different rank"):
        plan_steps((R,), (R, R), ndim=2)
