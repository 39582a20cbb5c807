"""Sharding rules for ``aten.scaled_dot_product_attention``.

Shapes: q ``[..., Hq, L, E]``, k ``[..., Hkv, S, E]``, v ``[..., Hkv, S, Ev]``, optional
``attn_mask`` broadcastable to ``[..., Hq, L, S]``; output ``[..., Hq, L, Ev]``. One mesh axis can

- shard a batch dim, or the head dim (q on Hq, k/v on Hkv). With GQA (``enable_gqa``, Hq a
  multiple of Hkv) a rank's q heads ``[r·Hq/n, (r+1)·Hq/n)`` use exactly the kv heads
  ``[r·Hkv/n, (r+1)·Hkv/n)`` when n divides Hkv, which the registry's evenness filter ensures;
- shard the query sequence L (k/v replicated): each query row attends over all keys, so this is
  exact with an explicit mask (sharded on its L dim). With ``is_causal=True`` the plain op would
  build its causal mask from the shard's own row numbers, so that option names the local
  implementation ``"causal_rows"``: the rank passes the rows ``[start, stop)`` of the global
  causal mask (key ``j`` allowed for query ``i`` iff ``j <= i``) explicitly;
- shard v's feature dim Ev (output sharded on it), or take v ``Partial`` (output ``Partial``):
  attention is linear in v.

The mask follows q where it has the dim (size 1 broadcasts: replicated). Sharding the key
sequence S needs online-softmax rescaling (ring attention) and E is inside the softmax: neither
is offered. Dropout draws different random masks per rank, so with ``dropout_p > 0`` the options
agree in distribution only; the checker runs with ``dropout_p = 0``.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec, TensorMeta
from autopar.core.layout import LocalContext
from autopar.core.placement import P, Placement, R, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


def _mask_placement(mask: TensorMeta, dim: int, ndim: int, size: int) -> Placement:
    """The mask's placement when q's (and the output's) dim ``dim`` of ``size`` is sharded."""
    mdim = dim - (ndim - mask.ndim)
    if mdim >= 0 and mask.shape[mdim] == size:
        return Shard(mdim)
    return R


def causal_rows_attention(op, args, kwargs, ctx: LocalContext) -> torch.Tensor:
    """One rank's causal attention on the query rows ``[start, stop)`` it holds (k/v whole).

    ``is_causal=True`` means the top-left-aligned mask ``tril(ones(L, S))``; the rank builds its
    rows of that mask and calls the op with it instead of ``is_causal``.
    """
    q, k, v = args[:3]
    dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    rest = {key: val for key, val in kwargs.items() if key in ("scale", "enable_gqa")}
    start = ctx.inputs[0].starts[q.ndim - 2]
    rows = torch.arange(start, start + q.shape[-2], device=q.device).unsqueeze(1)
    mask = torch.arange(k.shape[-2], device=q.device).unsqueeze(0) <= rows
    return op(q, k, v, mask, dropout_p, False, **rest)


def _sdpa_samples():
    def r(*shape):  # float64: random Partial addends make float32 rounding reach the tolerance
        return torch.randn(*shape, dtype=torch.float64)

    b, h, s, d = 8, 8, 8, 4
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, 8)), {"is_causal": True}
    yield (r(b, 8, s, d), r(b, 2, 16, d), r(b, 2, 16, d), None, 0.0, True), {"enable_gqa": True}
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, d), r(b, 1, s, s)), {"scale": 0.3}
    yield (r(b, h, s, d), r(b, h, s, d), r(b, h, s, d)), {"attn_mask": r(s, s) > 0}
    yield (r(b, 8, s, d), r(b, 2, s, d), r(b, 2, s, d)), {"enable_gqa": True}  # GQA 8/2
    yield (r(b, 8, s, d), r(b, 8, s, d), r(b, 8, s, d), r(1, 8, s, s)), {}
    yield (r(h, s, d), r(h, s, d), r(h, s, d)), {}


@register(
    aten.scaled_dot_product_attention.default,
    samples=_sdpa_samples,
    local_ops={"causal_rows": causal_rows_attention},
)
def _sdpa(spec: OpSpec) -> list[AxisOption]:
    q, k, v, *rest = spec.inputs
    mask = rest[0] if rest else None
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
    # query-sequence sharding (with is_causal the ranks pass their rows of the causal mask)
    mp = _mask_placement(mask, n - 2, n, q.shape[n - 2]) if mask is not None else None
    seq = option(Shard(n - 2), R, R, mp, Shard(n - 2))
    options.append(AxisOption(seq.inputs, seq.outputs, local="causal_rows") if is_causal else seq)
    options.append(option(R, R, Shard(n - 1), R, Shard(n - 1)))  # v's feature dim
    if v.dtype.is_floating_point:
        options.append(option(R, R, P, R, P))  # linear in v
    return options
