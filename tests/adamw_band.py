"""How the distributed tests judge parameters trained with AdamW: against float64, within fp32's
own noise.

AdamW's step ``lr * g / (|g| + eps)`` turns fp32 rounding in a gradient near ``eps`` (or exactly
zero in exact arithmetic, like the key bias of attention: softmax ignores a per-query constant)
into up to ``lr`` in the parameter, and later steps spread it. The fp32 one-process run is then
itself not within 1e-6 of the truth, so a distributed run (other summation orders) is compared
with a float64 one-process run instead, inside a band set by fp32's measured noise: how far the
one-process fp32 runs over other orders of the batch rows (the same mathematics, other summation
orders; every order up to 4 rows, 24 random ones beyond) land from float64. A wrong gradient, a parameter stepped twice or a mis-sharded optimizer
state moves parameters by about ``lr``, far outside that band.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autopar.testing import run_reference

RTOL, ATOL = 1e-5, 1e-6
NOISE_FACTOR = 8.0  # the band is this many times the measured noise (worst seen: 5.1)


def _to64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def adamw_truth(model, *, inputs, target=None, loss_fn=None, steps: int, optimizer, lr: float):
    """``(float64 parameters after training, fp32 noise)`` of ``model`` on one batch."""
    _, p64 = run_reference(copy.deepcopy(model).double(), inputs=tree_map(_to64, inputs),
                           target=_to64(target), loss_fn=loss_fn, steps=steps, optimizer=optimizer,
                           lr=lr, return_parameters=True)
    noise = 0.0
    for order in _row_orders(tree_leaves(inputs)[0].shape[0]):
        rows = lambda t: t[torch.tensor(order)] if isinstance(t, torch.Tensor) else t  # noqa: E731
        _, p = run_reference(model, inputs=tree_map(rows, inputs), target=rows(target), loss_fn=loss_fn,
                             steps=steps, optimizer=optimizer, lr=lr, return_parameters=True)
        noise = max(noise, max(float((p[n].double() - p64[n]).abs().max())
                               for n in p64 if p64[n].is_floating_point()))
    return p64, noise


def _row_orders(batch: int, most: int = 24) -> list:
    """Every order of the batch rows, or ``most`` seeded random ones when there are more."""
    if batch <= 4:
        return list(itertools.permutations(range(batch)))
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randperm(batch, generator=g).tolist()) for _ in range(most)]


def outside_band(params: dict, p64: dict, noise: float) -> list[str]:
    """One line per floating parameter of ``params`` outside
    ``RTOL * |p64| + ATOL + NOISE_FACTOR * noise`` of float64, elementwise."""
    out = []
    for fqn, truth in p64.items():
        if not truth.is_floating_point():
            continue
        excess = (params[fqn].double() - truth).abs() - (RTOL * truth.abs() + ATOL + NOISE_FACTOR * noise)
        if float(excess.max()) > 0:
            out.append(f"{fqn} is {float(excess.max()):.2e} outside AdamW's fp32 noise band around"
                       f" float64 (noise {noise:.2e})")
    return out


__all__ = ["ATOL", "NOISE_FACTOR", "RTOL", "adamw_truth", "outside_band"]
