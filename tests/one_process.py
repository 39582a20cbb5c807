"""How the distributed tests judge a run against the model trained in one process, on any CPU.

- **SGD** is linear in the gradients: fp32 rounding moves parameters by ``lr`` times a rounding
  error, so a distributed run equals the fp32 one-process run within ``RTOL`` / ``ATOL``.
- **AdamW** (and any other adaptive optimizer) divides by the gradient's own magnitude: its step
  ``lr * g / (|g| + eps)`` turns fp32 rounding in a gradient near ``eps`` (or exactly zero in
  exact arithmetic, like attention's key bias: softmax ignores a per-query constant) into up to
  ``lr`` in the parameter, and rounding differs between CPUs (vector widths, kernels). So the
  fp32 one-process run is itself not within 1e-6 of the truth, and a distributed run is compared
  with a **float64** one-process run instead, inside a band set by fp32's measured noise: how far
  the fp32 one-process runs over other orders of the batch rows (the same mathematics, other
  summation orders; every order up to 4 rows, 24 seeded random ones beyond) land from float64,
  for the losses and for the parameters. A wrong gradient, a parameter stepped twice or a
  mis-sharded optimizer state moves parameters by about ``lr``, far outside that band.

A model built on ``device="meta"`` starts, in one process, from :func:`initialised`:
``to_empty`` and the model's own initialisers under a seed.

::

    ref = one_process(model, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer="adamw", lr=0.01)
    assert not ref.mismatches(losses, params)
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autopar.testing import run_reference

RTOL, ATOL = 1e-5, 1e-6
NOISE_FACTOR = 8.0  # the band is this many times the measured noise (worst seen: 5.1)


@dataclass
class Reference:
    """What a run must equal: ``losses`` and ``params`` (fp32 for SGD, float64 for adaptive
    optimizers), within ``RTOL * |x| + ATOL + NOISE_FACTOR * noise`` elementwise."""

    losses: list[float]
    params: dict
    loss_noise: float = 0.0
    param_noise: float = 0.0

    @property
    def exact(self) -> bool:
        return self.loss_noise == 0.0 and self.param_noise == 0.0

    def mismatches(self, losses=None, params=None, *, loss_resolution: float = 0.0) -> list[str]:
        """One line per loss or floating parameter outside the band (``None``: not checked);
        non-floating buffers must be equal. ``loss_resolution``: losses were rounded to it."""
        out = []
        if losses is not None:
            got, want = torch.tensor(losses, dtype=torch.float64), torch.tensor(self.losses, dtype=torch.float64)
            if got.shape != want.shape:
                out.append(f"{len(losses)} losses, expected {len(self.losses)}")
            elif _excess(got, want, self.loss_noise) > loss_resolution:
                out.append(f"losses {list(losses)} vs one process {self.losses}"
                           + ("" if self.exact else f" (float64; fp32 noise {self.loss_noise:.1e})"))
        for fqn, want in (self.params.items() if params is not None else ()):
            if fqn not in params:
                out.append(f"{fqn} is missing")
            elif not want.is_floating_point():
                if not torch.equal(params[fqn], want):
                    out.append(f"{fqn} differs")
            elif (e := _excess(params[fqn], want, self.param_noise)) > 0:
                kind = "fp32 rounding" if self.exact else f"fp32 noise band {self.param_noise:.1e} around float64"
                out.append(f"{fqn} is {e:.2e} outside {kind}")
        return out

    def check(self, losses=None, params=None, *, where: str = "", loss_resolution: float = 0.0) -> None:
        bad = self.mismatches(losses, params, loss_resolution=loss_resolution)
        assert not bad, (where + ": " if where else "") + "; ".join(bad)


def _excess(got: torch.Tensor, want: torch.Tensor, noise: float) -> float:
    got, want = got.double(), want.double()
    return float(((got - want).abs() - (RTOL * want.abs() + ATOL + NOISE_FACTOR * noise)).max())


def band(train: Callable, batch: int) -> Reference:
    """The float64 truth of ``train(dtype, order) -> (losses, params)`` and fp32's noise around it,
    measured over orders of the ``batch`` rows (``order`` None: as given)."""
    losses64, p64 = train(torch.float64, None)
    loss_noise = param_noise = 0.0
    for order in _row_orders(batch):
        losses, params = train(torch.float32, order)
        loss_noise = max(loss_noise, max(abs(a - b) for a, b in zip(losses, losses64)))
        param_noise = max(param_noise, max((float((params[n].double() - t).abs().max())
                                            for n, t in p64.items() if t.is_floating_point()), default=0.0))
    return Reference([float(v) for v in losses64], p64, loss_noise, param_noise)


def rows(tree, order, batch: int):
    """``tree`` with every tensor of ``batch`` rows taken in ``order`` (None: as it is)."""
    if order is None:
        return tree
    index = torch.tensor(order)
    return tree_map(lambda t: t[index] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t,
                    tree)


def cast(tree, dtype):
    """Floating tensors of ``tree`` (and modules) in ``dtype``."""
    def one(t):
        if isinstance(t, torch.nn.Module):
            return copy.deepcopy(t).to(dtype)
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return tree_map(one, tree)


def one_process(model, *, inputs, target=None, loss_fn=None, steps: int, optimizer, lr: float,
                **training) -> Reference:
    """The reference a distributed run of ``model`` trained ``steps`` times on one batch must
    equal: the fp32 run for ``"sgd"``, the float64 band for any other optimizer. ``training``:
    ``accumulate`` / ``max_norm`` as :func:`autopar.testing.run_reference` takes them."""
    kw = dict(loss_fn=loss_fn, steps=steps, optimizer=optimizer, lr=lr, return_parameters=True, **training)
    if optimizer == "sgd":
        return Reference(*run_reference(model, inputs=inputs, target=target, **kw))
    batch = tree_leaves(inputs)[0].shape[0]

    def train(dtype, order):
        return run_reference(cast(model, dtype), inputs=cast(rows(inputs, order, batch), dtype),
                             target=cast(rows(target, order, batch), dtype), **kw)

    return band(train, batch)


def initialised(meta: torch.nn.Module, seed: int) -> torch.nn.Module:
    """What one process makes of a model on meta: ``to_empty`` on the CPU, then after
    ``torch.manual_seed(seed)`` the model's initialisers: a transformers model's ``init_weights()``
    (which ties its weights again), else every module's ``reset_parameters()`` in ``modules()``
    order (this process's RNG is left where those draws leave it)."""
    model = copy.deepcopy(meta).to_empty(device="cpu")
    torch.manual_seed(seed)
    if hasattr(model, "init_weights"):
        model.init_weights()
    else:
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


def _row_orders(batch: int, most: int = 24) -> list:
    """Every order of the batch rows, or ``most`` seeded random ones when there are more."""
    if batch <= 4:
        return list(itertools.permutations(range(batch)))
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randperm(batch, generator=g).tolist()) for _ in range(most)]


__all__ = ["ATOL", "NOISE_FACTOR", "RTOL", "Reference", "band", "cast", "initialised", "one_process", "rows"]
