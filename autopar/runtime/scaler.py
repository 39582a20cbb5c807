"""Dynamic loss scaling for fp16 mixed precision (``precision="mixed-fp16"``), as
``torch.amp.GradScaler`` scales.

fp16 holds magnitudes from 6e-8 to 65504, so small gradients vanish unless the loss is scaled
up before backward. Under a ``"mixed-fp16"`` program a step is::

    opt.zero_grad()
    loss = program.step(batch)        # backward of loss * scale; the loss returned is unscaled
    program.clip_grad_norm_(1.0)      # optional: on the unscaled gradients
    program.optimizer_step(opt)       # opt.step() unless a gradient overflowed; adjusts the scale

The backward starts from the loss's gradient ``scale`` in the loss's dtype (an fp16 loss with
a scale above 65504 overflows at once: GradScaler's first steps do the same); the program's
fp16 gradients add up, scaled, in fp32 into the optimizer's tensors (masters, ZeRO shards), and
:meth:`LossScaler.unscale_` divides them by the scale once per optimizer step (before clipping,
:meth:`~autopar.runtime.program.DistributedProgram.full_gradients` or the step). If any of
them is inf or NaN on any rank, stage or shard (one all-reduce of a flag over the whole
world), :meth:`LossScaler.step` skips the optimizer's step on every rank and multiplies the
scale by ``backoff_factor``; otherwise it steps, and after ``growth_interval`` steps in a row
without overflow multiplies it by ``growth_factor``. Powers of two keep scaling and unscaling
exact. Under other precisions ``program.optimizer_step(opt)`` is ``opt.step()``, so one script
trains every precision. A bare ``opt.step()`` under fp16 would step scaled gradients, and a
backward after unscaling would add scaled gradients to unscaled ones: the next ``program.step()``
refuses to run after either. Checkpoints keep the scaler's state (:meth:`LossScaler.state_dict`).

The one-process reference, :func:`autopar.testing.run_reference` with ``precision="mixed-fp16"``,
is the model's fp16 copy whose gradients go into fp32 masters, stepped by ``torch.amp.GradScaler``
(``scale``, ``unscale_``, ``step``, ``update``) on those masters; not ``torch.autocast``, which
keeps fp32 weights and runs some ops in fp32: another policy, not what the program runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.core.errors import CodegenError


@dataclass(frozen=True)
class LossScale:
    """How the loss scale moves (``torch.amp.GradScaler``'s defaults): it starts at ``init``,
    is multiplied by ``backoff_factor`` after a step whose gradients overflowed and by
    ``growth_factor`` after ``growth_interval`` steps in a row that did not."""

    init: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (self.init > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise CodegenError(f"{self} is not a loss scale: it needs init > 0, growth_factor > 1,"
                               " 0 < backoff_factor < 1 and growth_interval >= 1")


class LossScaler:
    """One rank's loss scale and its step's state (module docstring). ``device``: where the
    overflow flag is all-reduced (the program's)."""

    def __init__(self, config: LossScale, device: torch.device):
        self.config = config
        self.scale = float(config.init)
        self.growth_tracker = 0  # steps in a row without overflow
        self._device = device
        self._found: torch.Tensor | None = None  # the step's overflow flag, once unscaled
        self._versions: list[int] | None = None  # the optimizer's tensors' versions since gradients came

    def loss_gradient(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a backward of the scaled ``loss`` starts from: the scale in its dtype."""
        return torch.full((), self.scale, dtype=loss.dtype, device=loss.device)

    def check_backward(self, tensors) -> None:
        """CodegenError before a backward that would add scaled gradients to unscaled ones (after
        :meth:`unscale_`), or after an optimizer changed ``tensors`` (its own) since the last
        backward without :meth:`step` (it stepped scaled gradients and skipped no overflow)."""
        if self._found is not None:
            raise CodegenError("the gradients of this optimizer step were already unscaled (by clip_grad_norm_,"
                               " full_gradients or unscale_): call those after the step's last backward, then"
                               " program.optimizer_step(opt)")
        if self._versions is not None and [t._version for t in tensors] != self._versions:
            raise CodegenError("the optimizer stepped without program.optimizer_step(opt): under fp16 mixed"
                               " precision the gradients are scaled until it unscales them, skips a step"
                               " whose gradients overflowed and adjusts the loss scale; call"
                               " program.optimizer_step(opt) instead of opt.step() (it is opt.step() under"
                               " every other precision)")

    def took_gradients(self, tensors) -> None:
        """A backward added scaled gradients into ``tensors`` (the optimizer's)."""
        self._versions = [t._version for t in tensors]

    def unscale_(self, tensors) -> torch.Tensor:
        """Divide the gradients of ``tensors`` by the scale, once per step, and return the flag,
        summed over every rank (collective), of an inf or NaN among them (1-element float tensor
        on the program's device)."""
        if self._found is None:
            found = torch.zeros(1, device=self._device)
            groups: dict = {}  # as GradScaler: one foreach call per device (the host's: offloaded) and dtype
            for t in tensors:
                if t.grad is not None:
                    groups.setdefault((t.grad.device, t.grad.dtype), []).append(t.grad)
            for (device, _), grads in groups.items():
                here = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, here,
                                                                 torch.full((1,), 1.0 / self.scale, device=device))
                found += here.to(self._device)
            dist.all_reduce(found)
            self._found = found
        return self._found

    def step(self, optimizer, tensors) -> bool:
        """Step ``optimizer`` (over ``tensors``) unless a gradient overflowed on some rank, then
        move the scale (module docstring); returns whether it stepped (a host sync)."""
        stepped = not bool(self.unscale_(tensors).item())
        if stepped:
            optimizer.step()
            self.growth_tracker += 1
            if self.growth_tracker == self.config.growth_interval:
                self.scale *= self.config.growth_factor
                self.growth_tracker = 0
        else:
            self.scale *= self.config.backoff_factor
            self.growth_tracker = 0
        self._found, self._versions = None, None
        return stepped

    def state_dict(self) -> dict:
        """The scale and the clean steps in a row (what a checkpoint keeps, as JSON)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])


def step_optimizer(scaler: LossScaler | None, optimizer, masters) -> bool:
    """``optimizer.step()``, through ``scaler`` where a program scales its loss (``masters``: the
    program's :class:`~autopar.runtime.mixed.MasterWeights` or ZeRO shards); whether it stepped."""
    if scaler is None:
        optimizer.step()
        return True
    return scaler.step(optimizer, masters.owned())


def loss_scaler(precision, config: LossScale | None, device: torch.device) -> LossScaler | None:
    """The scaler of a program of ``precision`` (fp16 mixed precision scales; None otherwise)."""
    if not (precision.master and precision.compute == torch.float16):
        return None
    return LossScaler(config or LossScale(), device)


__all__ = ["LossScale", "LossScaler", "loss_scaler", "step_optimizer"]
