"""A meta model's parameters and buffers from its own initialisers, one tensor at a time.

One process starts a model built on ``device="meta"`` with ``model.to_empty(device=...)`` and
the model's initialisers (:func:`run_initialisers`). A rank must get the same values without a
whole copy of the model, so :func:`initialise` runs those initialisers on a copy of the model
whose tensors stay on meta, under a dispatch mode: the first op that touches a tensor (or a
view of it) gives it real storage on the rank's device, every op on it runs there, and after
the op that touches it for the last time ``keep(fqn, whole)`` takes what the rank stores (its
piece) and the storage is dropped::

    initialise(meta_model, lambda fqn, whole: pieces.update({fqn: cut(fqn, whole)}), device=cpu)

The RNG draws happen in one process's order, whole tensor by whole tensor, so every rank (and
one process seeded alike) draws the same numbers. How often each tensor is touched is counted
in a first run on meta (RNG untouched), so a tensor that a parent module initialises again
(GPT-2's scaled ``c_proj``) stays real until then; at most the tensors between their first and
last touch are whole at once, in practice one.
"""

from __future__ import annotations

import collections
import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autopar.core.errors import AutoparError

_META = torch.device("meta")


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (initialised by its ``init_weights``)."""
    return callable(getattr(module, "init_weights", None)) and callable(getattr(module, "_init_weights", None))


def run_initialisers(model: nn.Module) -> None:
    """The model's own initialisers, in one process's order: a transformers model's
    ``initialize_weights()`` (``init_weights()`` less its final re-tying, which
    :func:`initialise` does by value), else ``reset_parameters()`` of every module that has one,
    in ``modules()`` order."""
    done: set = set()
    for module in model.modules():
        if id(module) in done:
            continue
        if is_hf_model(module):
            module.initialize_weights()
            done.update(id(m) for m in module.modules())
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def _names_of_values(model: nn.Module) -> dict[str, list[str]]:
    """Which names each slot's initialised value goes to: a parameter tied under several names
    (``to_empty`` unties it and gives each name its own value) takes the value of the name a
    transformers model ties the others to, else of its first name."""
    groups = collections.defaultdict(list)
    for fqn, t in _slots(model).items():
        groups[id(t)].append(fqn)
    sources = set()
    for prefix, module in model.named_modules():
        if is_hf_model(module):
            tied = getattr(module, "all_tied_weights_keys", {}).values()
            sources.update(f"{prefix}.{s}" if prefix else s for s in tied)
    out = {}
    for names in groups.values():
        out[next((n for n in names if n in sources), names[0])] = names
    return out


def _untied_copy(model: nn.Module, skip) -> nn.Module:
    """A copy of a meta model with a tensor of its own in every parameter and buffer slot, as
    ``to_empty`` leaves a model (it unties shared parameters; HF's ``init_weights`` ties them
    again at its end), and ``skip`` marked for transformers' initialisers to leave alone."""
    work = copy.deepcopy(model)
    for module in work.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device=_META), p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=_META)
    for fqn, t in _slots(work).items():
        if fqn in skip:
            t._is_hf_initialized = True  # read by transformers.initialization
    return work


def _slots(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers(remove_duplicate=False)),
            **dict(model.named_parameters(remove_duplicate=False))}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Touches(TorchDispatchMode):
    """Counts the ops that touch each slot's storage; with ``device`` set, also gives a slot real
    storage when it is first touched and hands it to ``keep`` after its ``last[fqn]``-th touch."""

    def __init__(self, slots: dict[str, torch.Tensor], *, device=None, last=None, keep=None, names=None):
        super().__init__()
        self.slots, self.names_of = slots, names
        self.names = {_key(t): fqn for fqn, t in slots.items() if t.is_meta}
        self.device, self.last, self.keep = device, last, keep
        self.count: collections.Counter = collections.Counter()
        self.flat: dict[str, torch.Tensor] = {}  # fqn -> real storage (1-D) while it is touched
        self.real: dict[int, str] = {}  # that storage's key -> fqn
        self.done: set[str] = set()

    def _visit(self, t, touched: set):
        if not isinstance(t, torch.Tensor):
            return t
        key = _key(t)
        fqn = self.names.get(key) if t.is_meta else self.real.get(key)
        if fqn is None:
            return t
        touched.add(fqn)
        if self.device is None or not t.is_meta:
            return t
        if fqn in self.done:
            raise AutoparError(f"the initialisers touched {fqn} again after its last touch on meta: they"
                               " behave differently on meta and real tensors; start from a checkpoint")
        if fqn not in self.flat:
            flat = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=self.device)
            self.flat[fqn], self.real[_key(flat)] = flat, fqn
        return self.flat[fqn].as_strided(t.shape, t.stride(), t.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        touched: set = set()
        args, kwargs = tree_map(lambda t: self._visit(t, touched), (args, kwargs or {}))
        if self.device is not None and kwargs.get("device") == _META:  # a factory op given param.device
            kwargs["device"] = self.device
        out = func(*args, **kwargs)
        for fqn in touched:
            self.count[fqn] += 1
            if self.device is not None and self.count[fqn] == self.last.get(fqn):
                self.finish(fqn)
        return out

    def finish(self, fqn: str) -> None:
        """Hand slot ``fqn``'s whole value to ``keep`` and drop its storage."""
        flat = self.flat.pop(fqn)
        del self.real[_key(flat)]
        self.done.add(fqn)
        t = self.slots[fqn]
        for name in self.names_of.get(fqn, ()):
            self.keep(name, flat.as_strided(t.shape, t.stride(), t.storage_offset()))


def initialise(model: nn.Module, keep, *, device, skip=frozenset()) -> set[str]:
    """Run ``model``'s initialisers (:func:`run_initialisers`) on a meta copy of it, calling
    ``keep(fqn, whole)`` once per parameter and buffer name with its initialised value on
    ``device`` (see the module docstring); returns the names no initialiser set. ``skip``: names
    that a transformers model's initialisers leave alone (loaded from elsewhere)."""
    names = _names_of_values(model)
    with torch.random.fork_rng(devices=[]):  # the counting run draws nothing from the caller's RNG
        work = _untied_copy(model, skip)
        with _Touches(_slots(work)) as counting:
            run_initialisers(work)
    work = _untied_copy(model, skip)
    slots = _slots(work)
    with _Touches(slots, device=device, last=dict(counting.count), keep=keep, names=names) as mode:
        run_initialisers(work)
    for fqn in list(mode.flat):
        mode.finish(fqn)
    unset = set()
    for fqn, t in _slots(work).items():
        if fqn in mode.done or fqn not in names:
            continue
        if t.is_meta:
            unset.update(names[fqn])
        else:  # an initialiser replaced the tensor outright
            for name in names[fqn]:
                keep(name, t.detach().to(device))
    return unset


__all__ = ["initialise", "is_hf_model", "run_initialisers"]
