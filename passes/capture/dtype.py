"""Capture a model as its copy in another floating dtype (mixed precision), without copying it.

Under mixed precision the program is the graph of ``model.to(torch.bfloat16)`` fed inputs cast to
bf16: the ops the model writes with explicit dtypes (an RMSNorm's upcast to float32 and back to
the input's dtype, a mask built in float32) then do what the bf16 model does. :func:`in_dtype`
gives the model that copy's parameters and buffers while tracing: uninitialised tensors of the
same shapes in ``dtype`` on the same device (free on ``meta``; export reads no values), shared
where the model shares them (tied weights), put back afterwards.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_map


def cast_floating(tree, dtype: torch.dtype):
    """``tree`` with every floating tensor in ``dtype`` (other leaves as they are)."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


@contextlib.contextmanager
def in_dtype(model: nn.Module, dtype: torch.dtype):
    """While inside, ``model``'s floating parameters and buffers are stand-ins in ``dtype`` (see
    the module docstring); nothing changes when they already are."""
    swapped, made = [], {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in made:
                    stand_in = torch.empty_like(t, dtype=dtype)
                    made[id(t)] = nn.Parameter(stand_in, t.requires_grad) if isinstance(t, nn.Parameter) else stand_in
                swapped.append((table, name, t))
                table[name] = made[id(t)]
    try:
        yield model
    finally:
        for table, name, t in swapped:
            table[name] = t


__all__ = ["cast_floating", "in_dtype"]
