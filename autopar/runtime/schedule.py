"""One rank's pipeline schedule: its stage's forwards and backwards over the micro-batches.

:func:`order` is the order a stage runs them in, holding at most ``in_flight`` micro-batches of
activations (:func:`in_flight`): under GPipe every forward, then every backward; under 1F1B, for
stage ``k`` of ``S``, ``min(S − k, B)`` forwards, then a backward and a forward in turn, then the
remaining backwards. :func:`run_schedule` runs it: a forward receives its stage's inputs from
the previous stage (the first stage takes its micro-batch of the user inputs), runs the stage
module and sends its outputs on; a backward receives the gradients of its outputs (the last stage
starts from its share of the loss), runs autograd and sends the gradients of its inputs back.
Receives block in schedule order and sends are asynchronous (:mod:`autopar.runtime.boundary`),
so every stage's order runs without deadlock.
"""

from __future__ import annotations

import torch

from autopar.runtime.boundary import BACKWARD, FORWARD, Port


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``stages`` holds at its peak."""
    return micro_batches if schedule == "gpipe" else min(stages - stage, micro_batches)


def order(micro_batches: int, in_flight_: int):
    """``("F" | "B", micro-batch)`` in the order one stage runs them (module docstring)."""
    done = 0
    for i in range(micro_batches):
        yield "F", i
        if i + 1 >= in_flight_:
            yield "B", done
            done += 1
    for j in range(done, micro_batches):
        yield "B", j


def run_schedule(module, stage, steps, *, micro_batches: int, feeds, upstream: Port | None,
                 downstream: Port | None, loss_gradient=None) -> list:
    """Run ``steps`` (:func:`order`) of ``module`` (this rank's ``StageModule`` of split stage
    ``stage``); ``feeds`` are the first stage's micro-batches (None elsewhere);
    ``loss_gradient(loss)``: the gradient the last stage's backward starts from (fp16's loss
    scale; None: one). Returns the last stage's micro-batch losses (detached; empty elsewhere)."""
    received = upstream is not None
    grad_in = [b.requires_grad for b in stage.inputs]
    if received:
        feeds = [upstream.buffers(FORWARD, [True] * len(stage.inputs)) for _ in range(micro_batches)]
    grads = [downstream.buffers(BACKWARD, [b.requires_grad for b in stage.outputs]) for _ in range(micro_batches)] \
        if downstream is not None else []
    held, losses = {}, []
    for what, i in steps:
        if what == "F":
            ins = feeds[i]
            if received:
                upstream.receive(ins, i, FORWARD)
                ins = [x.requires_grad_(g) for x, g in zip(ins, grad_in)]
            out = module(*ins)
            if downstream is None:
                losses.append(out.detach())
            else:
                downstream.send(out, i, FORWARD)
            held[i] = (ins, out)
            continue
        ins, out = held.pop(i)
        if downstream is None:
            out.backward(loss_gradient(out) if loss_gradient is not None else None)
        else:
            downstream.receive(grads[i], i, BACKWARD)
            pairs = [(o, g) for o, g in zip(out, grads[i]) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if received:
            upstream.send([x.grad if g else None for x, g in zip(ins, grad_in)], i, BACKWARD)
    for port in (upstream, downstream):
        if port is not None:
            port.finish()
    return losses


__all__ = ["in_flight", "order", "run_schedule"]
