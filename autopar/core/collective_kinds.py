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


# bytes a collective allocates besides its input and output, per byte of its ``nbytes``, as
# :mod:`autopar.comm.plain` runs it: an all-to-all stacks its input's pieces into a send buffer and
# receives into another before concatenating them into its output. An all-reduce works in its
# output, an all-gather or reduce-scatter along dim 0 in its input and output (along another dim
# it copies both to move the dim first: not counted).
BUFFERS = {"all_to_all": 2.0}


class Collective(NamedTuple):
    """One collective of a training step: ``kind`` over mesh ``axis`` on ``nbytes`` per rank, in
    the ``"forward"`` or ``"backward"`` phase."""

    phase: str
    kind: str
    axis: int
    nbytes: float


__all__ = ["BUFFERS", "COLLECTIVE_KINDS", "Collective", "check_kind"]
