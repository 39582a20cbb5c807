"""Differentiable collectives over one mesh axis: the functions emitted programs call.

Every function takes the local tensor and ``axis`` (a mesh axis); the process group of that axis
and this rank's coordinate come from the :class:`RankMesh` installed with :func:`use_mesh`.
Each is a ``torch.autograd.Function`` over plain ``torch.distributed`` calls whose backward is
chosen by the code generator (``backward=``), because the right adjoint depends on what the
gradient arriving from the consumers is (replicated or still a pending sum):

=========================  ==================  ============================================
function                   forward             backward
=========================  ==================  ============================================
autopar_all_reduce         P -> R              ``identity`` (Megatron's g) or ``all_reduce``
autopar_reduce_scatter     P -> S(dim)         all-gather
autopar_all_gather         S(dim) -> R         ``slice`` or ``reduce_scatter`` (ZeRO-3/FSDP)
autopar_chunk              R -> S(dim)         ``all_gather`` or ``zero_pad`` (no traffic)
autopar_all_to_all         S(dim) -> S(dim2)   all-to-all back
autopar_to_partial         R -> P              ``identity`` or ``mask`` (coordinate 0 keeps it)
autopar_grad_all_reduce    identity            all-reduce (Megatron's f; data-parallel grads)
autopar_grad_to_partial    identity            coordinate 0 keeps the gradient, others zero
=========================  ==================  ============================================

``autopar_local_op`` runs a sharding rule's local implementation (``Strategy.local``).

On a parameter of a running module (``use_mesh(..., grad_hooks=...)``), ``autopar_grad_all_reduce``
hooks the parameter's gradient accumulator once; each step it packs the gradient into a bucket
whose all-reduce runs asynchronously and adds the result to ``.grad`` when the backward pass ends
(DDP's overlap): train with ``loss.backward()``; ``torch.autograd.grad`` would not see those
gradients. A ``.grad`` that was None is left a view into its bucket (DDP's
``gradient_as_bucket_view``): no copy per parameter.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function

from autopar.comm.groups import resolve
from autopar.comm.regather import note, regather_source
from autopar.core.errors import AutoparError


@dataclass(frozen=True)
class RankMesh:
    """This rank's view of the mesh: its coordinate and the name of its process group on each
    mesh axis (None for an axis of size 1; names, not groups: :mod:`autopar.comm.groups`)."""

    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    group_names: tuple

    def __post_init__(self):
        if not (len(self.mesh_shape) == len(self.coord) == len(self.group_names)):
            raise AutoparError("RankMesh needs one coordinate and one group per mesh axis")
        if any(not 0 <= c < n for c, n in zip(self.coord, self.mesh_shape)):
            raise AutoparError(f"coordinate {self.coord} is outside the mesh {self.mesh_shape}")

    def group(self, axis: int):
        """The process group of mesh axis ``axis`` (None for an axis of size 1)."""
        return resolve(self.group_names[axis])


_MESH: RankMesh | None = None
_GRAD_HOOKS: dict | None = None  # the running module's parameter hooks (see autopar_grad_all_reduce)


def current_mesh() -> RankMesh:
    if _MESH is None:
        raise AutoparError(
            "no mesh is installed: emitted programs run inside DistributedProgram.module() /"
            " step(), or under autopar.comm.collectives.use_mesh(...)"
        )
    return _MESH


@contextlib.contextmanager
def use_mesh(mesh: RankMesh, grad_hooks: dict | None = None):
    """Install ``mesh`` for the collectives called inside the ``with`` block. ``grad_hooks``
    (a dict the caller keeps for as long as its parameters live) lets parameter gradient sums
    hook the parameters once instead of adding an autograd node per forward pass."""
    global _MESH, _GRAD_HOOKS
    previous, _MESH = (_MESH, _GRAD_HOOKS), mesh
    _GRAD_HOOKS = grad_hooks
    try:
        yield mesh
    finally:
        _MESH, _GRAD_HOOKS = previous


def _axis(axis: int) -> tuple:
    """``(size, this rank's coordinate, process group)`` of mesh axis ``axis``; autograd
    functions keep it for their backward, which may run outside the ``use_mesh`` block."""
    mesh = current_mesh()
    return mesh.mesh_shape[axis], mesh.coord[axis], mesh.group(axis)


# ---------------------------------------------------------------- plain (non-autograd) collectives


def _wire(x: torch.Tensor) -> torch.Tensor:
    """gloo has no bool collectives: send booleans as bytes."""
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def all_reduce(x: torch.Tensor, ax: tuple) -> torch.Tensor:
    n, _, group = ax
    if n == 1:
        return x
    out = _wire(x).clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out.to(x.dtype)


def all_gather(x: torch.Tensor, ax: tuple, dim: int) -> torch.Tensor:
    n, _, group = ax
    if n == 1:
        return x
    src = _wire(x).movedim(dim, 0).contiguous()
    out = src.new_empty((n * src.shape[0],) + tuple(src.shape[1:]))
    dist.all_gather_single(out, src, group=group)
    return out.movedim(0, dim).contiguous().to(x.dtype)


def reduce_scatter(x: torch.Tensor, ax: tuple, dim: int) -> torch.Tensor:
    n, _, group = ax
    if n == 1:
        return x
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // n,) + tuple(src.shape[1:]))
    dist.reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def chunk(x: torch.Tensor, ax: tuple, dim: int) -> torch.Tensor:
    n, c, _ = ax
    size = x.shape[dim] // n
    return x.narrow(dim, c * size, size).contiguous()


def zero_pad(x: torch.Tensor, ax: tuple, dim: int) -> torch.Tensor:
    """The inverse placement of :func:`chunk`: this rank's piece in a zero tensor of full size."""
    n, c, _ = ax
    shape = list(x.shape)
    shape[dim] *= n
    out = x.new_zeros(shape)
    out.narrow(dim, c * x.shape[dim], x.shape[dim]).copy_(x)
    return out


def all_to_all(x: torch.Tensor, ax: tuple, gather_dim: int, split_dim: int) -> torch.Tensor:
    n, _, group = ax
    if n == 1:
        return x
    src = torch.stack(_wire(x).chunk(n, dim=split_dim)).contiguous()
    out = torch.empty_like(src)
    dist.all_to_all_single(out, src, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim).to(x.dtype)


def keep_on_first(x: torch.Tensor, ax: tuple) -> torch.Tensor:
    _, c, _ = ax
    return x if c == 0 else torch.zeros_like(x)


# ---------------------------------------------------------------- autograd functions


_OUTPUT_WORKS: list = []  # (work, flat buffer, [(target, numel, shape)]) of output sums in flight
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
        _OUTPUT_WORKS.append((dist.all_reduce(out, group=ax[2], async_op=True), out, []))


def wait_outputs() -> None:
    """Finish the outputs' all-reduces started with ``wait=False`` (sending those that no
    gradient bucket took) and wait for them."""
    _BUCKET_GROUPS.clear()
    _send_deferred()
    while _OUTPUT_WORKS:
        work, flat, items = _OUTPUT_WORKS.pop(0)
        work.wait()
        _unpack(flat, items)


def _sum_in_place(out: torch.Tensor, ax: tuple, wait: bool) -> None:
    """Sum ``out`` (a fresh contiguous tensor) over the axis in place; ``wait=False`` leaves the
    sum in flight or, when this step buckets gradients on that group, queues it to ride in the
    last bucket (one collective fewer)."""
    if wait:
        dist.all_reduce(out, group=ax[2])
    elif id(ax[2]) in _BUCKET_GROUPS and out.numel() * out.element_size() <= BUCKET_BYTES:
        _DEFERRED.append((out, ax))
    else:
        _OUTPUT_WORKS.append((dist.all_reduce(out, group=ax[2], async_op=True), out, []))


def _all_reduce_identity_backward(x: torch.Tensor, ax: tuple, wait: bool) -> torch.Tensor:
    """``x`` summed over the axis, the gradient passed through unchanged (Megatron's g). Autograd
    sees a clone (a C++ node) and the sum is written into it in place: cheaper than a Python
    autograd function."""
    if ax[0] == 1:
        return x
    if x.dtype == torch.bool:
        return all_reduce(x, ax)
    out = x.clone(memory_format=torch.contiguous_format)
    _sum_in_place(out.detach(), ax, wait)  # a detached alias: writing the sum records nothing
    return out


class _AllReduce(Function):  # the all-reduce whose gradient is still a pending sum
    @staticmethod
    def forward(ctx, x, ax, wait):
        ctx.ax = ax
        out = x.clone(memory_format=torch.contiguous_format)
        _sum_in_place(out.detach(), ax, wait)  # a detached alias: writing the sum records nothing
        return out

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.ax), None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, ax, dim):
        ctx.ax, ctx.dim = ax, dim
        return reduce_scatter(x, ax, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.ax, ctx.dim), None, None


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, ax, dim, backward):
        ctx.ax, ctx.dim, ctx.backward = ax, dim, backward
        out = all_gather(x, ax, dim)
        source = regather_source(x)
        if source is not None and ax[0] > 1:  # a sharded parameter: gathered again in backward
            note(out, lambda: all_gather(source(), ax, dim))
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.backward == "reduce_scatter":
            return reduce_scatter(g, ctx.ax, ctx.dim), None, None, None
        return chunk(g, ctx.ax, ctx.dim), None, None, None


class _Chunk(Function):
    @staticmethod
    def forward(ctx, x, ax, dim, backward):
        ctx.ax, ctx.dim, ctx.backward = ax, dim, backward
        return chunk(x, ax, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.backward == "zero_pad":
            return zero_pad(g, ctx.ax, ctx.dim), None, None, None
        return all_gather(g, ctx.ax, ctx.dim), None, None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, ax, dim, dim2):
        ctx.ax, ctx.dim, ctx.dim2 = ax, dim, dim2
        return all_to_all(x, ax, dim, dim2)

    @staticmethod
    def backward(ctx, g):
        return all_to_all(g, ctx.ax, ctx.dim2, ctx.dim), None, None, None


class _ToPartial(Function):
    @staticmethod
    def forward(ctx, x, ax, backward):
        ctx.ax, ctx.backward = ax, backward
        return keep_on_first(x, ax).clone()

    @staticmethod
    def backward(ctx, g):
        return (keep_on_first(g, ctx.ax) if ctx.backward == "mask" else g), None, None


class _GradAllReduce(Function):
    @staticmethod
    def forward(ctx, x, ax):
        ctx.ax = ax
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.ax), None


class _ParameterGradHook:
    """Pre-hook of a parameter's ``AccumulateGrad`` node: the gradient goes into a bucket to be
    summed over ``axes`` (in order) instead of into ``.grad``. A Python hook costs about a
    microsecond where an autograd ``Function`` per parameter and step costs tens."""

    def __init__(self, param):
        self.param = param
        self.axes: tuple = ()
        self.key = None  # the bucket this gradient joins: (the axes' groups, dtype)
        self.local = None  # this rank's gradient summed over the passes of a deferred step

    def add_axis(self, ax: tuple) -> None:
        if ax not in self.axes:  # the program calls this once per axis, in the same order every step
            self.axes += (ax,)
            self.key = (tuple(id(a[2]) for a in self.axes), self.param.dtype)

    def __call__(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return None
        if _DEFERRING is not None:  # summed once when the step ends (deferred_gradient_sums)
            if self.local is None:
                _DEFERRING.append(self)
                self.local = g
            else:
                self.local = self.local + g  # out of place: autograd may share g
            return _NOTHING
        if not _BUCKETS.queued:
            torch.autograd.Variable._execution_engine.queue_callback(_BUCKETS.finish)
            _BUCKETS.queued = True
        _BUCKETS.add(self.param, g, self.axes, self.key)
        return _NOTHING  # nothing reaches .grad now; the sum lands there when the backward ends


_NOTHING = (None,)


def _hook_parameter(param: torch.Tensor, ax: tuple) -> None:
    """Sum ``param``'s gradient over ``ax`` too (hooks it on first call; idempotent)."""
    entry = _GRAD_HOOKS.get(id(param))
    if entry is None:
        hook = _ParameterGradHook(param)
        node = torch.autograd.graph.get_gradient_edge(param).node
        node.register_prehook(hook)
        entry = _GRAD_HOOKS[id(param)] = (node, hook)  # holding the node keeps the hook on it
    entry[1].add_axis(ax)


FIRST_BUCKET_BYTES = 1 << 20  # as DDP: a small first bucket starts communication early,
BUCKET_BYTES = 25 << 20  # then buckets of 25 MiB


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
        bucket[0].append((param, g))
        bucket[1] += g.numel() * g.element_size()
        if bucket[1] >= (FIRST_BUCKET_BYTES if self.launched == 0 else BUCKET_BYTES):
            self._launch(key)

    def _launch(self, key) -> None:
        items, _, (first, *rest) = self.open.pop(key)
        flat = torch.cat([g.reshape(-1) for _, g in items])  # a copy: autograd may share g
        work = dist.all_reduce(flat, group=first[2], async_op=True)
        self.sent.append((work, flat, [(p, g.shape) for p, g in items], rest))
        self.launched += 1

    def finish(self) -> None:
        keep = []
        for out, ax in _DEFERRED:  # program outputs waiting for a sum ride in the last bucket
            bucket = self.open.get(((id(ax[2]),), out.dtype))
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
                    dist.all_reduce(flat, group=ax[2])
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
    added to ``.grad``. The sum over ranks of the sum over passes is the same gradient as
    summing each pass, with one collective per bucket per step instead of per pass."""
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
        _BUCKETS.add(hook.param, hook.local, hook.axes, hook.key)
        hook.local = None
    _BUCKETS.finish()


def reset_pending() -> None:
    """Forget gradient buckets and output all-reduces a failed step left in flight."""
    _BUCKETS.clear()
    _OUTPUT_WORKS.clear()
    _DEFERRED.clear()
    _BUCKET_GROUPS.clear()


class _GradToPartial(Function):
    @staticmethod
    def forward(ctx, x, ax):
        ctx.ax = ax
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return keep_on_first(g, ctx.ax), None


def _check(name: str, backward: str, allowed: tuple[str, ...]) -> None:
    if backward not in allowed:
        raise AutoparError(f"{name}: backward={backward!r} is not one of {allowed}")


# ---------------------------------------------------------------- what emitted graphs call


def autopar_all_reduce(x, *, axis: int, backward: str = "identity", wait: bool = True):
    """Sum a pending ``Partial`` over ``axis`` (P -> R). ``wait=False`` (for program outputs
    only: nothing in the program may read the result) returns before the sum has arrived; the
    runtime calls :func:`wait_outputs` before handing outputs to the user, after the backward
    when it can, so that the loss's all-reduce does not hold up the backward pass."""
    _check("autopar_all_reduce", backward, ("identity", "all_reduce"))
    ax = _axis(axis)
    if backward == "identity" or ax[0] == 1 or x.dtype == torch.bool:
        return _all_reduce_identity_backward(x, ax, wait)
    return _AllReduce.apply(x, ax, wait)


def autopar_reduce_scatter(x, *, axis: int, dim: int):
    """Sum a pending ``Partial`` over ``axis`` and keep this rank's block of ``dim`` (P -> S)."""
    return _ReduceScatter.apply(x, _axis(axis), dim)


def autopar_all_gather(x, *, axis: int, dim: int, backward: str = "slice"):
    """Concatenate the shards of ``dim`` over ``axis`` (S -> R)."""
    _check("autopar_all_gather", backward, ("slice", "reduce_scatter"))
    return _AllGather.apply(x, _axis(axis), dim, backward)


def autopar_chunk(x, *, axis: int, dim: int, backward: str = "all_gather"):
    """Keep this rank's block of ``dim`` (R -> S, no traffic forward)."""
    _check("autopar_chunk", backward, ("all_gather", "zero_pad"))
    return _Chunk.apply(x, _axis(axis), dim, backward)


def autopar_all_to_all(x, *, axis: int, dim: int, dim2: int):
    """Re-shard from ``dim`` to ``dim2`` over ``axis`` (S(dim) -> S(dim2))."""
    return _AllToAll.apply(x, _axis(axis), dim, dim2)


def autopar_to_partial(x, *, axis: int, backward: str = "identity"):
    """Make a replicated tensor a pending sum: coordinate 0 keeps it, the others hold zeros."""
    _check("autopar_to_partial", backward, ("identity", "mask"))
    return _ToPartial.apply(x, _axis(axis), backward)


def autopar_grad_all_reduce(x, *, axis: int):
    """Identity forward; the gradient is summed over ``axis`` (it arrives as a pending sum). On a
    parameter of a running :class:`~autopar.runtime.program.DistributedModule` the sum is
    bucketed and overlaps the rest of the backward pass (see :class:`_Buckets`)."""
    ax = _axis(axis)
    if _GRAD_HOOKS is not None and ax[0] > 1 and x.is_leaf and x.requires_grad:
        _BUCKET_GROUPS.add(id(ax[2]))
        _hook_parameter(x, ax)
        return x
    return _GradAllReduce.apply(x, ax)


def autopar_grad_to_partial(x, *, axis: int):
    """Identity forward; the replicated gradient becomes a pending sum (coordinate 0 keeps it)."""
    return _GradToPartial.apply(x, _axis(axis))


def autopar_local_op(op: str, impl: str, ctx, args, kwargs):
    """Run the local implementation ``impl`` of op ``op`` (``"aten.embedding.default"``)'s
    sharding rule on this rank's pieces; ``ctx`` is the rank's ``LocalContext``."""
    target, fn = _resolve_local(op, impl)
    return fn(target, tuple(args), dict(kwargs), ctx)


@functools.lru_cache(maxsize=None)
def _resolve_local(op: str, impl: str):
    """``(op overload, local implementation)`` named by an emitted ``autopar_local_op`` call."""
    from autopar.passes.rules.registry import local_impl

    namespace, name, overload = op.split(".")
    target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    return target, local_impl(target, impl)


EMITTED = (
    autopar_all_reduce, autopar_reduce_scatter, autopar_all_gather, autopar_chunk,
    autopar_all_to_all, autopar_to_partial, autopar_grad_all_reduce, autopar_grad_to_partial,
    autopar_local_op,
)

__all__ = ["EMITTED", "RankMesh", "current_mesh", "deferred_gradient_sums", "reset_pending", "use_mesh",
           "wait_outputs"] + [f.__name__ for f in EMITTED]


def _register_short_names() -> None:
    """Let FX print ``autopar_all_reduce(x, axis = 0)`` rather than a module-mangled name."""
    from torch.fx.graph import _register_custom_builtin

    for fn in EMITTED:
        _register_custom_builtin(fn.__name__, f"from {__name__} import {fn.__name__}", fn)


_register_short_names()
