"""A pipeline stage's peak memory per device, from the same step-peak model as one-program plans
(:mod:`autopar.planner.peak`), composed over unit ranges for the stage DP.

A stage runs ``B`` micro-batches in its schedule's order (1F1B: the ``s``-th stage from the end
holds ``f = min(s, B)`` micro-batches' saved activations before its first backward; GPipe: all
``B``), each backward a walk over its nodes in reverse. Its peak is the largest of:

- **the first backward**: parameters, optimizer state, ``f − 1`` other micro-batches' saved
  activations and the walk's highest moment (what it still holds, the gradients it made so far,
  the backward in flight);
- **a later backward** (when ``B ≥ 2``): the same with ``min(f, B − 1) − 1`` other micro-batches
  held, and the gradients summed so far; each gradient the pass makes joins its sum as it comes
  (out of place, :func:`autopar.comm.buckets.deferred_gradient_sums`: the sum, the pass's
  gradient and the new sum live together for a moment, counted for the range's largest
  gradient), so the pass's own gradients do not pile up beside the sums. Sums and the pass's
  gradients are temporaries, not the gradients ``.grad`` holds when the step ends
  (data-parallel sums are deferred to then);
- **the optimizer step**: parameters, gradients, optimizer state and the optimizer's scratch
  (Adam: one tensor of each parameter's size);

each plus the model's buffers and constants the stage reads (a causal mask, rotary tables: whole,
counted with the parameters, as the program stores them and ``verify`` measures them), the
pipeline's receive buffers, allocated for the whole step: one per
micro-batch for each value the stage receives and for each gradient of a value it sends, the
values it sent of each micro-batch whose backward has not run (autograd starts from them; a
value gathered whole to be sent is a copy no op saves), and, under ZeRO-3, the largest layer
gathered.

The walk of a stage is composed from the window's parts (:mod:`autopar.planner.stage_costs`):
at a part's highest moment the stage still holds what the parts before it saved and has made the
gradients of the parts after it. Repeated layers are identical, so among them the first and the
last are the highest. A stage recomputing selectively holds what each part keeps (its matmuls'
saved tensors, the cut runs' inputs) and walks each part with its runs made again, as a
one-program plan does. A stage recomputing whole layers holds each layer's input instead of its saved
activations, and the layer in backward runs its forward again (its walk saves the whole layer,
and gathers again the weights it stores sharded, which it then holds: under ZeRO-3 a second
gathered layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.core.precision import MOMENTS, stepped_copy_share
from autopar.plan import MemoryBreakdown
from autopar.planner.layers import FIRST, LAYER, POST, PRE


def range_sum(unit: np.ndarray) -> np.ndarray:
    prefix = np.concatenate([[0.0], np.cumsum(unit)])
    return prefix[None, 1:] - prefix[:-1, None]  # [i, j] = Σ unit[i..j] (meaningful for j ≥ i)


def range_max(unit: np.ndarray, first: float = 0.0, last: float = 0.0) -> np.ndarray:
    """``[i, j]`` = the largest of ``unit[i..j]``, with ``first`` where ``i = 0`` and ``last``
    where ``j`` is the last unit (meaningful for ``j ≥ i``)."""
    units = len(unit)
    out = np.zeros((units, units))
    for i in range(units):
        out[i, i:] = np.maximum.accumulate(unit[i:])
    out[0, :] = np.maximum(out[0, :], first)
    out[:, -1] = np.maximum(out[:, -1], last)
    return out


@dataclass
class StageMemory:
    """Every unit range's memory components (U × U arrays; module docstring)."""

    states: np.ndarray  # (3, U, U): parameter, gradient, optimizer-state bytes
    held: np.ndarray  # saved bytes of one micro-batch held until its backward
    walk: np.ndarray  # (3, U, U): a backward's walk at its highest: saved, gradients made, in flight
    buffers: np.ndarray  # receive buffers per micro-batch
    gathered: np.ndarray | float  # ZeRO-3: the largest layer gathered
    scratch: float  # 1.0 when the optimizer's step holds a parameter-sized scratch, else 0.0
    masters: float = 0.0  # mixed precision at ZeRO 0 or 3: the fp32 masters' share of the optimizer bytes
    model_buffers: np.ndarray | float = 0.0  # the model's buffers and constants, held like parameters
    largest: np.ndarray | float = 0.0  # the largest trained parameter's gradient (a later backward's sum)
    sent: np.ndarray | float = 0.0  # bytes of one micro-batch's values sent on, held until its backward

    def step_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """(gradients, scratch) at the optimizer step: the fp32 masters' under mixed precision
        (the program's gradients were moved into them), else the program's and parameter-sized."""
        p, g, o = self.states
        if self.masters:
            return self.masters * o, self.scratch * self.masters * o
        return g, self.scratch * p

    def moments(self, flight, batches: int) -> np.ndarray:
        """(3, ..., U, U): the first backward, a later one and the optimizer step, for ``flight``
        micro-batches in flight (an int, or an array broadcast in front)."""
        p, g, o = self.states
        p = p + self.model_buffers
        flight = np.asarray(flight, dtype=float)[..., None, None]
        base = p + o + self.gathered + batches * self.buffers + self.walk.sum(axis=0)
        first = base + (flight - 1) * self.held + flight * self.sent
        summed = g - self.walk[1] + 2 * self.largest  # a later pass's gradients join the sums as they come
        later = (base + summed + (np.minimum(flight, batches - 1) - 1) * self.held
                 + np.minimum(flight, batches - 1) * self.sent if batches >= 2 else np.full_like(first, -np.inf))
        grads, scratch = self.step_terms()
        step = np.broadcast_to(p + grads + o + scratch + batches * self.buffers, first.shape)
        return np.stack([first, later, step])

    def peak(self, flight, batches: int) -> np.ndarray:
        """Peak bytes per device of every range for ``flight`` micro-batches in flight."""
        return self.moments(flight, batches).max(axis=0)

    def breakdown(self, i: int, j: int, flight: int, batches: int) -> MemoryBreakdown:
        """Range ``[i, j]``'s peak split by kind (module docstring: the gradients of a backward
        are temporaries when the step has several)."""
        which = int(np.argmax(self.moments(flight, batches)[:, i, j]))
        p, g, o = (float(x[i, j]) for x in self.states)
        p += float(np.broadcast_to(self.model_buffers, self.held.shape)[i, j])
        comm = batches * float(self.buffers[i, j])
        if which == 2:
            grads, scratch = (float(x[i, j]) for x in self.step_terms())
            return MemoryBreakdown(parameters=p, gradients=grads, optimizer=o, activations=0.0,
                                   temporaries=scratch, communication=comm)
        saved, made, running = (float(x[i, j]) for x in self.walk)
        others = flight - 1 if which == 0 else min(flight, batches - 1) - 1
        made = g + 2 * float(np.broadcast_to(self.largest, self.held.shape)[i, j]) if which == 1 else made
        grads, running = (0.0, running + made) if batches >= 2 else (made, running)
        gathered = float(np.broadcast_to(self.gathered, self.held.shape)[i, j])
        sent = float(np.broadcast_to(self.sent, self.held.shape)[i, j])
        return MemoryBreakdown(parameters=p, gradients=grads, optimizer=o,
                               activations=saved + others * float(self.held[i, j]) + (others + 1) * sent,
                               temporaries=running + gathered, communication=comm)


def _pick(candidates) -> np.ndarray:
    """Per range, the components of the candidate moment with the largest total (-inf: absent)."""
    stacked = np.stack([np.stack(c) for c in candidates])  # (C, K, U, U)
    best = np.argmax(stacked.sum(axis=1), axis=0)
    out = np.take_along_axis(stacked, best[None, None], axis=0)[0]
    return np.where(np.isfinite(out), out, 0.0)


def walk_ranges(pc, held: np.ndarray, *, units: int, layers_per_unit: int, layered: bool, recompute: bool | str,
                grad_scale: float) -> np.ndarray:
    """(3, U, U): the highest moment of the backward walk of every unit range composed from
    the parts' walks of ``pc`` (a :class:`~autopar.planner.stage_costs.PartCosts`; module
    docstring); ``held``: the range's bytes held per micro-batch, ``grad_scale`` what the
    gradients are divided by (ZeRO-3 shards them). Under selective recomputation a part's walk
    holds what the part keeps itself, as without recomputation."""
    idx = {p: k for k, p in enumerate(pc.parts)}
    part_held = pc.reruns[recompute].held if recompute else pc.activations
    whole = recompute is True  # a whole layer's checkpoint is held beside its recomputed walk
    grads = pc.grads * grad_scale
    rows, cols = np.indices((units, units))
    upper = cols >= rows
    moments = []  # (valid, held before, gradients made after, walk)

    if layered:
        first, last = (rows == 0).astype(float), (cols == units - 1).astype(float)
        n = (cols - rows + 1) * layers_per_unit - first  # repeated layers besides the first
        h = {p: float(part_held[idx[p]]) if p in (FIRST, LAYER) else float(pc.activations[idx[p]])
             for p in pc.parts}
        g = {p: float(grads[idx[p]]) for p in pc.parts}
        own = {p: (h[p] if whole and p in (FIRST, LAYER) else 0.0) for p in pc.parts}
        post = last * h[POST]
        moments += [
            (upper & (last > 0), held - h[POST], 0.0, POST),
            (upper & (n >= 1), held - post - h[LAYER] + own[LAYER], last * g[POST], LAYER),
            (upper & (n >= 1), held - post - n * h[LAYER] + own[LAYER], last * g[POST] + (n - 1) * g[LAYER], LAYER),
            (upper & (first > 0), h[PRE] + own[FIRST], last * g[POST] + n * g[LAYER], FIRST),
            (upper & (first > 0), 0.0, last * g[POST] + n * g[LAYER] + g[FIRST], PRE),
        ]
    else:
        before, after = range_sum(part_held), range_sum(grads)
        for p, part in enumerate(pc.parts):
            inside = upper & (rows <= p) & (cols >= p)
            held_before = (before[rows, p - 1] if p else 0.0) * (rows < p) + (part_held[p] if whole else 0.0)
            made_after = np.where(cols > p, after[min(p + 1, units - 1), cols], 0.0)
            moments.append((inside, held_before, made_after, part))
    candidates = []
    walks = pc.reruns[recompute].walks if recompute else pc.walks
    for valid, before, after, part in moments:
        s, m, r = walks[idx[part]].peak
        candidates.append([np.where(valid, before + s, -np.inf), np.where(valid, after + m * grad_scale, -np.inf),
                           np.where(valid, r, -np.inf)])
    return _pick(candidates)


def stage_memory(pc, states, held, *, units, layers_per_unit, layered, cfg, gathered, optimizer: str,
                 master: bool = False, buffers: np.ndarray | float = 0.0,
                 largest: np.ndarray | float = 0.0) -> StageMemory:
    """The :class:`StageMemory` of every range of candidate ``pc`` under configuration ``cfg``
    (``states``: (3, U, U) model-state bytes; ``held``: bytes held per micro-batch;
    ``gathered``: ZeRO-3's gathered layer, 0 otherwise; ``master``: mixed precision's fp32
    masters; ``buffers``: the model buffers and constants the range holds)."""
    scale = 1.0 / cfg.dp if cfg.zero == 3 else 1.0
    walk = walk_ranges(pc, held, units=units, layers_per_unit=layers_per_unit, layered=layered,
                       recompute=cfg.recompute, grad_scale=scale)
    rows, cols = np.indices((units, units))
    cross, fresh = (x[:, 0] + cfg.dp * x[:, 1] for x in (pc.crossing, pc.sent))
    if layered:
        idx = {p: k for k, p in enumerate(pc.parts)}
        into = out = np.full((units, units), float(cross[idx[FIRST]]))
        sent = np.full((units, units), float(fresh[idx[FIRST]]))
    else:
        into, out, sent = cross[np.maximum(rows - 1, 0)], cross[cols], fresh[cols]
    last = cols == units - 1
    receive = (rows > 0) * into + ~last * out
    masters = stepped_copy_share(optimizer) if master and cfg.zero in (0, 3) else 0.0
    return StageMemory(states, held, walk, receive, gathered, 1.0 if MOMENTS[optimizer] else 0.0, masters, buffers,
                       largest, ~last * sent)


__all__ = ["StageMemory", "range_max", "range_sum", "stage_memory", "walk_ranges"]
