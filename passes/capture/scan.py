"""Linear recurrences captured as one scan node: a graph whose size does not grow with the
sequence length.

Models whose forward loops over time steps (transformers' Mamba selective scan, ``for index in
range(seq_len): h = a[t] * h + b[t]``) unroll under ``torch.export``: about a dozen ops per token
and layer, 330,000 nodes for Mamba-130m at 1,024 tokens (export alone took 90 s). While
:func:`parallel_scans` is active those recurrences call :func:`linear_scan` instead, the custom
op ``autopar::linear_scan(a, b, dim)``: ``h_t = a_t * h_{t-1} + b_t`` along ``dim``, one node in
the captured graph whatever the length. The time dim is the scan and every other dim independent
(its sharding rule: :mod:`autopar.passes.rules.scan`). It runs as :func:`odd_even_scan`, a
work-efficient (Blelloch-style) parallel scan: pairs of steps combine into one step of a scan
half as long (``a' = a_odd * a_even``, ``b' = a_odd * b_even + b_odd``), that scan gives the odd
states and one multiply-add the even ones, so O(log L) levels of views and pointwise kernels
(the cost model prices those kernels: :data:`autopar.cost_models.compute.COMPOSITES`). Its
backward is the same scan in reverse (``g_t = dh_t + a_{t+1} g_{t+1}``, ``da_t = g_t h_{t-1}``,
``db_t = g_t``), saving only ``a`` and ``h``. The result equals the loop's up to rounding
(products associate differently); tests/test_scan.py states by how much.

Covered: every transformers module that defines ``mamba_selective_scan`` with the Mamba
signature (Mamba, Falcon-Mamba, Jamba, Zamba): its recurrent branch, the one taken on CPU and
under export, is replaced; every module class with the RG-LRU's ``_rnn_scan`` (RecurrentGemma):
its loop over the sequence; every module that defines ``torch_chunk_gated_delta_rule``
(Qwen3-Next and its kin) or ``chunk_kimi_delta_attention`` (Kimi-Linear and its kin): its scan
over chunks, as :mod:`autopar.passes.capture.delta_rule` says; RWKV's ``rwkv_linear_attention``: its loop as one node (:mod:`autopar.passes.capture.wkv`).
The model's functions are restored when the context exits.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
import torch.nn.functional as F

from autopar.passes.capture.delta_rule import chunk_gated_delta_rule, chunk_kimi_delta_attention
from autopar.passes.capture.replaced import REPLACED, own
from autopar.passes.capture.wkv import rwkv_linear_attention

def odd_even_scan(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Every ``h_t = a_t * h_{t-1} + b_t`` along ``dim`` from ``h_{-1} = 0`` (``a`` and ``b``
    of one shape), in O(log L) levels of views and pointwise ops (module docstring)."""
    dim = dim % a.dim()
    n = a.shape[dim]
    if n == 1:
        return b.to(torch.result_type(a, b), copy=True)  # a new tensor, as every longer scan gives
    if n % 2:  # the last step on its own, after the even-length scan before it
        h = odd_even_scan(a.narrow(dim, 0, n - 1), b.narrow(dim, 0, n - 1), dim)
        last = a.narrow(dim, n - 1, 1) * h.narrow(dim, n - 2, 1) + b.narrow(dim, n - 1, 1)
        return torch.cat([h, last], dim)
    pairs_a, pairs_b = a.unflatten(dim, (n // 2, 2)), b.unflatten(dim, (n // 2, 2))
    a_even, a_odd = pairs_a.select(dim + 1, 0), pairs_a.select(dim + 1, 1)
    b_even, b_odd = pairs_b.select(dim + 1, 0), pairs_b.select(dim + 1, 1)
    odd = odd_even_scan(a_odd * a_even, a_odd * b_even + b_odd, dim)  # h_1, h_3, ...
    before = torch.cat([torch.zeros_like(odd.narrow(dim, 0, 1)), odd.narrow(dim, 0, n // 2 - 1)], dim)
    even = a_even * before + b_even  # h_0 = b_0, h_2 = a_2 h_1 + b_2, ...
    return torch.stack([even, odd], dim + 1).flatten(dim, dim + 1)


@torch.library.custom_op("autopar::linear_scan", mutates_args=())
def linear_scan(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """``h_t = a_t * h_{t-1} + b_t`` along ``dim`` from ``h_{-1} = 0``, one graph node (module
    docstring); ``a`` and ``b`` of one shape."""
    if a.shape != b.shape:
        raise ValueError(f"linear_scan: a and b must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return odd_even_scan(a, b, dim).contiguous()


@linear_scan.register_fake
def _linear_scan_fake(a, b, dim):
    return torch.empty_like(b, dtype=torch.result_type(a, b), memory_format=torch.contiguous_format)


def _save(ctx, inputs, output):
    a, b, dim = inputs
    ctx.save_for_backward(a, output)
    ctx.dim, ctx.b_dtype = dim % a.dim(), b.dtype


def _backward(ctx, grad):
    """The gradient flows back as a scan in reverse: ``g_t = grad_t + a_{t+1} g_{t+1}``; then
    ``db_t = g_t`` and ``da_t = g_t h_{t-1}``."""
    a, h = ctx.saved_tensors
    dim, n = ctx.dim, a.shape[ctx.dim]
    later = torch.cat([a.narrow(dim, 1, n - 1), torch.zeros_like(a.narrow(dim, 0, 1))], dim)
    g = linear_scan(later.flip(dim), grad.flip(dim), dim).flip(dim)
    before = torch.cat([torch.zeros_like(h.narrow(dim, 0, 1)), h.narrow(dim, 0, n - 1)], dim)
    return (g * before).to(a.dtype), g.to(ctx.b_dtype), None


linear_scan.register_autograd(_backward, setup_context=_save)


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, **_):
    """transformers' ``mamba_selective_scan`` (same signature, same steps) with its per-token
    loop replaced by :func:`linear_scan` over the (batch, channels, time, state) tensors."""
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    states = linear_scan(discrete_A, deltaB_u, dim=2)  # (batch, channels, time, state)
    scan_output = torch.matmul(states.transpose(1, 2).to(input_dtype), C.unsqueeze(-1)).squeeze(-1).transpose(1, 2)
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    return (scan_output, states[:, :, -1]) if return_last_state else scan_output


def rnn_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
    """transformers' RG-LRU ``_rnn_scan`` (RecurrentGemma; same signature and results) with its
    per-token loop over ``(batch, time, width)`` replaced by :func:`linear_scan`; one token
    (decoding) runs the model's own."""
    if hidden_states.shape[1] == 1:
        return own(rnn_scan, type(self))(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    a = (recurrent_gate * ~reset).type(acc_dtype)
    b = hidden_states.type(acc_dtype)
    if recurrent_states is not None:  # the state carried in: the first step starts from it
        b = torch.cat([b[:, :1] + a[:, :1] * recurrent_states[:, None].to(a.device), b[:, 1:]], dim=1)
    states = linear_scan(a, b, dim=1)
    return states.type(hidden_states.dtype), states[:, -1]


SELECTIVE_SCAN, RNN_SCAN = "mamba_selective_scan", "_rnn_scan"  # what transformers' models call
CHUNK_DELTA, CHUNK_KDA, WKV = "torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "rwkv_linear_attention"
_SIGNATURES = {  # name -> (its leading parameters, the replacement)
    SELECTIVE_SCAN: (("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                      "return_last_state"), selective_scan),
    RNN_SCAN: (("self", "hidden_states", "recurrent_gate", "reset", "recurrent_states", "acc_dtype"), rnn_scan),
    CHUNK_DELTA: (("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                   "use_qk_l2norm_in_kernel"), chunk_gated_delta_rule),
    CHUNK_KDA: (("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel"), chunk_kimi_delta_attention),
    WKV: (("time_decay", "time_first", "key", "value", "state", "return_state"), rwkv_linear_attention),
}


def recurrences(model) -> list[tuple[object, str]]:
    """``(owner, name)`` of every recurrence of ``model`` that :func:`parallel_scans` replaces: a
    Python module defining its classes and a Mamba ``mamba_selective_scan``, a chunked gated
    delta rule or RWKV's WKV, a module class with an RG-LRU ``_rnn_scan``."""
    owners = [sys.modules.get(name) for name in sorted({type(m).__module__ for m in model.modules()})]
    owners += list(dict.fromkeys(type(m) for m in model.modules()))
    out = []
    for owner in owners:
        for name, (params, replacement) in _SIGNATURES.items():
            fn = getattr(owner, name, None) if isinstance(owner, type) == (name == RNN_SCAN) else None
            if fn is None or fn is replacement or (owner, name) in REPLACED:
                continue
            if tuple(inspect.signature(fn).parameters)[: len(params)] == params:
                out.append((owner, name))
    return out


@contextlib.contextmanager
def parallel_scans(model):
    """While active, ``model``'s time-step recurrences (module docstring) run as parallel scans;
    the model's own functions are restored afterwards. Anything else is left alone."""
    found = recurrences(model) if isinstance(model, torch.nn.Module) else []
    try:
        for owner, name in found:
            REPLACED[owner, name] = getattr(owner, name), _SIGNATURES[name][1]
            setattr(owner, name, _SIGNATURES[name][1])
        yield
    finally:
        for owner, name in found:
            setattr(owner, name, REPLACED.pop((owner, name))[0])


__all__ = ["CHUNK_DELTA", "CHUNK_KDA", "RNN_SCAN", "SELECTIVE_SCAN", "WKV", "linear_scan", "odd_even_scan", "parallel_scans",
           "recurrences", "rnn_scan",
           "selective_scan"]
