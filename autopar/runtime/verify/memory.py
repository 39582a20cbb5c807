"""Peak memory of one training step by kind, measured from the tensors it allocates.

:class:`MemoryTracker` is a dispatch mode that sees every op's outputs (real or fake tensors)
and follows each storage from its allocation to its release (a weak reference), so the bytes
live at every moment and the moment of the peak are exact. Each storage is tagged when it is
made (the step's phase, or ``"communication"`` inside a collective: see
:mod:`autopar.comm.record`); the storages live at the peak are then sorted into kinds:

- ``parameters``: the module's parameters and buffers;
- ``gradients``: storages the parameters' ``.grad`` point into when the step is over;
- ``optimizer``: the optimizer's state when the step is over;
- ``activations``: the step's inputs, and forward allocations still alive when the forward pass
  ended (what autograd saved for backward);
- ``communication``: buffers a collective made for itself (not the tensor it returned);
- ``temporaries``: everything else (forward intermediates not saved, activation gradients,
  the optimizer's scratch).

Storages of tensors on ``host`` (an offloaded optimizer's masters, state, gradients and scratch)
are kept apart: their own total and peak, in none of the device's kinds.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication")


def _storages(t: torch.Tensor):
    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
        yield t.untyped_storage()


class MemoryTracker(TorchDispatchMode):
    """Bytes of every live storage made under it (see the module docstring). Set ``phase``
    (``"forward"``, ``"backward"``, ``"optimizer"``) as the step goes; it is also a listener for
    :func:`autopar.comm.record.listening`."""

    def __init__(self, host: torch.device | None = None):
        super().__init__()
        self.host = host
        self.host_total = self.host_peak = 0
        self.phase = "forward"
        self._live: dict[int, tuple[int, int, str]] = {}  # storage key -> (serial, bytes, tag)
        self._refs: dict[int, weakref.ref] = {}
        self._serial = itertools.count()
        self._comm = 0  # depth of collectives in progress
        self.total = 0
        self.peak = 0
        self._at_peak: tuple = ()
        self._saved: set[int] = set()
        self._gradients: set[int] = set()  # storages marked as gradients before the step moved them

    # --- storages ----------------------------------------------------------------------------
    def track(self, t: torch.Tensor, tag: str | None = None) -> None:
        """Follow ``t``'s storage from now on (``tag``: what it is; default: from the phase)."""
        if self.host is not None and isinstance(t, torch.Tensor) and t.device == self.host:
            self._track_host(t)
            return
        for st in _storages(t):
            key = st._cdata
            if key in self._live:
                continue
            nbytes = st.nbytes()
            serial = next(self._serial)
            self._live[key] = (serial, nbytes, tag or ("communication" if self._comm else self.phase))
            self._refs[key] = weakref.ref(st, lambda _, key=key, serial=serial: self._release(key, serial))
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self._at_peak = tuple(self._live.values())

    def _track_host(self, t: torch.Tensor) -> None:
        for st in _storages(t):
            key = ("host", st._cdata)
            if key in self._refs:
                continue
            nbytes = st.nbytes()
            self.host_total += nbytes
            self.host_peak = max(self.host_peak, self.host_total)
            self._refs[key] = weakref.ref(st, lambda _, key=key, nbytes=nbytes: self._release_host(key, nbytes))

    def _release_host(self, key, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.host_total -= nbytes

    def _release(self, key: int, serial: int) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] == serial:
            del self._live[key]
            self._refs.pop(key, None)
            self.total -= entry[1]

    def _serials(self, tensors) -> set[int]:
        out = set()
        for t in tensors:
            for st in _storages(t):
                entry = self._live.get(st._cdata)
                if entry is not None:
                    out.add(entry[0])
        return out

    def end_forward(self) -> None:
        """A forward pass is over: what it allocated and is still alive is saved for backward."""
        self._saved |= {serial for serial, _, tag in self._live.values() if tag == "forward"}
        self.phase = "backward"

    def mark_gradients(self, tensors) -> None:
        """``tensors`` are gradients (the program's, before an offloaded step moves them to the
        host and drops them); no reference to them is kept."""
        self._gradients |= self._serials(tensors)

    def peak_by_kind(self, *, parameters, gradients, optimizer_state) -> dict[str, int]:
        """Bytes of each kind live at the peak (``parameters``, ``gradients``,
        ``optimizer_state``: the tensors of those kinds at the end of the step, with the
        gradients :meth:`mark_gradients` saw)."""
        roles = dict.fromkeys(self._gradients, "gradients")
        for kind, tensors in (("optimizer", optimizer_state), ("gradients", gradients),
                              ("parameters", parameters)):
            roles.update(dict.fromkeys(self._serials(tensors), kind))
        out = dict.fromkeys(KINDS, 0)
        for serial, nbytes, tag in self._at_peak:
            kind = roles.get(serial)
            if kind is None:
                if tag == "input" or (tag == "forward" and serial in self._saved):
                    kind = "activations"
                elif tag == "communication":
                    kind = "communication"
                else:
                    kind = "temporaries"
            out[kind] += nbytes
        return out

    # --- the dispatch mode -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    # --- the collectives' listener (autopar.comm.record) ---------------------------------------
    def begin(self, kind, group, nbytes) -> None:
        self._comm += 1

    def end(self, output) -> None:
        self._comm -= 1
        if output is not None:  # what the collective returns is the program's, not its buffer
            for st in _storages(output):
                entry = self._live.get(st._cdata)
                if entry is not None and entry[2] == "communication":
                    self._live[st._cdata] = (entry[0], entry[1], "communication" if self._comm else self.phase)
                    self._at_peak = tuple((s, b, self.phase if s == entry[0] else t) for s, b, t in self._at_peak)


__all__ = ["KINDS", "MemoryTracker"]
