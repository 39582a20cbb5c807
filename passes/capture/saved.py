"""What each node's backward keeps and makes, as autograd says: ``meta["autopar_saved"]``,
``meta["autopar_saved_inputs"]``, ``meta["autopar_backward"]``, ``meta["autopar_grad_out"]``
(whether a gradient reaches its output: not through ``type_as``'s or a ``*_like`` factory's
model-dependent argument, which a rule over the graph's edges cannot tell) and
``meta["autopar_grad_in"]`` (the indices of its tensor inputs its backward hands a gradient:
not ``type_as``'s second, whose dtype only it reads; None where its backward did not run alone).

:func:`saved_tensors_pass` runs the captured forward once on fresh fake tensors (parameters
requiring gradients, frozen ones not) under :func:`torch.autograd.graph.saved_tensors_hooks`, node by node, and
matches every tensor a node's backward saves to the node's own inputs and outputs by storage
(views included). Each node gets a tuple of :class:`~autopar.core.ir.TensorPart`, measured
against one of its tensors so that the cost model can price it at any sharding:

- a saved input or output (or a view of one) is counted against that tensor, with all of its
  storage (q, k and v split from one projection keep the whole projection);
- a tensor the op made for itself (a layer norm's statistics, a loss's log-probabilities) is
  counted against the input or output of its shape (else of its size, else the largest);
- parameters, buffers and the user's inputs (and views of them) are model state or inputs that
  live anyway: not counted;
- a storage ``k`` nodes keep is shared: each counts ``1/k`` of it (a layer norm's output that
  the q, k and v projections all save is counted once).

``autopar_saved_inputs`` holds the indices of the node's tensor inputs (in argument order) whose
storage its backward keeps, model state included: a sharded parameter is gathered again in
backward only for a consumer that keeps it (a linear's bias or an embedding's table is not kept).

Each node is also run again on detached inputs and its backward alone (``torch.autograd.grad``
from its outputs to those inputs); the most bytes that backward holds at once (the gradients of
its outputs and inputs and its scratch, e.g. a cross entropy's gradient of its log-probabilities)
are recorded as ``autopar_backward``: each gradient measured against its own input or output
(under FSDP a batched matmul's weight gradient is as large as the gathered weight while its input
gradient is split over the batch), the scratch against the largest tensor.

Each saved storage is numbered (``TensorPart.storage``) so that planning can tell one copy from
two: the ops keeping one storage at one sharding keep one copy, a consumer that keeps it at
another sharding keeps a second (:mod:`autopar.planner.peak`).

The graph runs on (fake) CPU tensors whatever device the model was captured on, as ``verify``
runs programs (on the meta device attention would take another kernel, which saves more), and
runs its views as reshapes, as programs do: which attention kernel runs depends on which inputs
need gradients, and a learned attention bias (T5's) makes it hand a layout the captured view
does not take, which the reshape copies. Should the graph still not run on the CPU, it runs on
its captured devices.

Nothing is allocated (fake tensors); the cost is one forward of the captured (stamped) graph and
one backward per distinct call: calls alike in op, non-tensor arguments, tensors' shapes, strides,
dtypes and ``requires_grad`` and which of them share a storage (every repeated layer, most ops of
every step of an unrolled loop) share one measured backward (:func:`_call_key`).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import Counter
from functools import partial

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from autopar.core.ir import IGNORED_OPS, PROGRAM_TARGETS, TensorPart
from autopar.passes.capture.trace import quiet_torch_logs

MODEL_STATE = ("parameter", "buffer", "user_input", "constant")
CPU, META = torch.device("cpu"), torch.device("meta")
log = logging.getLogger(__name__)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class _Recorder(torch.fx.Interpreter):
    """Runs the graph and keeps, per node, the tensors its backward saved and its own tensors."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device | None):
        super().__init__(gm)
        self.device = device
        self.packed: list[torch.Tensor] = []
        self.calls: list[tuple] = []  # (node, saved, inputs, outputs, backward)
        self.backward: dict[tuple, tuple] = {}  # call key -> its backward part and inputs given a gradient

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.packed = saved = []
        result = super().run_node(n)
        self.packed = []  # what the call run again for its backward saves is not the graph's
        key = _call_key(n.target, args, kwargs)
        found = self.backward.get(key) if key is not None else None
        if found is None:
            found = _backward_part(partial(self.call_function, n.target), args, kwargs)
            if key is not None:
                self.backward[key] = found
        backward, n.meta["autopar_grad_in"] = found
        self.calls.append((n, saved, _tensors((args, kwargs)), _tensors(result), backward))
        n.meta["autopar_grad_out"] = any(t.requires_grad for t in _tensors(result))
        return result

    def call_function(self, target, args, kwargs):
        if target in IGNORED_OPS:  # asserts (of the captured device, among others)
            return None
        if self.device is not None and kwargs.get("device") == META:  # captured on the meta device
            kwargs = {**kwargs, "device": self.device}
        return super().call_function(PROGRAM_TARGETS.get(target, target), args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed.append(t)
        return t


class _Peak(TorchDispatchMode):
    """The most bytes of storages made under it (not views of an op's inputs) alive at once, and
    those storages (``at_peak``: storage key -> bytes)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.total = self.peak = 0
        self.at_peak: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            key = st._cdata
            if key not in seen and key not in self._refs:
                self._refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
                self.live[key] = st.nbytes()
                self.total += self.live[key]
                if self.total > self.peak:
                    self.peak, self.at_peak = self.total, dict(self.live)
        return out

    def _free(self, key: int) -> None:
        self._refs.pop(key, None)
        self.total -= self.live.pop(key, 0)


def _call_key(target, args, kwargs) -> tuple | None:
    """What a call's backward part depends on: the op, its non-tensor arguments, its tensors'
    shapes, strides, dtypes, devices and ``requires_grad`` and which of them share a storage (not
    where a view starts in it: ``x[:, t]`` of every step is alike), or None for an argument that
    cannot be hashed."""
    storages: dict[int, int] = {}

    def frozen(x):
        if isinstance(x, torch.Tensor):
            return (torch.Tensor, tuple(x.shape), x.stride(), x.dtype, x.device,
                    x.requires_grad, storages.setdefault(_key(x), len(storages)))
        if isinstance(x, (list, tuple)):
            return (type(x), *map(frozen, x))
        if isinstance(x, dict):
            return (dict, *((k, frozen(v)) for k, v in x.items()))
        return x

    key = (target, frozen(args), frozen(kwargs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _backward_part(call, args, kwargs) -> tuple[tuple[TensorPart, ...], frozenset | None]:
    """What one call's backward holds at its peak (module docstring), and the indices of the
    tensor inputs it hands a gradient (None: unknown): the call run again on detached inputs, so
    that its backward runs alone. Each gradient of an input is measured against that input and
    each gradient of an output against that output (a weight's gradient is as large as the
    weight, however the batch is split); the scratch against the largest."""
    ins = _tensors((args, kwargs))
    leaves = [t for t in ins if t.requires_grad]
    if not leaves:
        return (), frozenset()
    detached = {id(t): t.detach().requires_grad_() for t in leaves}
    args, kwargs = tree_map(lambda x: detached.get(id(x), x), (args, kwargs))
    results = _tensors(call(args, kwargs))
    outs = [(k, o) for k, o in enumerate(results) if o.requires_grad]
    if not outs:
        return (), frozenset()
    try:
        with _Peak() as peak:
            seeds = [torch.zeros_like(o) for _, o in outs]
            grads = torch.autograd.grad([o for _, o in outs], list(detached.values()), seeds, allow_unused=True)
    except RuntimeError as exc:  # an op autograd cannot differentiate alone (a copy into a buffer)
        log.debug("the backward of %s does not run alone: %s", call, exc)
        return (), None
    owners = {}  # storage key -> the tensor it is measured against
    grad_of = dict(zip(detached, grads))  # id of an input -> its gradient
    given = frozenset(i for i, x in enumerate(ins) if grad_of.get(id(x)) is not None)
    for i, x in enumerate(ins):
        g = grad_of.get(id(x))
        if g is not None:
            owners.setdefault(_key(g), ("input", i, x, g))
    for (k, o), g in zip(outs, seeds):
        owners.setdefault(_key(g), ("output", k, o, g))
    tensors = [("output", k, o) for k, o in enumerate(results)] + [("input", i, x) for i, x in enumerate(ins)]
    where, index, ref = max(tensors, key=lambda r: r[2].numel())
    parts, scratch = [], 0
    for key, nbytes in peak.at_peak.items():
        if key in owners:
            w, i, x, g = owners[key]
            parts.append(TensorPart(w, i, nbytes / g.element_size() / max(x.numel(), 1), g.dtype))
        else:
            scratch += nbytes
    if scratch:
        parts.append(TensorPart(where, index, scratch / ref.element_size() / max(ref.numel(), 1), ref.dtype))
    return tuple(parts), given


def _reference(t: torch.Tensor, inputs, outputs) -> tuple[str, int, torch.Tensor]:
    """The input or output an unmatched saved tensor is measured against (module docstring)."""
    tensors = [("output", i, x) for i, x in enumerate(outputs)] + [("input", i, x) for i, x in enumerate(inputs)]
    for same in (lambda x: x.shape == t.shape, lambda x: x.numel() == t.numel()):
        hit = next((r for r in tensors if same(r[2])), None)
        if hit is not None:
            return hit
    return max(tensors, key=lambda r: r[2].numel())


def _match(t: torch.Tensor, inputs, outputs) -> tuple[str, int, torch.Tensor]:
    key = _key(t)
    for where, tensors in (("output", outputs), ("input", inputs)):
        for i, x in enumerate(tensors):
            if _key(x) == key:
                return where, i, x
    return _reference(t, inputs, outputs)


def _fresh(val, requires_grad: bool, device):
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device or val.device)
    return t.requires_grad_(requires_grad and t.dtype.is_floating_point)


def _record(gm, placeholders, trainable, device):
    """(the recorder after one run of ``gm``, its placeholder values), on ``device`` (None: the
    devices the graph was captured on); ``trainable``: the placeholders that need gradients."""
    recorder = _Recorder(gm, device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [_fresh(n.meta.get("val"), n.name in trainable, device) for n in placeholders]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            recorder.run(*args)
    return recorder, args


def saved_tensors_pass(gm: torch.fx.GraphModule, inputs, frozen=frozenset()) -> torch.fx.GraphModule:
    """Write ``meta["autopar_saved"]`` and ``meta["autopar_backward"]`` on every call of ``gm`` (``inputs``: its
    :class:`~autopar.passes.capture.graph.GraphInput` s, for which placeholders are parameters;
    ``frozen``: the FQNs of parameters that need no gradient)."""
    kinds = {i.node: i.kind for i in inputs}
    trainable = {i.node for i in inputs if i.kind == "parameter" and i.name not in frozen}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        with quiet_torch_logs():  # fake tensors log a failing CPU kernel's traceback before raising it
            recorder, args = _record(gm, placeholders, trainable, CPU)
    except (RuntimeError, ValueError) as exc:  # a kernel whose CPU strides the captured views do not take
        log.debug("saved tensors recorded on the captured devices, not the CPU: %s", exc)
        try:
            recorder, args = _record(gm, placeholders, trainable, None)
        except (RuntimeError, ValueError) as again:
            warnings.warn(f"capture could not run the graph again to see what autograd saves ({again}); plans"
                          " of this model predict no activation memory", stacklevel=3)
            return gm
    state = {_key(a) for n, a in zip(placeholders, args)
             if isinstance(a, torch.Tensor) and kinds.get(n.name, "constant") in MODEL_STATE}
    kept = {n: {_key(t): t for t in saved if _key(t) not in state} for n, saved, *_ in recorder.calls}
    holders = Counter(key for saved in kept.values() for key in saved)
    number = {key: i for i, key in enumerate(holders)}  # storage key -> its number in this graph
    kept_any = {n: {_key(t) for t in saved} for n, saved, *_ in recorder.calls}  # model state included
    for n, _, ins, outs, backward in recorder.calls:
        entries = []
        for key, t in kept[n].items():
            where, index, ref = _match(t, ins, outs)
            elements = t.untyped_storage().nbytes() / t.element_size()  # a view keeps its whole storage
            entries.append(TensorPart(where, index, elements / max(ref.numel(), 1), t.dtype, 1.0 / holders[key],
                                      number[key]))
        n.meta["autopar_saved"] = tuple(entries)
        n.meta["autopar_saved_inputs"] = frozenset(i for i, x in enumerate(ins) if _key(x) in kept_any[n])
        n.meta["autopar_backward"] = backward
    return gm


__all__ = ["saved_tensors_pass"]
