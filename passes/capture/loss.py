"""Which output is the loss, and how to fold a separate loss function into the model.

A model's loss is found anywhere in its output (a tensor, or tuples, lists, dicts, dataclasses
and HF ModelOutputs of them), by one rule that capture and :func:`loss_of` share
(:func:`loss_leaf`): the first leaf named ``loss`` (a dict key, field or attribute), else the one
0-dim floating leaf, else the first leaf when it is a 0-dim floating tensor (``(loss, aux)``).
A model that returns predictions is trained through :class:`WithLoss`
(``loss_fn(model(*inputs), target)``), which keeps the model's names for its parameters,
buffers, submodules and tensor constants.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError, InputError


def plain_output(output):
    """``output`` with every dataclass pytree does not know (a user's own output class) turned
    into a dict of its fields, recursively, so that torch.export can flatten it."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type) \
            and type(output) not in pytree.SUPPORTED_NODES:
        return {f.name: plain_output(getattr(output, f.name)) for f in dataclasses.fields(output)}
    if isinstance(output, dict) and type(output) is dict:
        return {k: plain_output(v) for k, v in output.items()}
    if type(output) in (tuple, list):
        return type(output)(plain_output(v) for v in output)
    return output


def leaf_names(spec, prefix: str = "") -> list[str]:
    """The name of every leaf of a pytree spec: its key path (``logits``, ``[0]``, ``aux.loss``),
    ``output`` for a bare tensor."""
    if spec.is_leaf():
        return [prefix or "output"]
    ctx = spec.context
    n = spec.num_children
    if isinstance(ctx, (list, tuple)) and len(ctx) == n and all(isinstance(k, str) for k in ctx):
        keys = [f"{prefix}.{k}" if prefix else k for k in ctx]
    elif isinstance(ctx, type) and len(getattr(ctx, "_fields", ())) == n:  # namedtuple
        keys = [f"{prefix}.{k}" if prefix else k for k in ctx._fields]
    else:
        keys = [f"{prefix}[{i}]" for i in range(n)]
    return [name for child, key in zip(spec.children(), keys) for name in leaf_names(child, key)]


def _is_scalar_float(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return getattr(leaf, "ndim", None) == 0 and isinstance(dtype, torch.dtype) and dtype.is_floating_point


def loss_leaf(names: list[str], leaves: list) -> int | None:
    """Index of the loss among an output's leaves (tensors or anything with ``ndim`` and
    ``dtype``), by the rule in the module docstring; ``None`` when there is none."""
    named = [i for i, name in enumerate(names) if name.rsplit(".", 1)[-1] == "loss" and _is_scalar_float(leaves[i])]
    if named:
        return named[0]
    scalars = [i for i, leaf in enumerate(leaves) if _is_scalar_float(leaf)]
    if len(scalars) == 1:
        return scalars[0]
    return 0 if scalars and scalars[0] == 0 else None


def loss_of(output) -> torch.Tensor:
    """The loss in a model's output (see the module docstring), as capture finds it."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and _is_scalar_float(loss):
        return loss
    leaves, spec = pytree.tree_flatten(plain_output(output))
    index = loss_leaf(leaf_names(spec), leaves)
    if index is None:
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves]
        raise AutoparError(
            f"cannot find the loss in a model output of type {type(output).__name__} (leaves {shapes}):"
            " return a 0-dim floating loss, alone or named 'loss' in a tuple, dict or dataclass;"
            " or pass loss_fn= (and target=)"
        )
    return leaves[index]


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


__all__ = ["WithLoss", "leaf_names", "loss_leaf", "loss_of", "plain_output", "unwrap"]
