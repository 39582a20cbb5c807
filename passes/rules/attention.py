"""Sharding rules for ``aten.scaled_dot_product_attention``.

Shapes: q ``[..., Hq, L, E]``, k ``[..., Hkv, S, E]``, v ``[..., Hkv, S, Ev]``, optional
``attn_mask`` broadcastable to ``[..., Hq, L, S]``; output ``[..., Hq, L, Ev]``. One mesh axis can

- shard a batch dim, or the head dim (q on Hq, k/v on Hkv). With GQA (``enable_gqa``, Hq a
  multiple of Hkv) a rank's q heads ``[r·Hq/n, (r+1)·Hq/n)`` use exactly the kv heads
  ``[r·Hkv/n, (r+1)·Hkv/n)`` when n divides Hkv, which the registry's evenness filter ensures;
- shard the query sequence L (k/v replicated): each query row attends over all keys, so this is
  exact with an explicit mask (sharded on its L dim) but not with ``is_causal=True``, whose
  local mask would be aligned to the shard, not to the global positions: not offered then;
- shard v's feature dim Ev (output sharded on it), or take v ``Partial`` (output ``Partial``):
  attention is linear in v.

The mask follows q where it has the dim (size 1 broadcasts: replicated). Sharding the key
sequence S needs online-softmax rescaling (ring attention) and E is inside the softmax: neither
is offered. Dropout draws different random masks per rank, so with ``dropout_p > 0`` the options
agree in distribution only; the checker runs with ``dropout_p = 0``.
"""

from __future__ import annotations

import torch

from autopar.placement import P, R, Placement, Shard
from autopar.passes.rules.registry import AxisOption, OpSpec, TensorMeta, register

aten = torch.ops.aten


def _mask_placement(mask: TensorMeta, dim: int, ndim: int, size: int) -> Placement:
    """The mask's placement when q's (and the output's) dim ``dim`` of ``size`` is sharded."""
    mdim = dim - (ndim - mask.ndim)
    if mdim >= 0 and mask.shape[mdim] == size:
        return Shard(mdim)
    return R


def _sdpa_samples():
    def r(*shape):  # float64: random Partial addends make float32 rounding reach the tolerance
        return torch.randn(*shape, dtype=torch.float64)

    b, h, s, d = 8, 8, 8, 4
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, d)), {}
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, 8)), {"is_causal": True}
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, d), r(b, 1, s, s)), {"scale": 0.3}
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, d)), {"attn_mask": r(s, s) > 0}
    yield (r(b, 8, s, d), r(b, 2, s, d), r(b, 2, s, d)), {"enable_gqa": True}  # GQA 8/2
    yield (r(b, 8, s, d), r(b, 8, s, d), r(b, 8, s, d), r(1, 8, s, s)), {}
    yield (r(h, s, d), r(h, s, d), r(h, s, d)), {}


@register(aten.scaled_dot_product_attention.default, samples=_sdpa_samples)
def _sdpa(spec: OpSpec) -> list[AxisOption]:
    q, k, v, *rest = spec.inputs
    mask = rest[0] if rest else None
    out = spec.outputs[0]
    n = q.ndim
    if not (k.ndim == v.ndim == n >= 2):
        return []
    is_causal = bool(spec.arg(5, "is_causal", False))

    def option(qp, kp, vp, mp, op):
        ins = (qp, kp, vp) + ((mp,) if mask is not None else ())
        return AxisOption(ins, (op,))

    options = []
    for d in range(n - 2):  # batch dims, and the head dim (GQA: Hq and Hkv differ)
        size = q.shape[d]
        if size == 1:
            continue
        head_dim = d == n - 3
        kv = []
        for t in (k, v):
            if t.shape[d] == size or (head_dim and t.shape[d] > 1):
                kv.append(Shard(d))
            elif t.shape[d] == 1:
                kv.append(R)  # broadcast
            else:
                break
        if len(kv) < 2:
            continue
        mp = _mask_placement(mask, d, n, size) if mask is not None else None
        options.append(option(Shard(d), kv[0], kv[1], mp, Shard(d)))
    if not is_causal:  # query-sequence sharding
        mp = _mask_placement(mask, n - 2, n, q.shape[n - 2]) if mask is not None else None
        options.append(option(Shard(n - 2), R, R, mp, Shard(n - 2)))
    options.append(option(R, R, Shard(n - 1), R, Shard(n - 1)))  # v's feature dim
    if v.dtype.is_floating_point:
        options.append(option(R, R, P, R, P))  # linear in v
    return options
