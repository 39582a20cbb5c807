"""The chunked gated delta rule captured in a graph whose size does not grow with the sequence.

transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid,
...) takes another branch under ``torch.export``: it inverts each chunk's unit lower-triangular
system by forward substitution, a Python loop over the chunk's 64 rows, then scans the chunks
one at a time. Both unroll: about 700 nodes per layer at 1,024 tokens, 65,000 for Qwen3-Next at
full size (its trace alone took 192 s). While :func:`~autopar.passes.capture.scan.parallel_scans`
is active those models call :func:`chunk_gated_delta_rule` instead, with the same steps as the
model's eager branch: the triangular systems are one ``linalg_solve_triangular`` (the branch the
model itself takes outside export), and the scan over chunks is one node, the custom op
``autopar::chunk_delta_scan``. Per chunk ``i``, from the state ``S`` the chunks before it leave::

    v_i = values_i - key_decay_i @ S
    out_i = query_i @ S + intra_i @ v_i
    S <- S * chunk_decay_i + key_i^T @ v_i

``chunk_decay`` is one factor per chunk and head (the gated delta rule) or one per key dim too,
``(batch, heads, chunks, key dim)``: Kimi's delta attention (KDA: Kimi-Linear, Bailing-hybrid,
GLM5-Next), whose ``chunk_kimi_delta_attention`` is replaced the same way by
:func:`chunk_kimi_delta_attention` (its pairwise decays per key dim as the model forms them).
Batch and heads are independent (its sharding rule: :mod:`autopar.passes.rules.scan`).
Its backward runs the chunks in reverse from the states the forward recomputes; it saves only
its inputs. The cost model counts the kernels of both directions
(:data:`autopar.cost_models.compute.COMPOSITES`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def delta_scan_forward(query, key, values, key_decay, intra, chunk_decay, initial_state):
    """``(out, final state, the state before each chunk)`` of the scan over chunks (module
    docstring); tensors ``(batch, heads, chunks, ...)``, ``chunk_decay`` ``(batch, heads, chunks)``."""
    state, outs, states = initial_state, [], []
    for i in range(values.shape[2]):
        states.append(state)
        v_new = values[:, :, i] - key_decay[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * _per_state(chunk_decay[:, :, i]) + key[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, 2), state, states


def _per_state(decay: torch.Tensor) -> torch.Tensor:
    """One chunk's decay, ``(batch, heads)`` or ``(batch, heads, key dim)``, broadcast to the state's
    ``(batch, heads, key dim, value dim)``."""
    return decay[..., None, None] if decay.dim() == 2 else decay[..., None]


def delta_scan_backward(inputs, grad_out, grad_state):
    """Gradients of :func:`delta_scan_forward`'s inputs from those of ``out`` and the final state
    (either may be None): the chunks in reverse, ``G`` the gradient of the state after chunk ``i``."""
    query, key, values, key_decay, intra, chunk_decay, initial_state = inputs
    _, final, states = delta_scan_forward(*inputs)
    grad_out = torch.zeros_like(values) if grad_out is None else grad_out
    g = torch.zeros_like(final) if grad_state is None else grad_state
    grads = {name: [] for name in ("query", "key", "values", "key_decay", "intra", "chunk_decay")}
    for i in reversed(range(values.shape[2])):
        state, d_out = states[i], grad_out[:, :, i]
        v_new = values[:, :, i] - key_decay[:, :, i] @ state
        d_v = intra[:, :, i].transpose(-1, -2) @ d_out + key[:, :, i] @ g
        grads["intra"].append(d_out @ v_new.transpose(-1, -2))
        grads["query"].append(d_out @ state.transpose(-1, -2))
        grads["key"].append(v_new @ g.transpose(-1, -2))
        grads["chunk_decay"].append((state * g).sum((-2, -1) if chunk_decay.dim() == 3 else -1))
        grads["values"].append(d_v)
        grads["key_decay"].append(-(d_v @ state.transpose(-1, -2)))
        g = (g * _per_state(chunk_decay[:, :, i]) + query[:, :, i].transpose(-1, -2) @ d_out
             - key_decay[:, :, i].transpose(-1, -2) @ d_v)
    stacked = {name: torch.stack(parts[::-1], 2) for name, parts in grads.items()}
    return (stacked["query"], stacked["key"], stacked["values"], stacked["key_decay"], stacked["intra"],
            stacked["chunk_decay"], g)


@torch.library.custom_op("autopar::chunk_delta_scan", mutates_args=())
def chunk_delta_scan(query: torch.Tensor, key: torch.Tensor, values: torch.Tensor, key_decay: torch.Tensor,
                     intra: torch.Tensor, chunk_decay: torch.Tensor,
                     initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, final state)`` of the gated delta rule's scan over chunks, one graph node (module
    docstring)."""
    out, state, _ = delta_scan_forward(query, key, values, key_decay, intra, chunk_decay, initial_state)
    return out, state.clone() if state is initial_state else state


@chunk_delta_scan.register_fake
def _chunk_delta_scan_fake(query, key, values, key_decay, intra, chunk_decay, initial_state):
    return torch.empty_like(values), torch.empty_like(initial_state)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out, grad_state):
    return delta_scan_backward(ctx.saved_tensors, grad_out, grad_state)


chunk_delta_scan.register_autograd(_backward, setup_context=_save)


def _l2norm(x: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _chunks(length: int, chunk_size: int, *tensors):
    """``tensors`` (``(batch, heads, length, ...)``) padded with zeros to whole chunks along the
    length and split into ``(batch, heads, chunks, chunk_size, ...)``."""
    pad = (chunk_size - length % chunk_size) % chunk_size
    out = []
    for x in tensors:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        out.append(x.reshape(x.shape[0], x.shape[1], -1, chunk_size, *x.shape[3:]))
    return out


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **_):
    """transformers' ``torch_chunk_gated_delta_rule`` (same signature, same steps as its eager
    branch) with its scan over chunks as :func:`chunk_delta_scan`."""
    initial_dtype = query.dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    if k_heads != v_heads:  # each query/key head serves v_heads // k_heads value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query, -1, 1e-6), _l2norm(key, -1, 1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    key_decay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        state = torch.zeros((batch, v_heads, k_dim, v_dim), dtype=values.dtype, device=values.device)
    else:
        state = initial_state.to(values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    out, state = chunk_delta_scan(query, key, values, key_decay, intra, cum_decay[..., -1].exp(), state)
    out = out.reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, state if output_final_state else None


def chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
    """transformers' ``chunk_kimi_delta_attention`` (same signature, same steps: ``g`` is a log
    decay per token, head and key dim) with its substitution over each chunk's rows as one
    ``linalg_solve_triangular`` and its scan over chunks as :func:`chunk_delta_scan`."""
    initial_dtype = query.dtype
    batch, length, heads, k_dim = key.shape
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:  # the model's own: x / sqrt(sum x^2 + eps)
        query, key = (x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    query, key, value, g, beta = _chunks(length, chunk_size, query, key, value, g, beta)
    k_beta, v_beta = key * beta.unsqueeze(-1), value * beta.unsqueeze(-1)
    g = g.cumsum(dim=-2)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
    system = (k_beta.unsqueeze(-2) * key.unsqueeze(-3) * pairwise).sum(dim=-1)
    intra = (query.unsqueeze(-2) * key.unsqueeze(-3) * pairwise).sum(dim=-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    key_decay = torch.linalg.solve_triangular(system, k_beta * g.exp(), upper=False, unitriangular=True)
    if initial_state is None:
        state = torch.zeros((batch, heads, k_dim, value.shape[-1]), dtype=values.dtype, device=values.device)
    else:
        state = initial_state.to(values)
    last = g[..., -1:, :]
    out, state = chunk_delta_scan(query * g.exp(), key * (last - g).exp(), values, key_decay, intra,
                                  last.squeeze(-2).exp(), state)
    out = out.reshape(batch, heads, -1, out.shape[-1])[:, :, :length]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, state if output_final_state else None


__all__ = ["chunk_delta_scan", "chunk_gated_delta_rule", "chunk_kimi_delta_attention", "delta_scan_backward", "delta_scan_forward"]
