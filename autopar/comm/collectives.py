"""The collectives emitted programs call, one mesh axis each.

Every function takes the local tensor and ``axis`` (a mesh axis); the process group of that axis
and this rank's coordinate come from the :class:`~autopar.comm.mesh.RankMesh` installed with
:func:`use_mesh`. Where the right backward depends on what gradient arrives from the consumers
(replicated or still a pending sum), the code generator chooses it (``backward=``;
:mod:`autopar.comm.differentiable`):

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

On a parameter of a running module (``use_mesh(..., grad_hooks=...)``), ``autopar_grad_all_reduce``
buckets the gradient sum instead (:mod:`autopar.comm.buckets`) unless told ``bucket=False``.
"""

from __future__ import annotations

import contextlib

import torch

from autopar.comm import differentiable as D
from autopar.comm.buckets import hook_parameter
from autopar.comm.mesh import AxisGroup, RankMesh
from autopar.core.errors import AutoparError

_MESH: RankMesh | None = None
_GRAD_HOOKS: dict | None = None  # the running module's parameter hooks (see autopar_grad_all_reduce)


def current_mesh() -> RankMesh:
    """The mesh :func:`use_mesh` installed."""
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


def _axis(axis: int) -> AxisGroup:
    return current_mesh().axis(axis)


def _check(name: str, backward: str, allowed: tuple[str, ...]) -> None:
    if backward not in allowed:
        raise AutoparError(f"{name}: backward={backward!r} is not one of {allowed}")


def autopar_all_reduce(x, *, axis: int, backward: str = "identity", wait: bool = True):
    """Sum a pending ``Partial`` over ``axis`` (P -> R). ``wait=False`` (for program outputs
    only: nothing in the program may read the result) returns before the sum has arrived; the
    runtime calls :func:`~autopar.comm.buckets.wait_outputs` before handing outputs to the user,
    after the backward when it can, so that the loss's all-reduce does not hold up the backward."""
    _check("autopar_all_reduce", backward, ("identity", "all_reduce"))
    ax = _axis(axis)
    if backward == "identity" or ax.size == 1 or x.dtype == torch.bool:
        return D.all_reduce_identity_backward(x, ax, wait)
    return D.AllReduce.apply(x, ax, wait)


def autopar_reduce_scatter(x, *, axis: int, dim: int):
    """Sum a pending ``Partial`` over ``axis`` and keep this rank's block of ``dim`` (P -> S)."""
    return D.ReduceScatter.apply(x, _axis(axis), dim)


def autopar_all_gather(x, *, axis: int, dim: int, backward: str = "slice"):
    """Concatenate the shards of ``dim`` over ``axis`` (S -> R)."""
    _check("autopar_all_gather", backward, ("slice", "reduce_scatter"))
    return D.AllGather.apply(x, _axis(axis), dim, backward)


def autopar_chunk(x, *, axis: int, dim: int, backward: str = "all_gather"):
    """Keep this rank's block of ``dim`` (R -> S, no traffic forward)."""
    _check("autopar_chunk", backward, ("all_gather", "zero_pad"))
    return D.Chunk.apply(x, _axis(axis), dim, backward)


def autopar_all_to_all(x, *, axis: int, dim: int, dim2: int):
    """Re-shard from ``dim`` to ``dim2`` over ``axis`` (S(dim) -> S(dim2))."""
    return D.AllToAll.apply(x, _axis(axis), dim, dim2)


def autopar_to_partial(x, *, axis: int, backward: str = "identity"):
    """Make a replicated tensor a pending sum: coordinate 0 keeps it, the others hold zeros."""
    _check("autopar_to_partial", backward, ("identity", "mask"))
    return D.ToPartial.apply(x, _axis(axis), backward)


def autopar_grad_all_reduce(x, *, axis: int, bucket: bool = True):
    """Identity forward; the gradient is summed over ``axis`` (it arrives as a pending sum). On a
    parameter of a running :class:`~autopar.runtime.program.DistributedModule` the sum is
    bucketed and overlaps the rest of the backward pass (:mod:`autopar.comm.buckets`): that sums
    the parameter's whole gradient, so a parameter of which only some uses pass through here
    (the others hand back whole gradients) says ``bucket=False``."""
    ax = _axis(axis)
    if bucket and _GRAD_HOOKS is not None and ax.size > 1 and x.is_leaf and x.requires_grad:
        hook_parameter(_GRAD_HOOKS, x, ax)
        return x
    return D.GradAllReduce.apply(x, ax)


def autopar_grad_to_partial(x, *, axis: int):
    """Identity forward; the replicated gradient becomes a pending sum (coordinate 0 keeps it)."""
    return D.GradToPartial.apply(x, _axis(axis))


EMITTED = (  # every collective an emitted program may call
    autopar_all_reduce, autopar_reduce_scatter, autopar_all_gather, autopar_chunk, autopar_all_to_all,
    autopar_to_partial, autopar_grad_all_reduce, autopar_grad_to_partial,
)

__all__ = [
    "EMITTED",
    "autopar_all_gather",
    "autopar_all_reduce",
    "autopar_all_to_all",
    "autopar_chunk",
    "autopar_grad_all_reduce",
    "autopar_grad_to_partial",
    "autopar_reduce_scatter",
    "autopar_to_partial",
    "current_mesh",
    "use_mesh",
]
