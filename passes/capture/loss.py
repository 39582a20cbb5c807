"""Which output is the loss, and how to fold a separate loss function into the model.

A model's output is its loss when it is a 0-dim tensor, carries ``.loss`` (HF models called with
``labels=``) or is a tuple whose first element is the loss. A model that returns predictions
is trained through :class:`WithLoss` (``loss_fn(model(*inputs), target)``), which keeps the
model's names for its parameters, buffers, submodules and tensor constants.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.core.errors import AutoparError, InputError


def loss_of(output) -> torch.Tensor:
    """The loss in a model's output (see the module docstring)."""
    if isinstance(output, torch.Tensor):
        if output.dim() != 0:
            raise AutoparError(
                f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss;"
                " pass loss_fn= (and target=) or return the loss"
            )
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        return output[0]
    raise AutoparError(
        f"cannot find the loss in a model output of type {type(output).__name__}: return a scalar,"
        " an object with .loss, or a tuple starting with the loss; or pass loss_fn="
    )


class WithLoss(nn.Module):
    """``loss_fn(model(*inputs, **kwargs), target)`` as one module, under the model's own names.

    ``target`` is the keyword argument ``target`` or, without it, the last positional one. The
    wrapper holds the model's own parameter, buffer and submodule tables (the same dicts, not
    copies) and its plain tensor attributes, so a trace names every tensor as the model does
    (``fc1.weight``, not ``model.fc1.weight``), and a tensor swapped on the wrapper (torch.export
    swaps in fake ones) is swapped in the model. :func:`unwrap` gives the model back.
    """

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        if not callable(loss_fn):
            raise InputError(f"loss_fn must be callable(output, target) -> scalar, got {type(loss_fn).__name__}")
        if isinstance(loss_fn, nn.Module) and any(True for _ in loss_fn.parameters()):
            raise InputError(f"loss_fn ({type(loss_fn).__name__}) has parameters of its own, which would be traced"
                             " as constants and never trained: move them into the model (compute the loss"
                             " in its forward) or pass a loss_fn without parameters")
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        for name, value in vars(model).items():
            if isinstance(value, torch.Tensor):
                object.__setattr__(self, name, value)
        self.training = model.training
        object.__setattr__(self, "_model", model)  # not a submodule: names stay unprefixed
        object.__setattr__(self, "_loss_fn", loss_fn)

    def train(self, mode: bool = True):
        self.training = mode
        self._model.train(mode)
        return self

    def forward(self, *args, **kwargs):
        if "target" in kwargs:
            target = kwargs.pop("target")
        else:
            *args, target = args
        return self._loss_fn(self._model(*args, **kwargs), target)


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a :class:`WithLoss`; any other module as it is."""
    return module._model if isinstance(module, WithLoss) else module


__all__ = ["WithLoss", "loss_of", "unwrap"]
