"""Gradient bucketing: parameter gradients summed over mesh axes in a few large asynchronous
all-reduces that overlap the rest of the backward pass (DDP's overlap), and program outputs
whose sums ride along.

:func:`hook_parameter` hooks a parameter's gradient accumulator once; each step its gradient is
packed into a bucket whose all-reduce starts as soon as the bucket is full, and the sum is added
to ``.grad`` when the backward pass ends: train with ``loss.backward()``
(``torch.autograd.grad`` would not see those gradients). A ``.grad`` that was None is left a
view into its bucket (DDP's ``gradient_as_bucket_view``): no copy per parameter.
:func:`deferred_gradient_sums` sums once per step over several backward passes (a pipeline's
micro-batches); :func:`sum_in_place` with ``wait=False`` leaves an output's sum in flight (or in
the last bucket) until :func:`wait_outputs`.

Each gradient (and output) sum is reported to :mod:`autopar.comm.record` as the all-reduce the
plan prices, when it joins a bucket; a bucket's own launch is reported as kind ``"bucket"``,
the carrier of sums already reported.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autopar.comm.mesh import AxisGroup
from autopar.comm.record import carried, issuing, nbytes_of
from autopar.core.errors import AutoparError

FIRST_BUCKET_BYTES = 1 << 20  # as DDP: a small first bucket starts communication early,
BUCKET_BYTES = 25 << 20  # then buckets of 25 MiB

_OUTPUT_WORKS: list = []  # (work, flat buffer, [(target, shape)]) of output sums in flight
_DEFERRED: list = []  # (tensor, ax): output sums to ride in the last gradient bucket of their group
_BUCKET_GROUPS: set = set()  # groups whose parameter gradients this forward pass will bucket


class _Into:
    """Where a summed output lands: copied into ``tensor`` (not a parameter's ``.grad``)."""

    def __init__(self, tensor):
        self.tensor = tensor


def _unpack(flat: torch.Tensor, items) -> None:
    """Hand each slice of a summed flat buffer to its parameter's ``.grad`` or its output."""
    offset = 0
    for target, shape in items:
        n = shape.numel()
        reduced = flat[offset:offset + n].view(shape)
        offset += n
        if isinstance(target, _Into):
            target.tensor.copy_(reduced)
        elif target.grad is None:  # a view into the bucket, as DDP's gradient_as_bucket_view
            target.grad = reduced
        else:
            target.grad.add_(reduced)


def _send_deferred() -> None:
    while _DEFERRED:
        out, ax = _DEFERRED.pop(0)
        with issuing("bucket", ax.group, nbytes_of(out)):
            _OUTPUT_WORKS.append((dist.all_reduce(out, group=ax.group, async_op=True), out, []))


def wait_outputs() -> None:
    """Finish the outputs' all-reduces started with ``wait=False`` (sending those that no
    gradient bucket took) and wait for them."""
    _BUCKET_GROUPS.clear()
    _send_deferred()
    while _OUTPUT_WORKS:
        work, flat, items = _OUTPUT_WORKS.pop(0)
        work.wait()
        _unpack(flat, items)


def sum_in_place(out: torch.Tensor, ax: AxisGroup, wait: bool) -> None:
    """Sum ``out`` (a fresh contiguous tensor) over the axis in place; ``wait=False`` leaves the
    sum in flight or, when this step buckets gradients on that group, queues it to ride in the
    last bucket (one collective fewer)."""
    if not wait and id(ax.group) in _BUCKET_GROUPS and nbytes_of(out) <= BUCKET_BYTES:
        carried("all_reduce", ax.group, nbytes_of(out))
        _DEFERRED.append((out, ax))
        return
    with issuing("all_reduce", ax.group, nbytes_of(out)):
        if wait:
            dist.all_reduce(out, group=ax.group)
        else:
            _OUTPUT_WORKS.append((dist.all_reduce(out, group=ax.group, async_op=True), out, []))


class _ParameterGradHook:
    """Pre-hook of a parameter's ``AccumulateGrad`` node: the gradient goes into a bucket to be
    summed over ``axes`` (in order) instead of into ``.grad``. A Python hook costs about a
    microsecond where an autograd ``Function`` per parameter and step costs tens."""

    def __init__(self, param):
        self.param = param
        self.axes: tuple = ()
        self.key = None  # the bucket this gradient joins: (the axes' groups, dtype)
        self.local = None  # this rank's gradient summed over the passes of a deferred step

    def add_axis(self, ax: AxisGroup) -> None:
        if ax not in self.axes:  # the program calls this once per axis, in the same order every step
            self.axes += (ax,)
            self.key = (tuple(id(a.group) for a in self.axes), self.param.dtype)

    def __call__(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return None
        if _DEFERRING is not None:  # summed once when the step ends (deferred_gradient_sums)
            _defer(self, g)
            return _NOTHING
        if not _BUCKETS.queued:
            torch.autograd.Variable._execution_engine.queue_callback(_BUCKETS.finish)
            _BUCKETS.queued = True
        _BUCKETS.add(self.param, g, self.axes, self.key)
        return _NOTHING  # nothing reaches .grad now; the sum lands there when the backward ends

    def flush(self) -> None:
        """Send the gradient a deferred step added up (:func:`deferred_gradient_sums`)."""
        _BUCKETS.add(self.param, self.local, self.axes, self.key)


_NOTHING = (None,)


def _defer(hook, g: torch.Tensor) -> None:
    """Add ``g`` to the gradient ``hook`` holds until the deferred step ends."""
    if hook.local is None:
        _DEFERRING.append(hook)
        hook.local = g
    else:
        hook.local = hook.local + g  # out of place: autograd may share g


def hook_parameter(hooks: dict, param: torch.Tensor, ax: AxisGroup) -> None:
    """Sum ``param``'s gradient over ``ax`` too, bucketed (hooks it on first call and records
    the hook in ``hooks``, which the caller keeps while the parameter lives; idempotent). Output
    sums of this step on the same group may then ride in the last bucket."""
    _BUCKET_GROUPS.add(id(ax.group))
    entry = hooks.get(id(param))
    if entry is None:
        hook = _ParameterGradHook(param)
        node = torch.autograd.graph.get_gradient_edge(param).node
        node.register_prehook(hook)
        entry = hooks[id(param)] = (node, hook)  # holding the node keeps the hook on it
    entry[1].add_axis(ax)


class _ScatterGradHook:
    """Pre-hook of a ZeRO-2 parameter's ``AccumulateGrad`` node: each gradient goes to
    ``scatter`` (which reduce-scatters it into this rank's shard) and never into ``.grad``; the
    program's gradient sums over the parameter's axes are that reduce-scatter's. Inside
    :func:`deferred_gradient_sums` the gradients of every pass are added up and scattered once."""

    def __init__(self, scatter):
        self.scatter = scatter
        self.local = None  # this rank's gradient summed over the passes of a deferred step

    def add_axis(self, ax: AxisGroup) -> None:
        """The program sums over ``ax`` here: the scatter sums already."""

    def __call__(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return None
        if _DEFERRING is not None:
            _defer(self, g)
            return _NOTHING
        with torch.no_grad():
            self.scatter(g)
        return _NOTHING

    def flush(self) -> None:
        """Scatter the gradient a deferred step added up (:func:`deferred_gradient_sums`)."""
        with torch.no_grad():
            self.scatter(self.local)


def scatter_parameter(hooks: dict, param: torch.Tensor, scatter) -> None:
    """Hand ``param``'s gradients to ``scatter(grad)`` as backward makes them, instead of summing
    them into ``.grad`` (ZeRO-2; register before the first forward, in the ``hooks`` the module's
    gradient sums use: :func:`hook_parameter` then leaves the parameter to it)."""
    node = torch.autograd.graph.get_gradient_edge(param).node
    hook = _ScatterGradHook(scatter)
    node.register_prehook(hook)
    hooks[id(param)] = (node, hook)


class _Buckets:
    """Parameter gradients waiting to be summed over mesh axes, packed into flat buffers so that
    few large all-reduces run while the rest of the backward pass computes (DDP-style).

    Gradients arrive in backward order, which is the same on every rank, so every rank forms
    the same buckets. When the backward pass ends, each sum is added to its ``param.grad``.
    """

    def __init__(self):
        self.open: dict = {}  # (groups, dtype) -> [[(param, grad)], bytes, axes]
        self.sent: list = []  # (work, flat buffer, [(param, shape)], axes still to sum over)
        self.launched = 0
        self.queued = False  # finish() is queued to run when this backward pass ends

    def clear(self) -> None:
        """Drop what a backward pass that failed half-way left behind."""
        self.__init__()

    def add(self, param, g, axes: tuple, key) -> None:
        bucket = self.open.get(key)
        if bucket is None:
            bucket = self.open[key] = [[], 0, axes]
        for ax in axes:  # the sums the plan prices; the bucket carries them
            carried("all_reduce", ax.group, nbytes_of(g))
        bucket[0].append((param, g))
        bucket[1] += nbytes_of(g)
        if bucket[1] >= (FIRST_BUCKET_BYTES if self.launched == 0 else BUCKET_BYTES):
            self._launch(key)

    def _launch(self, key) -> None:
        items, nbytes, (first, *rest) = self.open.pop(key)
        with issuing("bucket", first.group, nbytes) as made:
            flat = torch.cat([g.reshape(-1) for _, g in items])  # a copy: autograd may share g
            work = dist.all_reduce(flat, group=first.group, async_op=True)
            made(flat)
        self.sent.append((work, flat, [(p, g.shape) for p, g in items], rest))
        self.launched += 1

    def finish(self) -> None:
        keep = []
        for out, ax in _DEFERRED:  # program outputs waiting for a sum ride in the last bucket
            bucket = self.open.get(((id(ax.group),), out.dtype))
            if bucket is not None:
                bucket[0].append((_Into(out), out))
            else:
                keep.append((out, ax))
        _DEFERRED[:] = keep
        for key in list(self.open):
            self._launch(key)
        with torch.no_grad():
            _send_deferred()
            for work, flat, items, rest in self.sent:
                work.wait()
                for ax in rest:  # a gradient summed over several mesh axes: one after the other
                    with issuing("bucket", ax.group, nbytes_of(flat)):
                        dist.all_reduce(flat, group=ax.group)
                _unpack(flat, items)
        self.sent.clear()
        self.launched = 0
        self.queued = False


_BUCKETS = _Buckets()


_DEFERRING: list | None = None  # hooks holding local gradients, inside deferred_gradient_sums()


@contextlib.contextmanager
def deferred_gradient_sums():
    """Inside, hooked parameters add up their local gradients over every backward pass (a
    pipeline's micro-batches); on leaving, each sum is all-reduced once, bucketed as usual, and
    added to ``.grad`` (a :func:`scatter_parameter` one is reduce-scattered once instead). The
    sum over ranks of the sum over passes is the same gradient as summing each pass, with one
    collective per bucket per step instead of per pass."""
    global _DEFERRING
    if _DEFERRING is not None:
        raise AutoparError("deferred_gradient_sums() is already active")
    _DEFERRING = hooks = []
    try:
        yield
    except BaseException:
        for hook in hooks:
            hook.local = None
        raise
    finally:
        _DEFERRING = None
    for hook in hooks:  # in the order the first gradients arrived: the same on every rank
        hook.flush()
        hook.local = None
    _BUCKETS.finish()


def reset_pending() -> None:
    """Forget gradient buckets and output all-reduces a failed step left in flight."""
    _BUCKETS.clear()
    _OUTPUT_WORKS.clear()
    _DEFERRED.clear()
    _BUCKET_GROUPS.clear()


__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "deferred_gradient_sums", "hook_parameter", "reset_pending",
           "scatter_parameter", "sum_in_place", "wait_outputs"]
