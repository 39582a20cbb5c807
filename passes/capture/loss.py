"""Which output is the loss, and how to fold a separate loss function into the model.

A model's output is its loss when it is a 0-dim tensor, carries ``.loss`` (HF models called with
``labels=``) or is a tuple whose first element is the loss. A model that returns predictions
is trained through :class:`WithLoss` (``loss_fn(model(*inputs), target)``), which keeps the
model's parameter names.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.core.errors import AutoparError


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
    """``forward(*inputs, target) = loss_fn(model(*inputs), target)``, with the model's own
    parameter and buffer names (its children are registered directly on this module)."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        if not callable(loss_fn):
            raise AutoparError(f"loss_fn must be callable(output, target), got {type(loss_fn).__name__}")
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        object.__setattr__(self, "_model", model)  # not a submodule: names stay unprefixed
        object.__setattr__(self, "_loss_fn", loss_fn)

    def train(self, mode: bool = True):
        super().train(mode)
        self._model.train(mode)
        return self

    def forward(self, *args):
        *inputs, target = args
        return self._loss_fn(self._model(*inputs), target)


__all__ = ["WithLoss", "loss_of"]
