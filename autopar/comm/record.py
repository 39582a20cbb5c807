"""The hook point where autopar's communication layer reports the collectives it issues.

Every call into ``torch.distributed`` that moves data (:mod:`autopar.comm.plain`, the gradient
buckets and output sums of :mod:`autopar.comm.buckets`) runs inside :func:`issuing`, which tells
the installed listener (:func:`listening`; none by default) what is issued and what it returned::

    with listening(listener):     # listener.begin(kind, group, nbytes), then listener.end(output)
        program(*args)

``nbytes`` follows nccl-tests' size convention, as the plan's collective records do
(:mod:`autopar.core.collective_kinds`): the larger of a rank's input and output buffers. Sums
that ride in a gradient bucket are reported one by one as they join it (:func:`carried`, the
all-reduces the plan prices); the bucket's own launch is then kind ``"bucket"``: traffic that
carries sums already reported.
"""

from __future__ import annotations

import contextlib

_LISTENER = None


@contextlib.contextmanager
def listening(listener):
    """Report the collectives issued inside the block to ``listener``: ``listener.begin(kind,
    group, nbytes)`` before each, ``listener.end(output)`` after it (the tensor the collective
    made for its caller, or None)."""
    global _LISTENER
    previous, _LISTENER = _LISTENER, listener
    try:
        yield listener
    finally:
        _LISTENER = previous


def _ignore(output) -> None:
    return None


@contextlib.contextmanager
def issuing(kind: str, group, nbytes: float):
    """One collective of ``kind`` on process group ``group`` moving ``nbytes`` per rank; the
    block passes the tensor it hands back to the function it is given."""
    listener = _LISTENER
    if listener is None:
        yield _ignore
        return
    made: list = []
    listener.begin(kind, group, float(nbytes))
    try:
        yield made.append
    finally:
        listener.end(made[0] if made else None)


def carried(kind: str, group, nbytes: float) -> None:
    """Report a collective whose data rides in a bucket issued later (nothing moves now)."""
    listener = _LISTENER
    if listener is not None:
        listener.begin(kind, group, float(nbytes))
        listener.end(None)


def nbytes_of(x) -> int:
    """Bytes of tensor ``x``'s elements."""
    return x.numel() * x.element_size()


__all__ = ["carried", "issuing", "listening", "nbytes_of"]
