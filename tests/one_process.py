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

- **Mixed precision** (``precision="mixed"``: a bf16 copy computes, fp32 masters step; see
  :mod:`autopar.runtime.mixed`) rounds every activation and gradient to bf16. Other row orders
  barely move it (a bf16 matmul accumulates in fp32 and rounds once), but a distributed run sums
  pieces that were each rounded to bf16 (a data-parallel gradient all-reduce, a tensor-parallel
  partial sum, micro-batches). So a run is compared with the one-process run of the same policy,
  inside a band set by that policy's measured noise: how far the same policy lands when its
  batch is cut into 2 pieces, 4, or one per row, whose bf16 gradients add up in bf16
  (:class:`Pieces`), rows in several orders, times :data:`MIXED_NOISE_FACTOR`. (Without the
  one-per-row cut, GPT-2 tiny's 4-rank data-parallel bf16 AdamW runs had 14.6 % of a bias outside
  its elements' noise on an AVX2 CPU: 2 and 4 pieces sampled too few distinct roundings.) That band does not tell bf16 from fp32 (an
  fp32 run lands inside it): the tests check the precision itself (bf16 tensors, bf16 losses).
  Under AdamW that band is wide: a gradient at bf16's noise level that flips sign moves its
  element by ``lr`` a step, so the widest element's noise exceeds what 3 steps move any
  parameter (GPT-2 tiny: 2.9e-2 against 3 x 1e-2). So each element also has its own noise (the
  most the piece runs moved it), and a parameter with more than :data:`MIXED_OUTLIER_SHARE` of
  its elements outside ``factor`` times their own noise is a mismatch: sign flips are isolated
  elements (correct runs: at most 1 element of 32 in a bias, 0.4 % of a weight), while a skipped
  step or a learning rate 10 % off moves 88-100 % of a tensor's elements (3 % off: 75 %).

A model built on ``device="meta"`` starts, in one process, from :func:`initialised`:
``to_empty`` and the model's own initialisers under a seed.

::

    ref = one_process(model, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer="adamw", lr=0.01)
    assert not ref.mismatches(losses, params)
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autopar.passes.capture.loss import loss_of
from autopar.testing import _call, run_reference

RTOL, ATOL = 1e-5, 1e-6
NOISE_FACTOR = 8.0  # the band is this many times the measured noise (worst seen: 5.1)
MIXED_NOISE_FACTOR = 2.0  # the same for mixed precision against its pieces' noise (worst seen: 0.5)
MIXED_OUTLIER_SHARE = 0.1  # share of a parameter's elements that may lie outside their own noise
# Mixed precision's losses against their pieces' noise: after AdamW steps a loss sums every
# element's sign-flip noise, which 16 piece runs sample thinly (worst seen: 2.1, bf16 AdamW data
# parallel on 4 ranks at step 3; on GPT-2 tiny a learning rate 10 % off moves the third loss 15-18x
# that noise)
MIXED_LOSS_FACTOR = 4.0


@dataclass
class Reference:
    """What a run must equal: ``losses`` and ``params`` (fp32 for SGD, float64 for adaptive
    optimizers), within ``RTOL * |x| + ATOL + factor * noise`` elementwise."""

    losses: list[float]
    params: dict
    loss_noise: float = 0.0
    param_noise: float = 0.0
    factor: float = NOISE_FACTOR
    truth: str = "float64"  # what the noise is measured around (messages)
    element_noise: dict | None = None  # mixed precision: each parameter's noise per element
    loss_factor: float | None = None  # the losses' (None: factor)

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
            elif _excess(got, want, (self.loss_factor or self.factor) * self.loss_noise) > loss_resolution:
                out.append(f"losses {list(losses)} vs one process {self.losses}"
                           + ("" if self.exact else f" ({self.truth}; noise {self.loss_noise:.1e})"))
        for fqn, want in (self.params.items() if params is not None else ()):
            if fqn not in params:
                out.append(f"{fqn} is missing")
            elif not want.is_floating_point():
                if not torch.equal(params[fqn], want):
                    out.append(f"{fqn} differs")
            elif (e := _excess(params[fqn], want, self.factor * self.param_noise)) > 0:
                kind = "fp32 rounding" if self.exact else f"noise band {self.param_noise:.1e} around {self.truth}"
                out.append(f"{fqn} is {e:.2e} outside {kind}")
            elif self.element_noise is not None and (share := self._outliers(fqn, params[fqn])) > MIXED_OUTLIER_SHARE:
                out.append(f"{fqn}: {share:.1%} of its elements lie outside their own noise around {self.truth}")
        return out

    def _outliers(self, fqn: str, got: torch.Tensor) -> float:
        want = self.params[fqn].double()
        band = RTOL * want.abs() + ATOL + self.factor * self.element_noise[fqn]
        return float(((got.double() - want).abs() > band).double().mean())

    def check(self, losses=None, params=None, *, where: str = "", loss_resolution: float = 0.0) -> None:
        bad = self.mismatches(losses, params, loss_resolution=loss_resolution)
        assert not bad, (where + ": " if where else "") + "; ".join(bad)


def _excess(got: torch.Tensor, want: torch.Tensor, band: float) -> float:
    got, want = got.double(), want.double()
    return float(((got - want).abs() - (RTOL * want.abs() + ATOL + band)).max())


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


class Pieces(torch.nn.Module):
    """``model`` trained on ``pieces`` slices of the batch in one backward: the loss is the sum of
    each slice's loss (``loss_fn(model(inputs_i), target_i)``, or the model's own when
    ``loss_fn`` is None) weighted by the slice's share of the rows (a mean loss), so each
    slice's gradients add up in the parameters' dtype, as pieces of a distributed sum do.
    ``inputs`` is a tuple or dict whose batch-sized tensors are sliced."""

    def __init__(self, model, loss_fn, pieces: int, batch: int):
        super().__init__()
        self.model, self.loss_fn, self.pieces, self.batch = model, loss_fn, pieces, batch

    def forward(self, inputs, target):
        total, size = 0, self.batch // self.pieces
        for start in range(0, self.batch, size):
            x, t = tree_map(lambda v: v[start:start + size] if _batched(v, self.batch) else v, (inputs, target))
            out = _call(self.model, x)
            loss = self.loss_fn(out, t) if self.loss_fn is not None else loss_of(out)
            total = total + loss * (size / self.batch)
        return total


def _batched(v, batch: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch


def mixed_band(model, *, inputs, target=None, loss_fn=None, precision: str, **kw) -> Reference:
    """The one-process run of mixed-precision ``precision`` on the batch as given, and its noise
    over :class:`Pieces` runs (2 pieces, 4, one per row; 8 row orders): see the module docstring."""
    losses, params = run_reference(model, inputs=inputs, target=target, loss_fn=loss_fn, precision=precision, **kw)
    loss_noise = 0.0
    noise = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in params.items() if v.is_floating_point()}
    batch = tree_leaves(inputs)[0].shape[0]
    for pieces in sorted({cut for cut in (2, 4, batch) if 2 <= cut <= batch and batch % cut == 0}):
        for order in _row_orders(batch, most=8):
            x, t = rows((inputs, target), order, batch)
            got, p = run_reference(Pieces(model, loss_fn, pieces, batch), inputs=(x, t), precision=precision, **kw)
            loss_noise = max(loss_noise, max(abs(a - b) for a, b in zip(got, losses)))
            for n, v in noise.items():
                torch.maximum(v, (p[f"model.{n}"].double() - params[n].double()).abs(), out=v)
    param_noise = max((float(v.max()) for v in noise.values()), default=0.0)
    return Reference(losses, params, loss_noise, param_noise, MIXED_NOISE_FACTOR, f"{precision} in one process",
                     noise, MIXED_LOSS_FACTOR)


def one_process(model, *, inputs, target=None, loss_fn=None, steps: int, optimizer, lr: float,
                precision: str = "fp32", **training) -> Reference:
    """The reference a distributed run of ``model`` trained ``steps`` times on one batch must
    equal: the fp32 run for ``"sgd"``, the float64 band for any other optimizer, the policy's own
    band under ``precision="mixed"`` (module docstring). ``training``: ``accumulate`` /
    ``max_norm`` as :func:`autopar.testing.run_reference` takes them."""
    if precision != "fp32":
        return mixed_band(model, inputs=inputs, target=target, loss_fn=loss_fn, precision=precision, steps=steps,
                          optimizer=optimizer, lr=lr, return_parameters=True, **training)
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


__all__ = ["ATOL", "MIXED_LOSS_FACTOR", "MIXED_NOISE_FACTOR", "MIXED_OUTLIER_SHARE", "NOISE_FACTOR", "RTOL", "Pieces", "Reference", "band", "cast", "initialised", "mixed_band",
           "one_process", "rows"]


def sgd_mismatches(model, batch, plans: dict, *, world_size: int = 2, steps: int = 3, lr: float = 0.1,
                   check: Callable[[str, object], None] | None = None) -> dict:
    """Each named plan of ``model`` on ``world_size`` gloo ranks trained ``steps`` SGD steps on
    ``batch``, against the one-process run: ``{name: mismatches}``, empty lists when all agree.
    ``plans`` maps a name to a baseline builder ``(model, cluster, example_inputs=) -> Plan``, or
    to None for autopar's own plan; ``check(name, compiled)`` runs on each before training. An op
    with no sharding rule is an error here."""
    import warnings

    from autopar import Cluster, UnsupportedOpWarning
    from autopar.compile import compile
    from autopar.testing import run_programs

    cluster = Cluster.local(world_size=world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        programs = {name: compile(model, cluster, example_inputs=batch,
                                  plan=None if make is None else make(model, cluster, example_inputs=batch))
                    for name, make in plans.items()}
    for name, compiled in programs.items():
        if check is not None:
            check(name, compiled)
    ref = one_process(model, inputs=batch, steps=steps, optimizer="sgd", lr=lr)
    assert ref.losses[-1] < ref.losses[0], "the one-process run does not train: nothing to compare"
    results = run_programs(programs, inputs=batch, steps=steps, optimizer="sgd", lr=lr, return_parameters=True)
    return {name: ref.mismatches(losses, params) for name, (losses, params) in results.items()}


def sharded_op_mismatches(model, batch, op: str, *, sharding=("autopar", "tp", "fsdp")) -> dict:
    """:func:`sgd_mismatches` (2 steps, lr 0.01) of autopar's plan, Megatron tp=2 and FSDP on 2
    ranks, after checking that the plans named in ``sharding`` shard every output of the nodes
    running ``op``."""
    import functools

    from autopar import baselines

    def shards_op(name, compiled):
        nodes = [n for n in compiled.plan.nodes if n.op == op]
        assert nodes and (name not in sharding or all("S(" in n.outputs[0] for n in nodes)), (name, nodes)

    plans = {"autopar": None, "tp": functools.partial(baselines.megatron, tp=2), "fsdp": baselines.fsdp}
    return sgd_mismatches(model, batch, plans, steps=2, lr=0.01, check=shards_op)


def adamw(params, lr):
    """torch's AdamW at ``lr``: the adaptive optimizer the training tests run beside SGD."""
    return torch.optim.AdamW(params, lr=lr)


def check_sgd_and_adamw(results: dict, model, *, inputs, target, loss_fn, lr: float, precision: str = "fp32",
                        **training) -> None:
    """Check runs trained with ``optimizer=["sgd", adamw]`` for 3 steps (``results``: name ->
    ``[(losses, params) for SGD, for AdamW]``) against one process under the same ``training``
    (``accumulate``, ``max_norm``), whose losses fall."""
    for opt, i in (("sgd", 0), ("adamw", 1)):
        ref = one_process(model, inputs=inputs, target=target, loss_fn=loss_fn, steps=3, optimizer=opt, lr=lr,
                          precision=precision, **training)
        assert ref.losses[-1] < ref.losses[0]
        for name, per_optimizer in results.items():
            losses, params = per_optimizer[i]
            ref.check(losses, params, where=f"{name} {opt}")
