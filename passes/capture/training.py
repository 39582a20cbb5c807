"""The training graph: a model with its loss (its own, or ``loss_fn(output, target)``), captured.

``capture_for_training`` checks what the user passed (a module, a tuple or dict of inputs, a
loss function with a target) and captures the model, wrapped so that the loss is part of the
graph when a separate ``loss_fn`` is given (:class:`~autopar.passes.capture.loss.WithLoss`, which
keeps the user's model's names). With ``mixed_precision`` it captures the model's copy in the compute
dtype of :func:`~autopar.core.precision.precision_of` (bf16; fp16 for an fp16 model), inputs cast
alike (:mod:`~autopar.passes.capture.dtype`): what the program runs under a mixed plan.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.core.errors import InputError
from autopar.core.precision import precision_of
from autopar.passes.capture import CapturedGraph, capture
from autopar.passes.capture.dtype import cast_floating, in_dtype
from autopar.passes.capture.loss import WithLoss


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tuple of positional arguments or a dict of keyword arguments → (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        raise InputError("example_inputs must be a tuple of positional arguments or a dict of keyword"
                         " arguments, got a tensor: pass (x,)")
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(f"example_inputs must be a tuple or a dict, got {type(example_inputs).__name__}")
    return tuple(example_inputs), {}


def capture_for_training(model, *, example_inputs, example_target=None, loss_fn=None,
                         mixed_precision: bool | str = False, moe_dispatch: str = "dense",
                         moe_capacity_factor: float | None = None) -> CapturedGraph:
    """Capture the training graph: the model with its loss (its own, or ``loss_fn``); with
    ``mixed_precision`` (as ``Options`` takes it), its copy in the compute dtype (module docstring); routed experts as
    ``moe_dispatch`` and ``moe_capacity_factor`` say (:func:`~autopar.passes.capture.capture`)."""
    moe = {"moe_dispatch": moe_dispatch, "moe_capacity_factor": moe_capacity_factor}
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be an nn.Module, got {type(model).__name__}: wrap a plain function"
                         " in an nn.Module whose forward calls it (its parameters must be the module's)")
    if mixed_precision:
        dtype = precision_of((p.dtype for p in model.parameters()), mixed_precision=mixed_precision).compute
        example_inputs, example_target = cast_floating((example_inputs, example_target), dtype)
        with in_dtype(model, dtype):
            return capture_for_training(model, example_inputs=example_inputs, example_target=example_target,
                                        loss_fn=loss_fn, **moe)
    args, kwargs = split_inputs(example_inputs)
    if loss_fn is None:
        if example_target is not None:
            raise InputError("example_target was given without loss_fn: pass loss_fn=, or put the"
                             " labels in example_inputs (e.g. {'labels': y} for HF models)")
        captured = capture(model, args, kwargs=kwargs, **moe)
        if not any(o.kind == "loss" for o in captured.outputs):
            raise InputError(
                "the model's output holds no loss (a 0-dim floating tensor, alone or named 'loss' in a"
                " tuple, dict or dataclass): pass"
                " loss_fn=(output, target) -> scalar and example_target=, or give the model its labels"
            )
        return captured
    if example_target is None:
        raise InputError("loss_fn needs example_target= (an example of the target it compares with)")
    return capture(WithLoss(model, loss_fn), args, kwargs={**kwargs, "target": example_target}, **moe)


__all__ = ["capture_for_training", "split_inputs"]
