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

On a parameter itself, ``autopar_grad_all_reduce`` packs the gradient into a bucket whose
all-reduce runs asynchronously and adds the result to ``.grad`` when the backward pass ends
(DDP's overlap): train with ``loss.backward()``; ``torch.autograd.grad`` would not see those
gradients. A ``.grad`` that was None is left a view into its bucket (DDP's
``gradient_as_bucket_view``): no copy per parameter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function

from autopar.errors import AutoparError


@dataclass(frozen=True)
class RankMesh:
    """This rank's view of the mesh: its coordinate and one process group per mesh axis."""

    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    groups: tuple  # one torch.distributed ProcessGroup per axis (None for an axis of size 1)

    def __post_init__(self):
        if not (len(self.mesh_shape) == len(self.coord) == len(self.groups)):
            raise AutoparError("RankMesh needs one coordinate and one group per mesh axis")
        if any(not 0 <= c < n for c, n in zip(self.coord, self.mesh_shape)):
            raise AutoparError(f"coordinate {self.coord} is outside the mesh {self.mesh_shape}")


_MESH: RankMesh | None = None


def current_mesh() -> RankMesh:
    if _MESH is None:
        raise AutoparError(
            "no mesh is installed: emitted programs run inside DistributedProgram.module() /"
            " step(), or under autopar.runtime.collectives.use_mesh(...)"
        )
    return _MESH


@contextlib.contextmanager
def use_mesh(mesh: RankMesh):
    """Install ``mesh`` for the collectives called inside the ``with`` block."""
    global _MESH
    previous, _MESH = _MESH, mesh
    try:
        yield mesh
    finally:
        _MESH = previous


def _axis(axis: int) -> tuple:
    """``(size, this rank's coordinate, process group)`` of mesh axis ``axis``; autograd
    functions keep it for their backward, which may run outside the ``use_mesh`` block."""
    mesh = current_mesh()
    return mesh.mesh_shape[axis], mesh.coord[axis], mesh.groups[axis]


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
    for target, n, shape in items:
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
    with torch.no_grad():  # the sums land in place in autograd outputs
        _send_deferred()
        while _OUTPUT_WORKS:
            work, flat, items = _OUTPUT_WORKS.pop(0)
            work.wait()
            _unpack(flat, items)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, ax, backward, wait):
        ctx.ax, ctx.backward = ax, backward
        if wait or ax[0] == 1:
            return all_reduce(x, ax)
        out = x.clone(memory_format=torch.contiguous_format)
        if id(ax[2]) in _BUCKET_GROUPS and out.numel() * out.element_size() <= BUCKET_BYTES:
            _DEFERRED.append((out, ax))  # one collective fewer: it joins the last gradient bucket
        else:
            _OUTPUT_WORKS.append((dist.all_reduce(out, group=ax[2], async_op=True), out, []))
        return out

    @staticmethod
    def backward(ctx, g):
        return (all_reduce(g, ctx.ax) if ctx.backward == "all_reduce" else g), None, None, None


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
        return all_gather(x, ax, dim)

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
        ctx.param = x if x.is_leaf and x.requires_grad and ax[0] > 1 else None
        if ctx.param is not None:
            _BUCKET_GROUPS.add(id(ax[2]))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.param is not None:  # a parameter: reduce while the rest of the backward runs
            _reduce_into_grad(ctx.param, g, ctx.ax)
            return None, None
        return all_reduce(g, ctx.ax), None


FIRST_BUCKET_BYTES = 1 << 20  # as DDP: a small first bucket starts communication early,
BUCKET_BYTES = 25 << 20  # then buckets of 25 MiB


class _Buckets:
    """Parameter gradients waiting to be summed over a mesh axis, packed into flat buffers so
    that few large all-reduces run while the rest of the backward pass computes (DDP-style).

    Gradients arrive in backward order, which is the same on every rank, so every rank forms
    the same buckets. When the backward pass ends, each sum is added to its ``param.grad``.
    """

    def __init__(self):
        self.open: dict = {}  # group key -> [(param, grad)], bytes
        self.sent: list = []  # (work, flat buffer, [(param, numel, shape)])
        self.launched = 0
        self.queued = False  # finish() is queued to run when this backward pass ends

    def clear(self) -> None:
        """Drop what a backward pass that failed half-way left behind."""
        self.__init__()

    def add(self, param, g, ax) -> None:
        key = id(ax[2])
        items, size = self.open.get(key, ([], 0))
        items.append((param, g, ax))
        size += g.numel() * g.element_size()
        self.open[key] = (items, size)
        if size >= (FIRST_BUCKET_BYTES if self.launched == 0 else BUCKET_BYTES):
            self._launch(key)

    def _launch(self, key) -> None:
        items, _ = self.open.pop(key)
        flat = torch.cat([g.reshape(-1) for _, g, _ in items])  # a copy: autograd may share g
        work = dist.all_reduce(flat, group=items[0][2][2], async_op=True)
        self.sent.append((work, flat, [(p, g.numel(), g.shape) for p, g, _ in items]))
        self.launched += 1

    def finish(self) -> None:
        keep = []
        for out, ax in _DEFERRED:  # program outputs waiting for a sum ride in the last bucket
            items = self.open.get(id(ax[2]), ([], 0))[0]
            if items and items[0][1].dtype == out.dtype:
                items.append((_Into(out), out, ax))
            else:
                keep.append((out, ax))
        _DEFERRED[:] = keep
        for key in list(self.open):
            self._launch(key)
        with torch.no_grad():
            _send_deferred()
            for work, flat, items in self.sent:
                work.wait()
                _unpack(flat, items)
        self.sent.clear()
        self.launched = 0
        self.queued = False


_BUCKETS = _Buckets()


def _reduce_into_grad(param: torch.Tensor, g: torch.Tensor, ax: tuple) -> None:
    """Queue ``g`` to be summed over the axis without waiting; the sum lands in ``param.grad``
    when the backward pass ends (see :class:`_Buckets`)."""
    if not _BUCKETS.queued:
        torch.autograd.Variable._execution_engine.queue_callback(_BUCKETS.finish)
        _BUCKETS.queued = True
    _BUCKETS.add(param, g, ax)


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
    return _AllReduce.apply(x, _axis(axis), backward, wait)


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
    """Identity forward; the gradient is summed over ``axis`` (it arrives as a pending sum)."""
    return _GradAllReduce.apply(x, _axis(axis))


def autopar_grad_to_partial(x, *, axis: int):
    """Identity forward; the replicated gradient becomes a pending sum (coordinate 0 keeps it)."""
    return _GradToPartial.apply(x, _axis(axis))


def autopar_local_op(op: str, impl: str, ctx, args, kwargs):
    """Run the local implementation ``impl`` of op ``op`` (``"aten.embedding.default"``)'s
    sharding rule on this rank's pieces; ``ctx`` is the rank's ``LocalContext``."""
    from autopar.passes.rules.registry import local_impl

    namespace, name, overload = op.split(".")
    target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    return local_impl(target, impl)(target, tuple(args), dict(kwargs), ctx)


EMITTED = (
    autopar_all_reduce, autopar_reduce_scatter, autopar_all_gather, autopar_chunk,
    autopar_all_to_all, autopar_to_partial, autopar_grad_all_reduce, autopar_grad_to_partial,
    autopar_local_op,
)

__all__ = ["EMITTED", "RankMesh", "current_mesh", "reset_pending", "use_mesh", "wait_outputs"] + [f.__name__ for f in EMITTED]


def _register_short_names() -> None:
    """Let FX print ``autopar_all_reduce(x, axis = 0)`` rather than a module-mangled name."""
    from torch.fx.graph import _register_custom_builtin

    for fn in EMITTED:
        _register_custom_builtin(fn.__name__, f"from {__name__} import {fn.__name__}", fn)


_register_short_names()
