"""Collectives as autograd functions whose backward is chosen, not implied.

The right adjoint of a collective depends on what gradient arrives from its consumers (whole
and replicated, or still a pending sum), which only the code generator knows, so each function
takes its backward as an argument (``backward=``) where there is a choice. Every function takes
``ax``, an :class:`~autopar.comm.mesh.AxisGroup`, and keeps it for its backward, which may run
after the program has returned. :mod:`autopar.comm.collectives` says which backward each choice
means.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from autopar.comm.buckets import sum_in_place
from autopar.comm.mesh import AxisGroup
from autopar.comm.plain import all_gather, all_reduce, all_to_all, chunk, keep_on_first, reduce_scatter, zero_pad
from autopar.comm.regather import note, regather_source


def all_reduce_identity_backward(x: torch.Tensor, ax: AxisGroup, wait: bool) -> torch.Tensor:
    """``x`` summed over the axis, the gradient passed through unchanged (Megatron's g). Autograd
    sees a clone (a C++ node) and the sum is written into it in place: cheaper than a Python
    autograd function. ``wait``: see :func:`~autopar.comm.buckets.sum_in_place`."""
    if ax.size == 1:
        return x
    if x.dtype == torch.bool:
        return all_reduce(x, ax)
    out = x.clone(memory_format=torch.contiguous_format)
    sum_in_place(out.detach(), ax, wait)  # a detached alias: writing the sum records nothing
    return out


class AllReduce(Function):
    """P -> R whose gradient is still a pending sum: the backward all-reduces it too."""

    @staticmethod
    def forward(ctx, x, ax, wait):
        ctx.ax = ax
        out = x.clone(memory_format=torch.contiguous_format)
        sum_in_place(out.detach(), ax, wait)  # a detached alias: writing the sum records nothing
        return out

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.ax), None, None


class ReduceScatter(Function):
    """P -> S(dim); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, ax, dim):
        ctx.ax, ctx.dim = ax, dim
        return reduce_scatter(x, ax, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.ax, ctx.dim), None, None


class AllGather(Function):
    """S(dim) -> R; backward ``"slice"`` or ``"reduce_scatter"``. A gathered sharded parameter
    is noted to be gathered again in backward (:mod:`autopar.comm.regather`)."""

    @staticmethod
    def forward(ctx, x, ax, dim, backward):
        ctx.ax, ctx.dim, ctx.backward = ax, dim, backward
        out = all_gather(x, ax, dim)
        source = regather_source(x)
        if source is not None and ax.size > 1:  # a sharded parameter: gathered again in backward
            note(out, lambda: all_gather(source(), ax, dim))
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.backward == "reduce_scatter":
            return reduce_scatter(g, ctx.ax, ctx.dim), None, None, None
        return chunk(g, ctx.ax, ctx.dim), None, None, None


class Chunk(Function):
    """R -> S(dim); backward ``"all_gather"`` or ``"zero_pad"``."""

    @staticmethod
    def forward(ctx, x, ax, dim, backward):
        ctx.ax, ctx.dim, ctx.backward = ax, dim, backward
        return chunk(x, ax, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.backward == "zero_pad":
            return zero_pad(g, ctx.ax, ctx.dim), None, None, None
        return all_gather(g, ctx.ax, ctx.dim), None, None, None


class AllToAll(Function):
    """S(dim) -> S(dim2); backward all-to-all back."""

    @staticmethod
    def forward(ctx, x, ax, dim, dim2):
        ctx.ax, ctx.dim, ctx.dim2 = ax, dim, dim2
        return all_to_all(x, ax, dim, dim2)

    @staticmethod
    def backward(ctx, g):
        return all_to_all(g, ctx.ax, ctx.dim2, ctx.dim), None, None, None


class ToPartial(Function):
    """R -> P (coordinate 0 keeps the value); backward ``"identity"`` or ``"mask"``."""

    @staticmethod
    def forward(ctx, x, ax, backward):
        ctx.ax, ctx.backward = ax, backward
        return keep_on_first(x, ax).clone()

    @staticmethod
    def backward(ctx, g):
        return (keep_on_first(g, ctx.ax) if ctx.backward == "mask" else g), None, None


class GradAllReduce(Function):
    """Identity forward; backward all-reduces (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, ax):
        ctx.ax = ax
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.ax), None


class GradToPartial(Function):
    """Identity forward; backward keeps the gradient at coordinate 0 (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, x, ax):
        ctx.ax = ax
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return keep_on_first(g, ctx.ax), None


__all__ = ["AllGather", "AllReduce", "AllToAll", "Chunk", "GradAllReduce", "GradToPartial", "ReduceScatter",
           "ToPartial", "all_reduce_identity_backward"]
