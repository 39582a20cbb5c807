"""Sharded parameters (ZeRO-3/FSDP) are gathered again in backward instead of kept from forward.

An op that uses a gathered parameter saves it (or a view of it) for its backward, which would
keep every whole parameter alive from forward to backward. Inside :func:`keep_sharded`, each
gathered parameter is noted with a way to gather it again (:func:`note`); autograd then saves
a small handle in its place, and backward gathers the parameter once more when it first needs
it (views of it share that one copy). This is what the cost model assumes: sharded parameter
memory, and the forward all-gather paid twice.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_NOTED: dict | None = None  # storage key -> _Gathered, inside keep_sharded()


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by its views (fake tensors have no data address)."""
    return t.untyped_storage()._cdata


class _Gathered:
    def __init__(self, tensor: torch.Tensor, gather):
        # the forward's copy: its storage key is valid while the storage lives, which a view of it
        # (a dim-0 block a later chunk keeps) prolongs past the gathered tensor itself
        self.storage = weakref.ref(tensor.untyped_storage())
        self.gather = gather  # () -> the whole tensor again (a collective)
        self.again = None  # weak reference to backward's copy, shared by the saved views

    def whole(self) -> torch.Tensor:
        full = self.again() if self.again is not None else None
        if full is None:
            full = self.gather()
            self.again = weakref.ref(full)
        return full


def _entry(t: torch.Tensor):
    if not _NOTED or t.layout != torch.strided:
        return None
    entry = _NOTED.get(_key(t))
    return entry if entry is not None and entry.storage() is not None else None


def _parameter(t: torch.Tensor) -> bool:
    return t.is_leaf and (t.requires_grad or isinstance(t, torch.nn.Parameter))


def regather_source(x: torch.Tensor):
    """How to get ``x`` whole again in backward, when ``x`` is a parameter, trained or frozen, or
    a view of one (an identity whose backward sums the gradient returns one: itself, which holds
    no memory of its own), or a noted gathered tensor (gathered again); None otherwise or outside
    :func:`keep_sharded`."""
    if _NOTED is None:
        return None
    if _parameter(x) or (x._base is not None and _parameter(x._base)):
        shard = x.detach()
        return lambda: shard
    entry = _entry(x)
    return entry.whole if entry is not None else None


def note(tensor: torch.Tensor, gather) -> None:
    """Backward should call ``gather()`` instead of keeping ``tensor`` (inside :func:`keep_sharded`)."""
    if _NOTED is not None:
        _NOTED[_key(tensor)] = _Gathered(tensor, gather)


def _pack(t: torch.Tensor):
    entry = _entry(t)
    if entry is None:
        return t
    return entry, t.size(), t.stride(), t.storage_offset()


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    entry, size, stride, offset = packed
    return entry.whole().as_strided(size, stride, offset)


@contextlib.contextmanager
def keep_sharded():
    """Run a forward pass whose noted gathered parameters autograd does not keep."""
    global _NOTED
    previous, _NOTED = _NOTED, {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _NOTED = previous


__all__ = ["keep_sharded", "note", "regather_source"]
