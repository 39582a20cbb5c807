"""What capture accepts: an ``nn.Module``, pytrees of tensors and Python scalars as example
inputs, and tensors in dtypes autopar can plan. Anything else is a :class:`CaptureError` (or
:class:`UnsupportedDtypeError`) saying what to pass instead, before tracing starts."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.core.errors import CaptureError, UnsupportedDtypeError

_SCALAR_LEAVES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)
# What cost models, sharding rules and gloo/NCCL collectives handle (complex, float8 and
# quantized tensors are not planned).
SUPPORTED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool,
                              torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
# Complex buffers (rotary tables as Meta's Llama keeps them) and the activations made from them
# are planned and sent as real views; complex parameters and inputs are not.
BUFFER_DTYPES = SUPPORTED_DTYPES | {torch.complex64, torch.complex128}


def check_inputs(model, example_inputs, kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``torch.export``, after checking the model and the inputs' types."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs an nn.Module, got {type(model).__name__}",
                           hint="wrap a plain function in an nn.Module whose forward calls it")
    if isinstance(example_inputs, torch.Tensor):
        raise CaptureError("example_inputs must be a tuple of positional arguments, got a tensor",
                           hint="pass a one-element tuple: example_inputs=(x,)")
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example_inputs must be a tuple of positional arguments, got "
            f"{type(example_inputs).__name__}", hint="pass example_inputs=(x, ...) and keyword "
            "inputs as kwargs={...}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise CaptureError(f"kwargs must be a dict with str keys, got {type(kwargs).__name__}",
                           hint="pass keyword inputs as kwargs={'labels': y}")
    leaves, _ = pytree.tree_flatten_with_path((tuple(example_inputs), kwargs))
    for path, leaf in leaves:
        if not isinstance(leaf, _SCALAR_LEAVES):
            where = "inputs" + pytree.keystr(path)
            raise CaptureError(
                f"example input {where} has unsupported type {type(leaf).__name__}",
                reason="torch.export accepts only pytrees of tensors and Python scalars",
                hint="example inputs may be tensors, int/float/bool/str/None, torch.dtype/device "
                     "and tuples, lists and dicts of them (or classes registered with "
                     "torch.export.register_dataclass / torch.utils._pytree); pass other objects "
                     "to the model's constructor instead")
    return tuple(example_inputs), kwargs


def check_dtypes(model: nn.Module, args, kwargs) -> None:
    """Raise :class:`UnsupportedDtypeError` naming the first parameter, buffer or input whose
    dtype is not in :data:`SUPPORTED_DTYPES`."""
    tensors = [(f"parameter {n}", t, SUPPORTED_DTYPES) for n, t in model.named_parameters()]
    tensors += [(f"buffer {n}", t, BUFFER_DTYPES) for n, t in model.named_buffers()]
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), kwargs))
    tensors += [("input inputs" + pytree.keystr(p), t, SUPPORTED_DTYPES) for p, t in leaves
                if isinstance(t, torch.Tensor)]
    for what, t, supported in tensors:
        if t.dtype not in supported:
            raise UnsupportedDtypeError(
                f"{what} has dtype {t.dtype}, which autopar cannot plan: its sharding rules, cost "
                "models and collectives cover float32/64, float16, bfloat16, bool and integer "
                "tensors (and complex buffers), not complex parameters or inputs, float8 or "
                "quantized ones",
                hint="keep parameters, buffers and inputs in a supported dtype (e.g. "
                     "model.to(torch.float32); view complex values as real pairs with "
                     "torch.view_as_real)")


__all__ = ["BUFFER_DTYPES", "SUPPORTED_DTYPES", "check_dtypes", "check_inputs"]
