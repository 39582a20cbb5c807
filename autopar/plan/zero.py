"""What ZeRO-1 and ZeRO-2 change in a one-program plan: the collectives of the optimizer step and
the model states per device (the runtime's side is :mod:`autopar.runtime.zero`).

A parameter's ZeRO axes are the mesh axes the program sums its gradient over as data
parallelism does (on the parameter itself, before any use). Over them, with ``n`` the axes'
sizes multiplied, each rank steps a flat chunk of ``ceil(piece / n)`` elements of its piece:

- ZeRO-1: the gradient is all-reduced as without ZeRO (one all-reduce per axis), then after the
  step an all-gather per axis (innermost first) brings the updated chunks back: optimizer state
  / n, gradients whole;
- ZeRO-2: a reduce-scatter per axis (outermost first) replaces the all-reduce, so the gradient
  too is held / n; the same all-gathers follow the step. On a ring a reduce-scatter and an
  all-gather move the bytes of one all-reduce.

Bytes are per rank as nccl-tests counts them (an all-gather's output, a reduce-scatter's input),
of the padded flat piece in the dtype the program holds the parameter in.
"""

from __future__ import annotations

import math

LEVELS = (0, 1, 2)  # the ZeRO stages of a one-program plan (ZeRO-3 is its parameters' placements)


def zero_step_collectives(name: str, numel: int, itemsize: float, axes, mesh_shape, zero: int
                          ) -> list[tuple[str, str, int, float, str]]:
    """``(phase, kind, mesh axis, bytes per rank, name)`` of the gradient sums and parameter
    gathers of one parameter (``name``: its placeholder) whose piece holds ``numel`` elements of
    ``itemsize`` bytes, summed over mesh ``axes`` (ascending), at ZeRO stage ``zero``."""
    axes = [a for a in axes if mesh_shape[a] > 1]
    n = math.prod(mesh_shape[a] for a in axes)
    padded = -(-numel // n) * n * itemsize
    out = []
    held = padded
    for a in axes:  # outermost first, each reduce-scatter on what the previous one left
        if zero == 2:
            out.append(("backward", "reduce_scatter", a, held, name))
            held /= mesh_shape[a]
        else:  # the program's own gradient sums, of the whole piece
            out.append(("backward", "all_reduce", a, numel * itemsize, name))
    if zero:
        held = padded / n
        for a in reversed(axes):  # innermost first, each gather's output the next one's input
            held *= mesh_shape[a]
            out.append(("optimizer", "all_gather", a, held, name))
    return out


def zero_state_bytes(state: tuple[float, float, float], axes, mesh_shape, zero: int, *,
                     copy: bool) -> tuple[float, float, float]:
    """One parameter's (parameter, gradient, optimizer-state) bytes per device at ZeRO stage
    ``zero`` over ``axes``, from its bytes without ZeRO. ``copy``: the shard the optimizer steps
    is a copy of the parameter's elements (no fp32 master holds them already), ``p / n`` more
    optimizer bytes."""
    n = math.prod(mesh_shape[a] for a in axes)
    p, g, o = state
    if not zero:
        return state
    return p, g / n if zero == 2 else g, (o + (p if copy else 0.0)) / n


__all__ = ["LEVELS", "zero_state_bytes", "zero_step_collectives"]
