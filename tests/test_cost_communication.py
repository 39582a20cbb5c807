"""Communication cost: nccl-tests' algbw/busbw definitions, hand-computed times, parameter server
versus ring. Which collectives a resharding takes is tested with the planner, in
test_codegen_reshard.py and test_reshard_priced_vs_emitted.py."""

import pytest

from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.errors import ClusterError
from autopar.cost_models.communication import Link, bus_bandwidth, bus_factor, flat_time, parameter_server_time

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


def test_an_unknown_collective_is_rejected():
    with pytest.raises(ClusterError, match="unknown collective"):
        flat_time("gather", 1.0, 2, Link(1e9, 0.0))
