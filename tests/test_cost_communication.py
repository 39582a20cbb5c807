"""Communication cost: nccl-tests' algbw/busbw definitions, hand-computed times, parameter server
versus ring, and the collectives each resharding takes (forward and backward by duality)."""

import pytest
import torch

from autopar import Cluster
from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.errors import ClusterError, ShardingError
from autopar.core.ir import TensorMeta
from autopar.core.placement import parse_sharding
from autopar.cost_models.communication import (
    Collective,
    Link,
    bus_bandwidth,
    bus_factor,
    flat_time,
    parameter_server_time,
    resharding_cost,
    resharding_steps,
)

# nccl-tests doc/PERFORMANCE.md: busbw = algbw * factor
NCCL_TESTS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_busbw_equals_link_bandwidth_without_latency(kind, n):
    link = Link(bandwidth=123e9, latency=0.0)
    size = 1 << 30
    seconds = flat_time(kind, size, n, link)
    assert bus_factor(kind, n) == pytest.approx(NCCL_TESTS_FACTOR[kind](n))
    assert bus_bandwidth(kind, size, seconds, n) == pytest.approx(123e9)


def test_hand_computed_times():
    link = Link(bandwidth=100e9, latency=5e-6)
    # all-reduce, 8 ranks, 1 GB: 2*7/8 * 1e9/100e9 = 17.5 ms, plus 14 steps of 5 us
    assert flat_time("all_reduce", 1e9, 8, link) == pytest.approx(0.0175 + 70e-6)
    # all-gather to 800 MB on 4 ranks: 3/4 * 8 ms + 3 * 5 us
    assert flat_time("all_gather", 800e6, 4, link) == pytest.approx(0.006 + 15e-6)
    assert flat_time("reduce_scatter", 800e6, 4, link) == pytest.approx(0.006 + 15e-6)
    assert flat_time("all_to_all", 800e6, 4, link) == pytest.approx(0.006 + 15e-6)
    # pipelined broadcast of 100 MB to 4 ranks: 1 ms + 3 steps; one message: 1 ms + 5 us
    assert flat_time("broadcast", 100e6, 4, link) == pytest.approx(0.001 + 15e-6)
    assert flat_time("send_recv", 100e6, 2, link) == pytest.approx(0.001 + 5e-6)
    assert flat_time("all_reduce", 1e9, 1, link) == 0.0


def test_parameter_server_loses_to_ring_as_workers_grow():
    link, size = Link(10e9, 0.0), 1e9
    ring = [flat_time("all_reduce", size, n, link) for n in (4, 16, 64)]
    ps = [parameter_server_time(size, workers=n, servers=4, link=link) for n in (4, 16, 64)]
    assert ps[0] == pytest.approx(2 * size / 10e9)            # servers keep up: 2 S / B
    assert ps[2] == pytest.approx(2 * size / 10e9 * 16)       # 64 workers on 4 servers: 16x
    assert max(ring) < 2 * size / 10e9                        # ring never exceeds 2 S / B
    assert ps[2] / ring[2] > 15
    with pytest.raises(ClusterError):
        parameter_server_time(size, workers=0, servers=1, link=link)


MESH = (2, 4)
META = TensorMeta((8, 16), torch.float32)   # 512 bytes


def _steps(src, dst):
    return [(c.kind, c.axis, c.nbytes, c.phase)
            for c in resharding_steps(512.0, parse_sharding(src), parse_sharding(dst), MESH)]


@pytest.mark.parametrize("src, dst, expected", [
    ("R,R", "R,R", []),
    ("S(0),R", "R,R", [("all_gather", 0, 512, "fwd"), ("reduce_scatter", 0, 512, "bwd")]),
    ("P(sum),R", "R,R", [("all_reduce", 0, 512, "fwd")]),
    ("P(sum),R", "S(0),R", [("reduce_scatter", 0, 512, "fwd"), ("all_gather", 0, 512, "bwd")]),
    ("R,R", "R,S(1)", [("all_gather", 1, 512, "bwd")]),
    ("S(0),R", "S(1),R", [("all_to_all", 0, 256, "fwd"), ("all_to_all", 0, 256, "bwd")]),
    ("R,P(sum)", "R,R", [("all_reduce", 1, 512, "fwd")]),
    ("R,R", "P(sum),R", []),
    # slice axis 0 first (its dual gathers back to 128 bytes), then gather axis 1 to the
    # axis-0 shard (256 bytes)
    ("R,S(0)", "S(0),R", [("all_gather", 1, 256, "fwd"), ("reduce_scatter", 1, 256, "bwd"),
                          ("all_gather", 0, 128, "bwd")]),
    # reduce-scatter the partial axis on the already-sharded tensor: 512 / 4 = 128 bytes
    ("P(sum),S(1)", "S(0),S(1)", [("reduce_scatter", 0, 128, "fwd"), ("all_gather", 0, 128, "bwd")]),
])
def test_resharding_steps(src, dst, expected):
    assert _steps(src, dst) == expected


def test_resharding_cost_sums_collective_times():
    cluster = Cluster.preset("dgx-a100", nodes=2).with_mesh((4, 4))
    meta = TensorMeta((4096, 4096), torch.bfloat16)
    src, dst = parse_sharding("P(sum),S(1)"), parse_sharding("S(0),R")
    fwd, bwd, steps = resharding_cost(meta, src, dst, cluster)
    assert [c.phase for c in steps] == ["fwd", "fwd", "bwd", "bwd"]
    assert fwd == pytest.approx(sum(cluster.collective_time(c.kind, c.nbytes, c.axis)
                                    for c in steps if c.phase == "fwd"))
    assert bwd == pytest.approx(sum(cluster.collective_time(c.kind, c.nbytes, c.axis)
                                    for c in steps if c.phase == "bwd"))
    assert fwd > 0 and bwd > 0
    assert resharding_cost(meta, src, src, cluster) == (0.0, 0.0, [])


def test_resharding_rejects_wrong_mesh_rank():
    with pytest.raises(ShardingError, match="one placement per mesh axis"):
        resharding_steps(8.0, parse_sharding("R"), parse_sharding("R,R"), MESH)
    with pytest.raises(ClusterError, match="unknown collective"):
        Collective("gather", 0, 1.0, "fwd")
    with pytest.raises(ShardingError, match="phase"):
        Collective("all_gather", 0, 1.0, "forward")
