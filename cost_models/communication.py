"""Communication cost: alpha-beta formulas for collectives, hierarchy across nodes, resharding.

One collective over ``n`` devices on a link of bandwidth ``B`` (bytes/s per device, one direction)
and per-step latency ``alpha`` costs ``steps(n) * alpha + factor(n) * S / B`` where ``factor`` is
nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md in NVIDIA/nccl-tests) and ``S`` is its
"size" -- the larger buffer::

    kind            S is                          factor       steps (ring)
    all_reduce      the buffer                    2(n-1)/n     2(n-1)
    all_gather      the gathered output           (n-1)/n      n-1
    reduce_scatter  the input (n x one output)    (n-1)/n      n-1
    all_to_all      one rank's send buffer        (n-1)/n      n-1
    broadcast       the buffer                    1            n-1 (pipelined chain)
    send_recv       the message                   1            1

So ``busbw = algbw * factor = B`` when latency is negligible, exactly as nccl-tests reports.
A group that spans ``k`` nodes with ``m`` members in each runs hierarchically (intra-node then
inter-node phases, :func:`hierarchical_time`). Which collectives a resharding runs is
:mod:`autopar.core.reshard`'s business; this module only times them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autopar.core.collective_kinds import check_kind
from autopar.core.errors import ClusterError

LEVELS = ("intra", "inter")


@dataclass(frozen=True)
class Link:
    """A link as one device sees it: ``bandwidth`` in bytes/s (one direction), ``latency`` in s."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise ClusterError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0):
            raise ClusterError(f"link latency must be >= 0 seconds, got {self.latency!r}")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' ``busbw / algbw`` for ``kind`` on ``n`` ranks."""
    check_kind(kind)
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def latency_steps(kind: str, n: int) -> int:
    """Number of sequential latency terms of the ring (or chain) algorithm."""
    check_kind(kind)
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "send_recv":
        return 1
    return n - 1


def flat_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for ``kind`` over ``n`` devices on one level of ``link`` (0 when ``n == 1``)."""
    check_kind(kind)
    if n < 1:
        raise ClusterError(f"a collective needs at least one device, got n={n}")
    if n == 1 or nbytes <= 0:
        return 0.0
    return latency_steps(kind, n) * link.latency + bus_factor(kind, n) * nbytes / link.bandwidth


def alg_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' algbw: size / time."""
    return nbytes / seconds


def bus_bandwidth(kind: str, nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests' busbw: algbw times :func:`bus_factor`."""
    return alg_bandwidth(nbytes, seconds) * bus_factor(kind, n)


FlatFn = Callable[[str, float, int, str], float]  # (kind, nbytes, n, level) -> seconds


def hierarchical_time(kind: str, nbytes: float, *, local: int, nodes: int, flat: FlatFn) -> float:
    """Seconds for ``kind`` over ``local`` devices in each of ``nodes`` nodes.

    ``flat(kind, nbytes, n, level)`` times one level. All-reduce is reduce-scatter inside the
    node, all-reduce of 1/local of the data across nodes, all-gather inside the node; all-gather
    and reduce-scatter run the two levels in sequence; all-to-all sends the off-node share of each
    buffer across nodes; broadcast is two chained broadcasts; send/recv is assumed to cross nodes.
    """
    check_kind(kind)
    if nodes == 1:
        return flat(kind, nbytes, local, "intra")
    if local == 1:
        return flat(kind, nbytes, nodes, "inter")
    m, k = local, nodes
    if kind == "all_reduce":
        return (flat("reduce_scatter", nbytes, m, "intra") + flat("all_reduce", nbytes / m, k, "inter")
                + flat("all_gather", nbytes, m, "intra"))
    if kind == "all_gather":
        return flat("all_gather", nbytes / m, k, "inter") + flat("all_gather", nbytes, m, "intra")
    if kind == "reduce_scatter":
        return flat("reduce_scatter", nbytes, m, "intra") + flat("reduce_scatter", nbytes / m, k, "inter")
    if kind == "all_to_all":
        return flat("all_to_all", nbytes / k, m, "intra") + flat("all_to_all", nbytes, k, "inter")
    if kind == "broadcast":
        return flat("broadcast", nbytes, k, "inter") + flat("broadcast", nbytes, m, "intra")
    return flat("send_recv", nbytes, 2, "inter")


def parameter_server_time(nbytes: float, *, workers: int, servers: int, link: Link) -> float:
    """Seconds for one synchronous parameter-server step: every worker pushes its ``nbytes``
    gradient (split over ``servers``) and pulls ``nbytes`` of parameters back.

    A worker moves ``nbytes`` each way; a server moves ``workers * nbytes / servers`` each way; the
    busier side bounds each phase: ``2 * nbytes / B * max(1, workers / servers) + 2 * latency``.
    Ring all-reduce stays below ``2 * nbytes / B`` however many workers there are; a parameter
    server with fixed ``servers`` grows linearly in ``workers``.
    """
    if workers < 1 or servers < 1:
        raise ClusterError(f"need >= 1 worker and server, got workers={workers} servers={servers}")
    return 2 * nbytes / link.bandwidth * max(1.0, workers / servers) + 2 * link.latency


@dataclass(frozen=True)
class CollectiveFit:
    """A measured ``seconds = alpha + beta * nbytes`` for ``kind`` over ``group_size`` devices of
    one ``level`` ("intra" or "inter" node), from the profiler."""

    kind: str
    group_size: int
    level: str
    alpha: float
    beta: float

    def __post_init__(self):
        check_kind(self.kind)
        if self.level not in LEVELS:
            raise ClusterError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.group_size < 2 or self.alpha < 0 or self.beta <= 0:
            raise ClusterError(f"bad collective fit {self}: need group_size >= 2, alpha >= 0, beta > 0")

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes if nbytes > 0 else 0.0


__all__ = [
    "CollectiveFit",
    "Link",
    "alg_bandwidth",
    "bus_bandwidth",
    "bus_factor",
    "flat_time",
    "hierarchical_time",
    "latency_steps",
    "parameter_server_time",
]
