"""Routed experts captured as a dense dispatch that traces with static shapes (expert parallelism).

transformers 5 runs every experts class decorated with ``use_experts_implementation``
(Mixtral, Qwen2-MoE, OLMoE, ...) through ``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]``
with ``forward(self, hidden_states (N, M), top_k_index (N, k), top_k_weights (N, k))``. Its
implementations sort the rows by expert, a data-dependent split that no sharding can cut by
expert. While :func:`dense_experts` is active those modules run :func:`dense_experts_forward`,
a GShard-style dispatch: the N tokens as G groups of n = N / G (G = the batch, so groups shard
with data parallelism; G = 1 when N does not divide), each token's slot in its expert by a
cumsum of the one-hot routing, then::

    dispatched = einsum("gnec,gnm->egcm", dispatch, x)     # (E, G, C, M)
    out        = experts(dispatched)                         # batched matmuls over E
    y          = einsum("gnec,egcm->gnm", combine, out)      # combine weighted by top_k_weights

Experts stacked on E make expert parallelism a sharding of E (weights and activations), and the
change from the G-sharded tokens to E-sharded slots an all-to-all.

**Capacity.** With ``capacity_factor=None`` (the default) C = n: no expert can get more than n
tokens of a group, nothing is dropped and the result equals the model's up to summation order.
With a factor f, C = min(n, max(1, ceil(f * n * k / E))) and an expert takes at most C tokens
per group: first the tokens choosing it as first choice in token order, then as second choice,
and so on; a (token, choice) past capacity is dropped (it adds nothing to that token's output,
as in GShard). A token choosing one expert twice takes one slot, its weights summed. The
model's own forward is restored when the context exits.

Exact capacity pads the experts' matmuls to E/k times the routed tokens; ``autopar.compile``
under ``Options(moe_dispatch="auto")`` plans this capture and the model's own and keeps the
faster plan.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils import _pytree as pytree

from autopar.core.errors import InputError

KEY = "autopar_dense"  # the experts implementation's name while capturing
DISPATCHES = ("dense", "sorted")  # dense: this module's dispatch; sorted: the model's own
_SETTINGS: dict = {}  # groups and capacity factor of the active dense_experts context


def capacity(tokens: int, *, top_k: int, experts: int, capacity_factor: float | None) -> int:
    """Slots per expert and group of ``tokens`` tokens (module docstring)."""
    if capacity_factor is None:
        return tokens
    return min(tokens, max(1, math.ceil(capacity_factor * tokens * top_k / experts)))


def routing(top_k_index, top_k_weights, *, experts: int, slots: int):
    """``(dispatch, combine)``, each (G, n, E, C), from (G, n, k) expert ids and weights:
    ``dispatch`` 1 where a token takes slot c of expert e, ``combine`` its routing weight there.
    A token choosing one expert twice (hash routing) takes one slot with the weights summed."""
    groups, tokens, k = top_k_index.shape
    device = top_k_index.device
    ids = torch.arange(experts, device=device)
    mask = (top_k_index.unsqueeze(-1) == ids).float()  # (G, n, k, E); counts in fp32 are exact
    new = mask * (torch.cumsum(mask, dim=2) == mask).float()  # the token's first choice of that expert
    # slots in order of choice, then token: a cumsum over the choice-major (G, k * n, E)
    order = new.transpose(1, 2).reshape(groups, k * tokens, experts)
    position = (torch.cumsum(order, dim=1) - 1).reshape(groups, k, tokens, experts).transpose(1, 2)
    slot, seen = (new * position).sum(dim=2), new.sum(dim=2)  # (G, n, E)
    weight = (top_k_weights.unsqueeze(-1) * mask.to(top_k_weights.dtype)).sum(dim=2)
    slot_ids = torch.arange(slots, device=device, dtype=torch.float32)
    dispatch = (seen * (slot < slots).float()).unsqueeze(-1) * (slot.unsqueeze(-1) == slot_ids).float()
    return dispatch, weight.unsqueeze(-1) * dispatch.to(weight.dtype)


def _linear(x, weight, bias, transposed: bool):
    """Per-expert ``x @ W`` on (E, G, C, in) with weight (E, out, in), or (E, in, out) transposed."""
    out = torch.einsum("egci,eio->egco" if transposed else "egci,eoi->egco", x, weight)
    return out if bias is None else out + bias[:, None, None, :]


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts of ``self`` on a dense dispatch (module docstring); same signature and
    result as transformers' experts implementations."""
    tokens, width = hidden_states.shape
    k = top_k_index.shape[-1]
    groups = _SETTINGS.get("groups", 1)
    groups = groups if groups >= 1 and tokens % groups == 0 else 1
    n = tokens // groups
    slots = capacity(n, top_k=k, experts=self.num_experts, capacity_factor=_SETTINGS.get("capacity_factor"))
    dispatch, combine = routing(top_k_index.reshape(groups, n, k), top_k_weights.reshape(groups, n, k),
                                experts=self.num_experts, slots=slots)
    x = torch.einsum("gnec,gnm->egcm", dispatch.to(hidden_states.dtype), hidden_states.reshape(groups, n, width))
    up = "gate_up_proj" if self.has_gate else "up_proj"
    h = _linear(x, getattr(self, up), getattr(self, f"{up}_bias") if self.has_bias else None, self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _linear(h, self.down_proj, self.down_proj_bias if self.has_bias else None, self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        h = self.post_expert_norm(h)
    y = torch.einsum("gnec,egcm->gnm", combine, h.to(combine.dtype))
    return y.reshape(tokens, width).to(hidden_states.dtype)


def batch_size(args, kwargs) -> int:
    """The first dim of the first example input with one (the token groups), else 1."""
    leaves = pytree.tree_leaves((args, kwargs))
    return next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 1), 1)


def routed_experts(model) -> list:
    """The modules of ``model`` that transformers' experts interface dispatches (none for
    anything but a module: capture says what is wrong with it)."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(m, "num_experts") and hasattr(m, "down_proj")
            and hasattr(getattr(m, "config", None), "_experts_implementation_internal")]


def dense_work(model, *, capacity_factor: float | None = None) -> dict[str, float]:
    """Module path -> a factor no larger than the dense dispatch's expert work over the model's
    own, for each of ``model``'s routed experts modules. The model's own dispatch runs each
    token's k routed rows, the dense one E x C slots per group of n tokens: E C / (n k), at least
    min(E / k, capacity factor) (:func:`capacity`), k the config's ``num_experts_per_tok``; 0
    where that is not set."""
    out, routed = {}, {id(m) for m in routed_experts(model)}
    for path, module in model.named_modules():
        if id(module) in routed:
            top_k = getattr(module.config, "num_experts_per_tok", None)
            known = isinstance(top_k, int) and 0 < top_k <= module.num_experts
            out[path] = min(module.num_experts / top_k, capacity_factor or math.inf) if known else 0.0
    return out


def traced_experts(model, *, dispatch: str, groups: int, capacity_factor: float | None = None):
    """A context in which ``model``'s routed experts run as ``dispatch`` says (:data:`DISPATCHES`)."""
    if dispatch not in DISPATCHES:
        raise InputError(f"moe_dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if dispatch == "sorted":
        return contextlib.nullcontext()
    return dense_experts(model, groups=groups, capacity_factor=capacity_factor)


@contextlib.contextmanager
def dense_experts(model, *, groups: int, capacity_factor: float | None = None):
    """While active, ``model``'s transformers experts run :func:`dense_experts_forward` with
    ``groups`` token groups; the model's own implementation setting is restored afterwards.
    A model without such experts (or without transformers) is left alone."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise InputError(f"moe_capacity_factor must be positive or None (no token dropped), got {capacity_factor}")
    modules = routed_experts(model)
    if not modules:
        yield
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    configs = {id(m.config): m.config for m in modules}
    before = {key: c._experts_implementation_internal for key, c in configs.items()}
    outer = dict(_SETTINGS)  # a capture inside a capture gets its own settings back
    ALL_EXPERTS_FUNCTIONS[KEY] = dense_experts_forward
    _SETTINGS.update(groups=groups, capacity_factor=capacity_factor)
    try:
        for c in configs.values():
            c._experts_implementation_internal = KEY
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation_internal = before[key]
        _SETTINGS.clear()
        _SETTINGS.update(outer)
        if not outer:
            del ALL_EXPERTS_FUNCTIONS[KEY]


__all__ = ["DISPATCHES", "batch_size", "capacity", "dense_experts", "dense_experts_forward", "dense_work",
           "routed_experts", "routing", "traced_experts"]
