"""``autopar_local_op``: what an emitted program calls where a sharding rule's strategy names a
local implementation (``Strategy.local``) instead of running the ATen op on the local pieces.

The op travels by name (``"aten.embedding.default"``) and the implementation is looked up in
the rules registry when the program first runs it.
"""

from __future__ import annotations

import functools

import torch

from autopar.passes.rules.registry import local_impl


def autopar_local_op(op: str, impl: str, ctx, args, kwargs):
    """Run the local implementation ``impl`` of op ``op`` (``"aten.embedding.default"``)'s
    sharding rule on this rank's pieces; ``ctx`` is the rank's ``LocalContext``."""
    target, fn = _resolve(op, impl)
    return fn(target, tuple(args), dict(kwargs), ctx)


@functools.lru_cache(maxsize=None)
def _resolve(op: str, impl: str):
    """``(op overload, local implementation)`` named by an emitted ``autopar_local_op`` call."""
    namespace, name, overload = op.split(".")
    target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    return target, local_impl(target, impl)


__all__ = ["autopar_local_op"]
