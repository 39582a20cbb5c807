"""Capture a model again at the micro-batch size, for the stages of a pipeline.

A captured graph bakes in its batch size (view sizes, factory shapes), and a pipeline stage runs
one micro-batch. :func:`capture_microbatch` traces the model once more with inputs whose first
(batch) dim is divided by the number of micro-batches (zeros of the captured dtypes, on the
captured device, meta for a model captured on meta: export runs on fake tensors, values do not
matter) and checks that the graph is the same up to shapes, so
that the plan's node names hold for it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree

from autopar.core.errors import PipelineError
from autopar.core.precision import named
from autopar.passes.capture.training import capture_for_training


def _signature(captured) -> list[tuple]:
    return [(n.op, n.name, str(n.target)) for n in captured.graph_module.graph.nodes]


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # captured -> {key: small capture}


def capture_microbatch(model, captured, *, loss_fn=None, micro_batches: int, mixed_precision: bool | str = False):
    """``model``'s training capture at ``1 / micro_batches`` of ``captured``'s batch (made once
    per captured graph, model, loss and micro-batch count); ``mixed_precision`` as ``captured``
    was made (:func:`~autopar.passes.capture.training.capture_for_training`)."""
    key = (id(model), id(loss_fn), micro_batches, mixed_precision)
    cached = _CACHE.setdefault(captured, {})
    if key not in cached:
        cached[key] = _capture(model, captured, loss_fn, micro_batches, mixed_precision)
    return cached[key]


def stage_capture(model, captured, plan, *, loss_fn=None):
    """The graph a pipelined ``plan``'s stages are cut from: ``captured`` at the micro-batch size
    (``captured`` itself for one micro-batch)."""
    if plan.micro_batches == 1:
        return captured
    return capture_microbatch(model, captured, loss_fn=loss_fn, micro_batches=plan.micro_batches,
                              mixed_precision=named(plan.precision).mixed_precision)


def _moe(captured) -> dict:
    """How ``captured`` traced routed experts, for tracing them alike."""
    return {"moe_dispatch": captured.moe_dispatch, "moe_capacity_factor": captured.moe_capacity_factor}


def _capture(model, captured, loss_fn, micro_batches: int, mixed_precision: bool | str):
    placeholders = {n.name: n for n in captured.graph_module.graph.find_nodes(op="placeholder")}
    leaves = []
    for inp in captured.inputs:
        if inp.kind != "user_input":
            continue
        shape = tuple(inp.meta.shape) if inp.meta is not None else ()
        if not shape or shape[0] % micro_batches:
            raise PipelineError(f"input {inp.name!r} of shape {shape} has no first (batch) dim that divides"
                                f" into {micro_batches} micro-batches: pick a micro-batch count dividing it")
        leaves.append(torch.zeros((shape[0] // micro_batches,) + shape[1:], dtype=inp.meta.dtype,
                                  device=placeholders[inp.node].meta["val"].device))
    spec = captured.exported_program.call_spec.in_spec
    if spec is None or spec.num_leaves != len(leaves):
        raise PipelineError("the model takes inputs other than tensors; pipelined runs need tensor inputs only")
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    if loss_fn is not None:
        target = kwargs.pop("target")
        small = capture_for_training(model, example_inputs=args or kwargs, example_target=target, loss_fn=loss_fn,
                                     mixed_precision=mixed_precision, **_moe(captured))
    else:
        if args and kwargs:
            raise PipelineError("the model was captured with both positional and keyword inputs; pass one kind")
        small = capture_for_training(model, example_inputs=args or kwargs, mixed_precision=mixed_precision,
                                     **_moe(captured))
    want, got = _signature(captured), _signature(small)
    if want != got:
        diff = next((w, g) for w, g in zip(want + [None], got + [None]) if w != g)
        raise PipelineError(
            f"captured at the micro-batch size the model gives another graph (first difference: {diff[0]}"
            f" became {diff[1]}), so the plan's stages do not apply to it: plan with micro_batches=1 or"
            " a batch whose micro-batches trace alike")
    return small


__all__ = ["capture_microbatch", "stage_capture"]
