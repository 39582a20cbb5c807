"""Stage times for the pipeline DP: every (unit range × sub-mesh × position) from per-part costs.

A *configuration* of a stage is its logical mesh ``(dp, tp)``, the intra-op candidate on the
``tp`` axis (:mod:`autopar.planner.candidates`), the ZeRO stage over ``dp`` (0: replicated
states, gradients all-reduced once per step; 1: optimizer states sharded, gradients
reduce-scattered and parameters all-gathered once per step; 3: everything sharded, parameters
gathered in forward and again in backward and gradients reduce-scattered, every micro-batch) and
whether its layers recompute their forward in backward (activation checkpointing: only each
layer's input is kept, at the price of a second forward; or selectively: the matmuls keep what
they save, the cheap runs between them keep only their inputs and run again).

Per configuration the costs of units ``i..j`` are sums of per-unit costs plus the pre part when
``i = 0`` and the post part when ``j = U − 1`` (:class:`RangeCosts`). With ``B`` micro-batches
a stage's time is::

    t = fwd + bwd + recompute + ZeRO-3 collectives + (tp and dp gradient collectives) / B
        + send/recv of its output activation and gradient (when another stage follows)

(gradient synchronisation runs once per step; spreading it over the micro-batches makes the
pipeline formula exact for one stage). The send is priced at the sender's ``dp``: exact between
equal meshes, low by ``max(1, tp_r / tp_s, dp_s / dp_r)`` for a next stage on another mesh, which
the plan built from the search's choice adds back
(:func:`autopar.planner.pipeline_plan.cross_mesh_excess`). Its peak memory per device is the step-peak model's
(:mod:`autopar.planner.stage_peak`) with ``f = min(s, B)`` micro-batches in flight for the
``s``-th stage from the end under 1F1B and ``f = B`` under GPipe. :func:`fill` keeps, per
(position, range, sub-mesh), the fastest configuration that fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from autopar.plan.zero import zero_state_bytes
from autopar.planner.layers import FIRST, LAYER, POST, PRE
from autopar.planner.stage_costs import PartCosts
from autopar.planner.stage_peak import StageMemory, range_max, range_sum, stage_memory

ZERO_STAGES = (1, 0, 3)  # in this order: on equal times the first (less memory) is kept


@dataclass(frozen=True)
class Config:
    """How one stage runs (module docstring)."""

    dp: int
    tp: int
    candidate: int  # index into the tp's candidate list
    zero: int
    recompute: bool | str  # False, True (whole layers) or "selective"


def _edges(units: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first = np.zeros((units, units))
    first[0, :] = 1.0
    last = np.zeros((units, units))
    last[:, units - 1] = 1.0
    return first, last, first * last


@dataclass
class RangeCosts:
    """One candidate at one ``(tp, b)`` over every unit range ``[i, j]`` (U × U arrays)."""

    time: np.ndarray  # forward + backward per micro-batch
    compute: np.ndarray  # of which compute
    step: np.ndarray  # tp-axis gradient collectives per step
    activations: np.ndarray  # bytes per micro-batch kept for backward
    reruns: dict  # recomputation policy -> (the forward run again, its compute, bytes per micro-batch kept)
    buffers: np.ndarray  # bytes of the model's buffers and constants the range holds
    boundary: float  # bytes per replica sent to the next stage per micro-batch
    params: list  # per unit: [(name, numel, itemsize, trained)]
    pre_params: list
    post_params: list
    shared: list  # parameters both the pre and the post part use (tied embeddings)
    flops: float  # of the whole model per step (forward + backward, no recomputation)
    layers_per_unit: int
    layered: bool
    part: PartCosts


def range_costs(pc: PartCosts, *, units: int, layers_per_unit: int, layered: bool, unread: float = 0.0) -> RangeCosts:
    """Spread a candidate's part costs over ``units`` pipeline units and sum every range
    (``unread``: bytes of the model state no op reads, which the first stage stores)."""
    idx = {p: k for k, p in enumerate(pc.parts)}
    first, last, _ = _edges(units)
    g = layers_per_unit

    def spread(values: np.ndarray, *, rc: bool = False) -> np.ndarray:
        if not layered:
            return range_sum(np.array([values[idx[p]] for p in pc.parts]))
        out = range_sum(np.full(units, g * values[idx[LAYER]]))
        out = out + first * (values[idx[FIRST]] - values[idx[LAYER]])
        if not rc:
            out = out + first * values[idx[PRE]] + last * values[idx[POST]]
        return out

    def kept(held: np.ndarray) -> np.ndarray:  # the layers recompute, the pre and post parts do not
        if not layered:
            return spread(held)
        return spread(held, rc=True) + first * pc.activations[idx[PRE]] + last * pc.activations[idx[POST]]

    if layered:
        params = [pc.params[idx[LAYER]] * g for _ in range(units)]
        pre_params, post_params = pc.params[idx[PRE]], pc.params[idx[POST]]
        flops = float(pc.flops[idx[PRE]] + pc.flops[idx[POST]] + pc.flops[idx[FIRST]]
                      + (units * g - 1) * pc.flops[idx[LAYER]])
    else:
        params = [pc.params[idx[p]] for p in pc.parts]
        pre_params, post_params = [], []
        flops = float(pc.flops.sum())
    reruns = {policy: (spread(r.again, rc=True), spread(r.again_compute, rc=True), kept(r.held))
              for policy, r in pc.reruns.items()}
    pre_names = {p[0] for p in pre_params}
    return RangeCosts(
        time=spread(pc.fwd) + spread(pc.bwd), compute=spread(pc.compute), step=spread(pc.step),
        activations=spread(pc.activations), buffers=spread(pc.buffers) + first * unread, reruns=reruns,
        boundary=pc.boundary,
        params=params, pre_params=pre_params, post_params=post_params,
        shared=[p for p in post_params if p[0] in pre_names], flops=flops, layers_per_unit=g, layered=layered,
        part=pc)


# ----------------------------------------------------------------------------- data-parallel axis


@dataclass
class DataParallelRange:
    """ZeRO costs of one candidate's parameters over ``dp`` for every unit range."""

    microbatch: np.ndarray  # ZeRO-3 gathers and reduce-scatters per micro-batch
    step: np.ndarray  # gradient reduction (and ZeRO-1 parameter gather) per step
    states: np.ndarray  # (3, U, U): parameter, gradient, optimizer-state bytes per device
    gathered: float  # ZeRO-3: bytes of the largest layer (or pre/post part) gathered at once
    largest: np.ndarray  # (U, U): bytes of the range's largest trained parameter gradient per device


class DataParallelCosts:
    """ZeRO collectives and states over the ``dp`` axis of a stage's logical mesh, cached.

    ``state_bytes``: (parameter, gradient, optimizer state) bytes per element; ``copy``: whether a
    ZeRO-1 shard is a copy of its parameter's elements (no fp32 master holds them already:
    :func:`autopar.plan.zero.zero_state_bytes`). A parameter the first and the last stage both
    hold (a tied embedding) keeps whole optimizer state under ZeRO-1 and is all-reduced, as
    :meth:`autopar.runtime.pipeline.PipelineProgram.zero_shards` runs it.
    """

    def __init__(self, cluster, state_bytes, *, copy: bool = False):
        self.cluster = cluster
        self.state_bytes = state_bytes
        self.copy = copy
        self._clusters: dict = {}
        self._times: dict = {}
        self._costs: dict = {}

    def sub_cluster(self, dp: int, tp: int):
        key = (dp, tp)
        if key not in self._clusters:
            self._clusters[key] = dataclasses.replace(self.cluster, mesh_shape=(dp, tp))
        return self._clusters[key]

    def _time(self, kind: str, nbytes: float, dp: int, tp: int) -> float:
        key = (kind, nbytes, dp, tp)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = self.sub_cluster(dp, tp).collective_time(kind, nbytes, 0)
        return t

    def costs(self, params, *, dp: int, tp: int, zero: int) -> tuple[float, float, np.ndarray, float, float]:
        """(per micro-batch s, per step s, (p, g, o) bytes per device, ZeRO-3 gathered bytes, the
        largest trained parameter's gradient bytes per device)."""
        key = (tuple(params), dp, tp, zero)
        hit = self._costs.get(key)
        if hit is None:
            hit = self._costs[key] = self._uncached(params, dp=dp, tp=tp, zero=zero)
        return hit

    def _uncached(self, params, *, dp: int, tp: int, zero: int):
        p, g, o = self.state_bytes
        mb = step = gathered = largest = 0.0
        states = np.zeros(3)
        for _, numel, item, trained in params:
            nbytes = numel * item
            if trained:
                largest = max(largest, numel * g / (dp if zero == 3 else 1))
            if not trained:  # frozen: its weight only, sharded under ZeRO-3 and gathered for forward and backward
                states[0] += numel * p / (dp if zero > 1 else 1)
                if zero > 1 and dp > 1:
                    gathered += numel * p
                    mb += 2 * self._time("all_gather", nbytes, dp, tp)
            elif dp == 1 or zero == 0:
                states += (numel * p, numel * g, numel * o)
                if dp > 1:
                    step += self._time("all_reduce", nbytes, dp, tp)
            elif zero == 1:
                states += zero_state_bytes((numel * p, numel * g, numel * o), (0,), (dp, tp), 1, copy=self.copy)
                step += self._time("reduce_scatter", nbytes, dp, tp) + self._time("all_gather", nbytes, dp, tp)
            else:
                states += (numel * p / dp, numel * g / dp, numel * o / dp)
                gathered += numel * p
                mb += 2 * self._time("all_gather", nbytes, dp, tp) + self._time("reduce_scatter", nbytes, dp, tp)
        return mb, step, states, gathered, largest

    def ranges(self, rc: RangeCosts, *, dp: int, tp: int, zero: int) -> DataParallelRange:
        units = len(rc.params)
        first, last, both = _edges(units)
        per = [self.costs(p, dp=dp, tp=tp, zero=zero) for p in rc.params]
        pre = self.costs(rc.pre_params, dp=dp, tp=tp, zero=zero)
        post = self.costs(rc.post_params, dp=dp, tp=tp, zero=zero)
        shared = self.costs(rc.shared, dp=dp, tp=tp, zero=zero)
        if zero == 1 and rc.shared:  # held by two stages: whole (class docstring), once by one stage
            whole = self.costs(rc.shared, dp=dp, tp=tp, zero=0)
            pre, post = (tuple(c[k] + whole[k] - shared[k] for k in range(3)) + c[3:] for c in (pre, post))
            shared = tuple(2 * whole[k] - shared[k] for k in range(3)) + shared[3:]

        def total(k):
            return range_sum(np.array([c[k] for c in per])) + first * pre[k] + last * post[k] - both * shared[k]

        states = np.stack([
            range_sum(np.array([c[2][q] for c in per])) + first * pre[2][q] + last * post[2][q]
            - both * shared[2][q] for q in range(3)])
        gathered = max([c[3] / rc.layers_per_unit for c in per] + [pre[3], post[3]])
        return DataParallelRange(total(0), total(1), states, gathered,
                                 range_max(np.array([c[4] for c in per]), pre[4], post[4]))


# ----------------------------------------------------------------------------- one configuration


@dataclass
class StageArrays:
    """One configuration's time, compute share and memory over every unit range (U × U)."""

    time: np.ndarray
    compute: np.ndarray
    memory: StageMemory
    states: np.ndarray  # (3, U, U)


def stage_arrays(rc: RangeCosts, dpr: DataParallelRange, cfg: Config, *, batches: int, link, optimizer: str,
                 master: bool = False) -> StageArrays:
    """Time per micro-batch and memory of every unit range under ``cfg`` (module docstring)."""
    units = rc.time.shape[0]
    _, last, both = _edges(units)
    step = rc.step + dpr.step
    if rc.shared:  # a tied weight on the first and the last stage: its two gradients are summed
        tied = sum(n * i for _, n, i, _ in rc.shared)
        step = step + (last - both) * 2 * (tied / link.bandwidth + link.latency)
    time = rc.time + dpr.microbatch + step / batches
    compute = rc.compute.copy()
    held = rc.activations
    if cfg.recompute:
        again, again_compute, held = rc.reruns[cfg.recompute]
        time = time + again
        compute = compute + again_compute
    send = 2 * (rc.boundary / link.bandwidth + link.latency)  # every tp rank sends the whole boundary
    time = time + (1.0 - last) * send
    memory = stage_memory(rc.part, dpr.states, held, units=units,
                          layers_per_unit=rc.layers_per_unit, layered=rc.layered, cfg=cfg,
                          gathered=(2.0 if cfg.recompute is True else 1.0) * dpr.gathered if cfg.zero == 3 and cfg.dp > 1
                          else 0.0, optimizer=optimizer,
                          master=master, buffers=rc.buffers, largest=dpr.largest)
    return StageArrays(time, compute, memory, dpr.states)


def in_flight(position: np.ndarray | int, *, batches: int, schedule: str):
    """Micro-batches of activations the ``position``-th stage from the end holds at its peak."""
    return np.minimum(position, batches) if schedule == "1f1b" else np.full_like(position, batches)


@dataclass
class Table:
    """``times[m, s − 1, i, j]`` and the configuration reaching it (index into ``configs``);
    :meth:`dp_times` is the ``(s, i, j, m)`` layout the stage DP takes."""

    times: np.ndarray
    config: np.ndarray
    configs: list = field(default_factory=list)

    def dp_times(self) -> np.ndarray:
        return np.ascontiguousarray(self.times.transpose(1, 2, 3, 0))


def new_table(stages: int, units: int, meshes: int) -> Table:
    return Table(np.full((meshes, stages, units, units), np.inf),
                 np.full((meshes, stages, units, units), -1, dtype=np.int64))


def fill(table: Table, m: int, arrays: StageArrays, cfg_index: int, *, limit: float, batches: int,
         schedule: str) -> bool:
    """Enter one configuration of sub-mesh ``m`` where it fits and is faster; whether it fits
    at every position and range."""
    S, U = table.times.shape[1], table.times.shape[2]
    flight = in_flight(np.arange(1, S + 1), batches=batches, schedule=schedule)
    upper = _upper(U)
    time = np.where(upper, arrays.time, np.inf)
    fits = arrays.memory.peak(flight, batches) <= limit
    candidate = np.where(fits, time[None, :, :], np.inf)
    better = candidate < table.times[m]
    np.copyto(table.times[m], candidate, where=better)
    np.copyto(table.config[m], cfg_index, where=better)
    return bool(fits[-1][upper].all())


_UPPER: dict[int, np.ndarray] = {}


def _upper(units: int) -> np.ndarray:
    if units not in _UPPER:
        _UPPER[units] = np.triu(np.ones((units, units), bool))
    return _UPPER[units]


__all__ = ["Config", "DataParallelCosts", "DataParallelRange", "RangeCosts", "StageArrays", "Table",
           "ZERO_STAGES", "fill", "in_flight", "new_table", "range_costs", "stage_arrays"]
