"""The collectives autopar prices and runs, and one priced collective.

``nbytes`` is nccl-tests' "size" everywhere: the larger of a rank's input and output buffers
(the gathered output of an all-gather, the input of a reduce-scatter, one rank's send buffer of
an all-to-all, the buffer of an all-reduce); ``autopar.cost_models.communication`` times it.
"""

from __future__ import annotations

from typing import NamedTuple

from autopar.core.errors import ClusterError

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def check_kind(kind: str) -> str:
    """``kind`` if it is one of :data:`COLLECTIVE_KINDS`, else a :class:`ClusterError`."""
    if kind not in COLLECTIVE_KINDS:
        raise ClusterError(f"unknown collective {kind!r}; use one of {COLLECTIVE_KINDS}")
    return kind


class Collective(NamedTuple):
    """One collective of a training step: ``kind`` over mesh ``axis`` on ``nbytes`` per rank, in
    the ``"forward"`` or ``"backward"`` phase."""

    phase: str
    kind: str
    axis: int
    nbytes: float


__all__ = ["COLLECTIVE_KINDS", "Collective", "check_kind"]
