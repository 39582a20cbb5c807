"""Check a distributed program against the unmodified model trained in one process.

::

    from autopar.testing import run_reference, run_distributed

    ref = run_reference(model, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3,
                        optimizer="adamw", lr=1e-3)
    got = run_distributed(program, inputs=(x,), target=y, steps=3, world_size=2,
                          optimizer="adamw", lr=1e-3)
    assert got == pytest.approx(ref, rel=1e-5)

Both train on the same global batch every step (``zero_grad``, ``accumulate`` times loss and
``backward``, gradients clipped to ``max_norm`` when given, optimizer step), starting from
``torch.manual_seed(seed)`` (default 0, on every rank: dropout masks then match), and return the
losses of every backward pass; ``return_parameters=True`` also returns the final parameters and
buffers by FQN. A distributed program starts from ``checkpoint`` (a Hugging Face folder or an
autopar checkpoint) or from its model, a model on meta initialised after
``torch.manual_seed(seed)`` as one process initialises it after ``to_empty``.
``run_distributed`` spawns ``world_size`` CPU processes with gloo on 127.0.0.1 (a free port),
checks that every rank saw the same losses and raises :class:`~autopar.runtime.launch.LaunchError`
(an :class:`~autopar.AutoparError`) with the worker's traceback if one fails or the run exceeds
``timeout`` seconds. ``optimizer`` is ``"sgd"``, ``"adamw"`` or ``callable(params, lr)``. The
distributed programs step through
``program.optimizer_step(opt)``; under fp16 mixed precision both scale the loss as ``loss_scale``
says (:class:`~autopar.runtime.scaler.LossScale`).
``run_programs({name: program or (program, inputs, target), ...}, ...)`` trains several
programs of one world size (of one model or several) in one spawn, one result per name.
``run_on_ranks(fn, world_size=..., args=...)`` runs any importable function on local gloo ranks
(:mod:`autopar.runtime.launch`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError
from autopar.core.precision import named
from autopar.passes.capture.dtype import cast_floating
from autopar.passes.capture.loss import loss_of
from autopar.runtime import DistributedProgram, PipelineProgram
from autopar.runtime.launch import run_on_ranks
from autopar.runtime.scaler import LossScale


def make_optimizer(optimizer, params, lr: float):
    """``"sgd"`` (plain SGD), ``"adamw"`` (AdamW, torch defaults) or ``callable(params, lr)``."""
    params = list(params)
    if callable(optimizer):
        return optimizer(params, lr)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise AutoparError(f"optimizer must be 'sgd', 'adamw' or callable(params, lr), got {optimizer!r}")


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def run_reference(model, *, inputs, target=None, loss_fn=None, steps: int = 3, optimizer="sgd",
                  lr: float = 0.01, return_parameters: bool = False, seed: int | None = 0,
                  accumulate: int = 1, max_norm: float | None = None, precision: str = "fp32",
                  loss_scale: LossScale | None = None):
    """Train a deep copy of ``model`` in this process; the losses (and final parameters).

    The loss is ``loss_fn(output, target)`` when ``loss_fn`` is given, else the model's own
    (a scalar output, ``output.loss``, or the first element of a tuple). Training starts from
    ``torch.manual_seed(seed)`` (dropout masks then match :func:`run_distributed`'s with the
    same seed) and leaves this process's RNG as it was; ``seed=None`` uses the RNG as it is.
    ``precision="mixed"`` trains by the mixed-precision policy of :mod:`autopar.runtime.mixed`
    (a bf16 copy computes, fp32 masters step; the parameters returned are the masters);
    ``"mixed-fp16"`` by the same with an fp16 copy, its loss scaled by ``torch.amp.GradScaler``
    (as ``loss_scale`` says) on the masters: the scaled loss's fp16 gradients add up in the
    masters, which GradScaler unscales, checks, steps or skips (:mod:`autopar.runtime.scaler`).
    """
    model = copy.deepcopy(model)
    mixed = named(precision)
    scale = loss_scale or LossScale()
    scaler = torch.amp.GradScaler("cpu", init_scale=scale.init, growth_factor=scale.growth_factor,
                                  backoff_factor=scale.backoff_factor, growth_interval=scale.growth_interval,
                                  enabled=mixed.master and mixed.compute == torch.float16)
    masters = None
    if mixed.master:
        masters = {name: torch.nn.Parameter(p.detach().to(torch.float32, copy=True), p.requires_grad)
                   for name, p in model.named_parameters()}
        model.to(mixed.compute)
        inputs, target = cast_floating((inputs, target), mixed.compute)
    params = dict(model.named_parameters())
    stepped = masters if masters is not None else params
    opt = make_optimizer(optimizer, stepped.values(), lr)
    losses = []
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(accumulate):
                out = _call(model, inputs)
                loss = loss_fn(out, target) if loss_fn is not None else loss_of(out)
                scaler.scale(loss).backward()
                losses.append(float(loss.detach()))
                for name, master in (masters or {}).items():  # bf16 (fp16) gradients add up in fp32
                    if params[name].grad is not None:
                        grad = params[name].grad.to(torch.float32)
                        master.grad = grad if master.grad is None else master.grad + grad
                        params[name].grad = None
            scaler.unscale_(opt)
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(stepped.values()), max_norm)
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                for name, master in (masters or {}).items():
                    params[name].copy_(master)
    if return_parameters:
        state = {**dict(model.named_buffers()), **stepped}
        return losses, {k: v.detach().clone() for k, v in state.items()}
    return losses


def _program_of(obj):
    kinds = (DistributedProgram, PipelineProgram)
    if isinstance(obj, kinds):
        return obj
    program = getattr(obj, "program", None)
    if isinstance(program, kinds):
        return program
    raise AutoparError(f"expected a DistributedProgram, a PipelineProgram or a compiled model with .program,"
                       f" got {type(obj).__name__}")


def _world_size(program) -> int:
    """Ranks a program runs on (a pipeline's: all its stages')."""
    return program.world_size if hasattr(program, "world_size") else program.assignment.world_size


def _train(programs, steps, optimizers, lr, want_params, seed, accumulate, max_norm, loss_scale):
    out = {}
    for name, (program, inputs, target, checkpoint) in programs.items():
        results = []
        for optimizer in optimizers:
            if seed is not None:
                torch.manual_seed(seed)  # what a model on meta draws its initial weights from
            program.start(checkpoint, loss_scale=loss_scale)
            opt = make_optimizer(optimizer, program.parameters(), lr)
            if seed is not None:
                torch.manual_seed(seed)
            losses = []
            for _ in range(steps):
                opt.zero_grad()
                for _ in range(accumulate):
                    losses.append(program.step(inputs, target))
                if max_norm is not None:
                    program.clip_grad_norm_(max_norm)
                program.optimizer_step(opt)
            params = program.full_state_dict() if want_params else None
            results.append({"losses": torch.stack(losses).tolist(),
                            "params": params if dist.get_rank() == 0 else None})
        program.reset()  # free this program's shards before the next one
        out[name] = results
    return out


def run_distributed(program_or_compiled, *, inputs, target=None, steps: int = 3,
                    world_size: int | None = None, optimizer="sgd", lr: float = 0.01,
                    return_parameters: bool = False, timeout: float = 300.0, seed: int | None = 0,
                    checkpoint=None, accumulate: int = 1, max_norm: float | None = None,
                    loss_scale: LossScale | None = None):
    """Train ``program`` on ``world_size`` local gloo ranks; per-step losses (rank 0's, checked
    equal on every rank) and, with ``return_parameters``, the full parameters and buffers by FQN.
    Every rank starts training from ``torch.manual_seed(seed)``, as :func:`run_reference` does.

    ``optimizer`` may also be a list: the ranks are spawned once and train from the model's
    initial weights with each optimizer in turn; the result is then a list, one per optimizer.
    """
    program = _program_of(program_or_compiled)
    need = _world_size(program)
    world_size = need if world_size is None else world_size
    if world_size != need:
        raise AutoparError(f"the program's mesh {program.mesh_shape} needs world_size={need}, got {world_size}")
    return run_programs({"program": program}, inputs=inputs, target=target, steps=steps, optimizer=optimizer,
                        lr=lr, return_parameters=return_parameters, timeout=timeout, seed=seed,
                        checkpoint=checkpoint, accumulate=accumulate, max_norm=max_norm,
                        loss_scale=loss_scale)["program"]


def run_programs(programs, *, inputs=None, target=None, steps: int = 3, optimizer="sgd", lr: float = 0.01,
                 return_parameters: bool = False, timeout: float = 300.0, seed: int | None = 0,
                 checkpoint=None, accumulate: int = 1, max_norm: float | None = None,
                 loss_scale: LossScale | None = None) -> dict:
    """:func:`run_distributed` for several programs (or compiled models) of one world size, in
    one spawn; returns ``{name: result}``, each result as :func:`run_distributed` returns it.

    ``programs`` maps a name to a program, trained on ``inputs`` / ``target`` from
    ``checkpoint``, or to a tuple ``(program, inputs, target)`` with its own batch (programs of
    different models), or ``(program, inputs, target, checkpoint)``. The ranks train each
    program in turn (process groups per mesh shape are built once), each from its initial
    weights.
    """
    entries = {}
    for name, p in dict(programs).items():
        p, batch, tgt, *start = p if isinstance(p, tuple) else (p, inputs, target)
        start = start[0] if start else checkpoint
        if batch is None:
            raise AutoparError(f"program {name!r} has no inputs: pass inputs=, or (program, inputs, target)")
        entries[name] = (_program_of(p), batch, tgt, start)
    if not entries:
        raise AutoparError("run_programs needs at least one program")
    worlds = {name: _world_size(entry[0]) for name, entry in entries.items()}
    world_size = next(iter(worlds.values()))
    if any(w != world_size for w in worlds.values()):
        raise AutoparError(f"the programs need different world sizes {worlds}; run each world size separately")
    many = isinstance(optimizer, (list, tuple))
    optimizers = list(optimizer) if many else [optimizer]
    per_rank = run_on_ranks(_train, world_size=world_size, timeout=timeout,
                            args=(entries, steps, optimizers, lr, return_parameters, seed, accumulate, max_norm,
                                  loss_scale))
    out = {}
    for name in entries:
        got = []
        for i, first in enumerate(per_rank[0][name]):
            for r in range(1, world_size):
                other = per_rank[r][name][i]["losses"]
                if not torch.allclose(torch.tensor(other), torch.tensor(first["losses"]), rtol=1e-6, atol=0):
                    raise AutoparError(f"{name}: rank {r} saw losses {other} but rank 0 saw {first['losses']}")
            got.append((first["losses"], first["params"]) if return_parameters else first["losses"])
        out[name] = got if many else got[0]
    return out


__all__ = ["make_optimizer", "run_distributed", "run_on_ranks", "run_programs", "run_reference"]
from autopar.regression import assert_plan_matches  # noqa: E402,F401  (golden-plan checks, re-exported)
