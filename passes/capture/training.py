"""The training graph: a model with its loss (its own, or ``loss_fn(output, target)``), captured.

``capture_for_training`` checks what the user passed (a module, a tuple or dict of inputs, a
loss function with a target) and captures the model, wrapped so that the loss is part of the
graph when a separate ``loss_fn`` is given; names stay the user's model's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autopar.core.errors import InputError
from autopar.passes.capture import CapturedGraph, capture

_WRAPPED = "model"


class _WithLoss(nn.Module):
    """``loss_fn(model(*args, **kwargs), target)`` as one module (so the loss is in the graph)."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args, target, **kwargs):
        return self.loss_fn(self.model(*args, **kwargs), target)


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


def _strip_prefix(captured: CapturedGraph, prefix: str) -> CapturedGraph:
    """Names as the user's model spells them (the loss wrapper adds ``prefix``)."""

    def strip(name):
        return name[len(prefix):] if isinstance(name, str) and name.startswith(prefix) else name

    for node in captured.graph_module.graph.nodes:
        for key in ("autopar_module", "autopar_layer"):
            if node.meta.get(key):
                node.meta[key] = strip(node.meta[key])
    inputs = tuple(dataclasses.replace(i, name=strip(i.name)) for i in captured.inputs)
    return dataclasses.replace(
        captured, inputs=inputs,
        parameters={strip(k): v for k, v in captured.parameters.items()},
        buffers={strip(k): v for k, v in captured.buffers.items()},
        tied={strip(k): strip(v) for k, v in captured.tied.items()},
        layers=tuple(strip(x) for x in captured.layers),
        stamped=tuple(strip(x) for x in captured.stamped),
    )


def capture_for_training(model, *, example_inputs, example_target=None, loss_fn=None) -> CapturedGraph:
    """Capture the training graph: the model with its loss (its own, or ``loss_fn``)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be an nn.Module, got {type(model).__name__}: wrap a plain function"
                         " in an nn.Module whose forward calls it (its parameters must be the module's)")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable(output, target) -> scalar, got {type(loss_fn).__name__}")
    args, kwargs = split_inputs(example_inputs)
    if loss_fn is None:
        if example_target is not None:
            raise InputError("example_target was given without loss_fn: pass loss_fn=, or put the"
                             " labels in example_inputs (e.g. {'labels': y} for HF models)")
        captured = capture(model, args, kwargs=kwargs)
        if not any(o.kind == "loss" for o in captured.outputs):
            raise InputError(
                "the model's output is not a loss (a 0-dim tensor, or a .loss field): pass"
                " loss_fn=(output, target) -> scalar and example_target=, or give the model its labels"
            )
        return captured
    if example_target is None:
        raise InputError("loss_fn needs example_target= (an example of the target it compares with)")
    wrapped = _WithLoss(model, loss_fn)
    wrapped.train(model.training)
    captured = capture(wrapped, args, kwargs={**kwargs, "target": example_target})
    return _strip_prefix(captured, _WRAPPED + ".")


__all__ = ["capture_for_training", "split_inputs"]
