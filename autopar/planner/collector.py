"""Planning without the garbage collector's full collections.

A search builds tens of thousands of long-lived objects (cost-graph nodes, strategies, plans),
and CPython runs a full (oldest-generation) collection each time their number grows by a
quarter: each walks every object alive, the captured graph's included. On Llama 2 70B's search
for 2x8 A100 these took 19 of its 75 s. The young generations still collect as usual (cycles made
and dropped within a try are freed); what reaches the oldest waits for the first full
collection after planning.
"""

from __future__ import annotations

import contextlib
import functools
import gc

NEVER = 2**30  # a threshold the count of young collections never reaches


@contextlib.contextmanager
def young_collections_only():
    """Within the block, no automatic full collection (the thresholds are restored after it)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def without_full_collections(fn):
    """``fn`` run under :func:`young_collections_only`."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with young_collections_only():
            return fn(*args, **kwargs)
    return run
