"""The resharding planner: every pair of shardings on a 2x2 mesh executed on simulated ranks in
one process; the backward convention and the price of a step list, hand-computed."""

from __future__ import annotations

import itertools

import pytest
import torch

from autopar.comm import collectives as C
from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import ShardingError
from autopar.core.ir import Strategy
from autopar.core.placement import Partial, Replicate, Shard, format_sharding, parse_sharding
from autopar.core.reshard import Step, plan_steps, price, walk_back
from autopar.passes.codegen import CodegenContext, generate
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


def test_plan_steps_leaves_out_mesh_axes_of_size_one():
    assert plan_steps((Shard(0), Shard(0)), (R, R), ndim=2) == [Step("all_gather", 1, 0), Step("all_gather", 0, 0)]
    assert plan_steps((Shard(0), Shard(0)), (R, R), ndim=2, mesh_shape=(1, 2)) == [Step("all_gather", 1, 0)]


def test_walk_back_picks_adjoints_by_the_gradient_arriving():
    steps = plan_steps((Shard(0), Shard(0)), (R, Shard(0)), ndim=2)  # gather 1, gather 0, chunk 1
    # the chunk must hand the gather before it a whole gradient: its backward all-gathers
    assert walk_back(steps, 1, "S") == ({2: "all_gather", 0: "slice"}, "S", None)
    assert walk_back(steps, 0, "P") == ({1: "reduce_scatter"}, "S", None)
    assert walk_back(steps, 0, "R") == ({1: "slice"}, "S", None)
    assert walk_back([Step("all_reduce", 0)], 0, "P") == ({0: "all_reduce"}, "R", None)
    assert walk_back([Step("chunk", 0, 1)], 0, "S") == ({}, "F", 0)  # the source picks
    with pytest.raises(ShardingError, match="cannot take a gradient"):
        walk_back([Step("chunk", 0, 1)], 0, "P")


# mesh (2, 4), an 8 x 16 float32 tensor: 512 bytes; bytes are nccl-tests' size (the larger buffer)
@pytest.mark.parametrize("src, dst, kinds, regather, expected", [
    ("R,R", "R,R", "RR", False, []),
    # data parallelism: the split consumer's pending sums are all-reduced at the source
    ("R,R", "R,R", "PP", False, [("backward", "all_reduce", 1, 512), ("backward", "all_reduce", 0, 512)]),
    ("S(0),R", "R,R", "RR", False, [("forward", "all_gather", 0, 512)]),
    # a split consumer: the gather's backward reduce-scatters, axis 1's pending sum is all-reduced
    # at the source (a 256-byte shard)
    ("S(0),R", "R,R", "PP", False, [("forward", "all_gather", 0, 512), ("backward", "reduce_scatter", 0, 512),
                                    ("backward", "all_reduce", 1, 256)]),
    ("P(sum),R", "R,R", "RR", False, [("forward", "all_reduce", 0, 512)]),
    ("P(sum),R", "R,R", "PP", False, [("forward", "all_reduce", 0, 512), ("backward", "all_reduce", 0, 512),
                                      ("backward", "all_reduce", 1, 512)]),
    ("P(sum),R", "S(0),R", "SR", False, [("forward", "reduce_scatter", 0, 512), ("backward", "all_gather", 0, 512)]),
    ("R,R", "R,S(1)", "RS", False, [("backward", "all_gather", 1, 512)]),
    ("S(0),R", "S(1),R", "SR", False, [("forward", "all_to_all", 0, 256), ("backward", "all_to_all", 0, 256)]),
    ("R,R", "P(sum),R", "RR", False, []),
    # gather axis 1 whole, then cut axis 0: the cut's backward gathers the whole gradient back
    ("R,S(0)", "S(0),R", "SR", False, [("forward", "all_gather", 1, 512), ("backward", "all_gather", 0, 512)]),
    ("P(sum),S(1)", "S(0),S(1)", "SS", False, [("forward", "reduce_scatter", 0, 128),
                                               ("backward", "all_gather", 0, 128)]),
    # a sharded parameter read whole: both gathers again in backward
    ("S(0),S(1)", "R,R", "RR", True, [("forward", "all_gather", 1, 256), ("forward", "all_gather", 0, 512),
                                      ("backward", "all_gather", 1, 256), ("backward", "all_gather", 0, 512)]),
    # ... also under data parallelism on the other axis (HSDP) ...
    ("S(0),R", "R,R", "PP", True, [("forward", "all_gather", 0, 512), ("backward", "all_gather", 0, 512),
                                   ("backward", "reduce_scatter", 0, 512), ("backward", "all_reduce", 1, 256)]),
    # ... but not when a cut follows (autograd saves the cut, not the gathered parameter)
    ("S(0),R", "R,S(1)", "RS", True, [("forward", "all_gather", 0, 512), ("backward", "all_gather", 1, 512)]),
])
def test_price_lists_each_collective_with_its_bytes(src, dst, kinds, regather, expected):
    got = price(parse_sharding(src), parse_sharding(dst), shape=(8, 16), itemsize=4, mesh_shape=(2, 4),
                kinds=tuple(kinds), regather=regather)
    assert [tuple(c) for c in got] == expected


def test_price_without_a_gradient_is_the_forward_alone():
    got = price((Shard(0), R), (R, R), shape=(8, 16), itemsize=4, mesh_shape=(2, 4))
    assert [tuple(c) for c in got] == [("forward", "all_gather", 0, 512)]


def test_plan_steps_rejects_a_dim_the_tensor_lacks():
    with pytest.raises(ShardingError, match="dim 2"):
        plan_steps((Shard(2),), (R,), ndim=2)
    with pytest.raises(ShardingError, match="different rank"):
        plan_steps((R,), (R, R), ndim=2)


def test_edges_with_and_without_gradients_share_a_collective_without_a_backward_choice():
    """neg's pending sum feeds sin (on the loss path) and cos (not): both need S(0), and one
    reduce-scatter serves both (its backward has no choice to differ by)."""
    graph = torch.fx.Graph()
    val = torch.empty(8, 8, device="meta")
    w = graph.placeholder("w")
    neg = graph.call_function(torch.ops.aten.neg.default, (w,))
    sin = graph.call_function(torch.ops.aten.sin.default, (neg,))
    cos = graph.call_function(torch.ops.aten.cos.default, (neg,))
    for node in (w, neg, sin, cos):
        node.meta["val"] = val
    graph.output((sin, cos))
    split = Strategy(((Shard(0),),), ((Shard(0),),))
    assignment = ShardingAssignment(mesh_shape=(2,), node_strategies={neg.name: Strategy(((R,),), ((P,),)),
                                                                       sin.name: split, cos.name: split},
                                    placeholder_shardings={"w": (R,)}, output_shardings=((R,), (R,)))
    program = generate(torch.fx.GraphModule(torch.nn.Module(), graph),
                       CodegenContext(assignment=assignment, rank=0, trainable={"w"}, loss_outputs=(0,)))
    assert [n.target for n in program.graph.nodes].count(C.autopar_reduce_scatter) == 1
