"""RWKV's time-mixing recurrence (WKV) captured as one node: ``autopar::wkv``.

transformers' ``rwkv_linear_attention`` runs, without its CUDA kernel, a Python loop over the
sequence: about 16 ops per token and layer, some 500,000 nodes for full-size RWKV at 1,024 tokens
(its planning row was cut off after 7 minutes). While :func:`~autopar.passes.capture.scan.parallel_scans` is active
it calls :func:`rwkv_linear_attention` instead, which runs the same loop, the same steps in the
same order (so the same numbers), inside the custom op ``autopar::wkv``: one graph node at any
length. Per channel ``c``, with ``w = -exp(time_decay)`` and ``u = time_first``::

    out_t = (num + e^(u + k_t) v_t) / (den + e^(u + k_t))
    num <- e^w num + e^(k_t) v_t,   den <- e^w den + e^(k_t)

kept in a scaled form with a running maximum exponent, as the model does. Batch and channels are
independent (its sharding rule: :mod:`autopar.passes.rules.scan`). The op saves its inputs; its
backward runs the loop again under autograd and differentiates it, so the gradients are those
of the model's loop. A state carried in or out (generation) runs the model's own function.
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.passes.capture.replaced import own


def wkv_loop(time_decay, time_first, key, value) -> torch.Tensor:
    """The WKV outputs of ``key`` and ``value`` (batch, time, channels) from a zero state, step
    by step in the scaled form (module docstring)."""
    num = torch.zeros_like(key[:, 0], dtype=torch.float32)
    den = torch.zeros_like(key[:, 0], dtype=torch.float32)
    top = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38  # the running maximum exponent
    decay = -torch.exp(time_decay)
    outs = []
    for k, v in zip(key.float().unbind(1), value.unbind(1)):  # unbind: one gradient op, not one per step
        now = torch.maximum(top, k + time_first)
        e1, e2 = torch.exp(top - now), torch.exp(k + time_first - now)
        outs.append(((e1 * num + e2 * v) / (e1 * den + e2)).to(key.dtype))
        later = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - later), torch.exp(k - later)
        num, den, top = e1 * num + e2 * v, e1 * den + e2, later
    return torch.stack(outs, 1)


def wkv_backward(inputs, grad) -> tuple:
    """Gradients of :func:`wkv_loop`'s inputs: the loop run again under autograd."""
    leaves = [x.detach().requires_grad_(x.dtype.is_floating_point) for x in inputs]
    with torch.enable_grad():
        out = wkv_loop(*leaves)
    wanted = [x for x in leaves if x.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    return tuple(next(grads) if x.requires_grad else None for x in leaves)


def wkv_unit(args: tuple) -> list[tuple[tuple, int, int]]:
    """:func:`wkv_loop` (and its backward) counted from pieces of one channel, 1 or 2 rows and
    2 or 3 steps (``(arguments, weight, kernels' weight)``, for the cost model). Each kernel is
    elementwise over channels, and over rows too or per channel alone (the decay), and every step
    after the first runs the same kernels (the first starts from a state needing no gradient): so
    a count over ``B`` rows, ``T >= 2`` steps and ``C`` channels is ``C (y(T) + B x(T))`` with ``x``
    and ``y`` linear in ``T``, and the kernels are linear in ``T`` alone. A quantity linear in ``n``
    is ``(a + 1 - n)`` times its value at ``a`` plus ``(n - a)`` times its value at ``a + 1``.
    One step: the op itself, counted whole."""
    time_decay, time_first, key, value = args
    rows, steps, channels = key.shape
    if steps < 2:
        return [(args, 1, 1)]
    at = lambda n, a, point: (a + 1 - n) if point == a else (n - a)
    out = []
    for b in (1, 2):
        for t in (2, 3):
            piece = (dataclasses.replace(time_decay, shape=(1,)), dataclasses.replace(time_first, shape=(1,)),
                     dataclasses.replace(key, shape=(b, t, 1)), dataclasses.replace(value, shape=(b, t, 1)))
            out.append((piece, channels * at(rows, 1, b) * at(steps, 2, t), at(steps, 2, t) if b == 1 else 0))
    return out


@torch.library.custom_op("autopar::wkv", mutates_args=())
def wkv(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """RWKV's WKV over ``key`` and ``value`` (batch, time, channels), one graph node."""
    return wkv_loop(time_decay, time_first, key, value)


@wkv.register_fake
def _wkv_fake(time_decay, time_first, key, value):
    return torch.empty_like(key)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return wkv_backward(ctx.saved_tensors, grad)


wkv.register_autograd(_backward, setup_context=_save)


def rwkv_linear_attention(time_decay, time_first, key, value, state=None, return_state=False):
    """transformers' ``rwkv_linear_attention`` (same signature and results) as :func:`wkv`; with
    a state in or out, or one token, the model's own."""
    if state is not None or return_state or key.shape[1] == 1:
        return own(rwkv_linear_attention)(time_decay, time_first, key, value, state=state, return_state=return_state)
    return wkv(time_decay, time_first, key, value), None


__all__ = ["rwkv_linear_attention", "wkv", "wkv_backward", "wkv_loop", "wkv_unit"]
