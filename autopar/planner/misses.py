"""A search's tries that fit no plan, their errors made only when one is reported.

A try that nothing fits reports its least-memory plan's peak, and building that plan (its ZeRO
analysis above all) costs more than the rest of the try. Where a floor on the peak of every
plan on any mesh (:func:`unfit_floor`, before any cost graph), of every choice
(:func:`choices_floor`, before any solve) or of the least-memory choice (:func:`peak_floor`,
before its build) is over the limit, or one on every choice's host share with the parameters
offloaded (:func:`host_floor`) is over the host's, the try raises :class:`Unbuilt`
instead, and :func:`closest_miss` makes only the misses whose floor is below the smallest peak
found so far: the error it returns is the one building every miss would have picked. Where a
later saver's plan fits, the misses only say how close they came (:func:`least_known_peak`):
none is made.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from autopar.core.errors import InfeasibleError
from autopar.core.placement import Shard
from autopar.core.precision import MOMENTS, precision_of, stepped_copy_share
from autopar.planner.offload import host_bytes_floor, host_limit, offload
from autopar.planner.peak import step_walk
from autopar.planner.savers import saver_levels
from autopar.solver.infeasible import format_bytes


class Unbuilt(InfeasibleError):
    """A try's "no plan fits" whose plan is not built yet: ``floor`` bounds the peak its error
    reports from below; :meth:`made` builds it (``make`` raises the InfeasibleError)."""

    def __init__(self, floor: float, make: Callable[[], object]):
        super().__init__(f"no plan fits: the peak is at least {floor:.0f} bytes (its plan is not built)",
                         smallest_peak=None)
        self.floor, self._make, self._made = floor, make, None

    def made(self) -> InfeasibleError:
        if self._made is None:
            try:
                self._make()
            except InfeasibleError as exc:
                self._made = exc
            else:
                raise AssertionError("a try whose peak floor is over the limit built a plan that fits")
        return self._made


def closest(exc: InfeasibleError) -> float:
    """The peak ``exc`` reports (inf: none)."""
    return exc.smallest_peak or math.inf


def _floor(exc: InfeasibleError) -> float:
    return exc.floor if isinstance(exc, Unbuilt) else closest(exc)


def closest_miss(misses) -> InfeasibleError:
    """The error among ``misses`` (InfeasibleErrors, some :class:`Unbuilt`) that reports the
    smallest peak, the first of them on a tie; an unbuilt one is made (which may give an unbuilt
    one of a higher floor) only while its floor is below the best made so far."""
    heap = [(_floor(exc), k, exc) for k, exc in enumerate(misses)]
    heapq.heapify(heap)
    best = None  # (peak, position, error)
    while heap:
        floor, k, exc = heapq.heappop(heap)
        if best is not None and (floor, k) > best[:2]:
            break
        if isinstance(exc, Unbuilt):
            made = exc.made()
            heapq.heappush(heap, (_floor(made), k, made))
            continue
        if best is None or (closest(exc), k) < best[:2]:
            best = closest(exc), k, exc
    return best[2]


def least_known_peak(misses) -> tuple[float, bool]:
    """The smallest peak ``misses`` are known to report without making any: the least of the made
    errors' peaks and the unbuilt ones' floors (inf: none known), and whether it is exact (a made
    error's, no unbuilt floor below it: the peak :func:`closest_miss` would report) rather than a
    floor under every miss's peak."""
    made = min((closest(exc) for exc in misses if not isinstance(exc, Unbuilt)), default=math.inf)
    unbuilt = min((exc.floor for exc in misses if isinstance(exc, Unbuilt)), default=math.inf)
    return min(made, unbuilt), made <= unbuilt and math.isfinite(made)


def unfit_floor(counts, cluster, options, *, offload: bool | str) -> float | None:
    """Where no plan of a model whose parameters are ``counts`` (its
    :class:`~autopar.plan.records.ParameterCount`, of the captured graph or the module) fits
    ``cluster``'s devices (any mesh) with ``offload``, known before any cost graph: a floor on the
    peak its error reports, ``inf`` where no plan's host share fits
    (:func:`~autopar.planner.offload.host_bytes_floor`; that error reports no peak); else None.
    The devices' floor is :func:`choices_floor`'s at the optimizer step without the buffers: each
    parameter's bytes with its gradient and optimizer state (with the optimizer offloaded, the
    parameter's alone) and Adam's scratch (:func:`_scratch`: a parameter's bytes, or its fp32
    master's, once over the devices) are held by some device, so the fullest holds their mean."""
    precision = precision_of((c.dtype for c in counts), mixed_precision=options.mixed_precision)
    if offload and host_bytes_floor(counts, cluster, precision, options.optimizer,
                                    parameters=offload == "parameters") > host_limit(cluster, options):
        return math.inf
    if offload == "parameters":
        return None
    p, g, o = precision.state_bytes(options.optimizer)
    stepped = g + o + _scratch(p, o, options.optimizer, master=precision.master)
    held = sum(c.numel * (p + (stepped if not offload and c.trainable else 0.0)) for c in counts)
    floor = held / cluster.num_devices
    return floor if floor > cluster.memory_per_device * options.memory_fraction else None


def fits_no_saver(counts, cluster, options) -> bool:
    """Whether :func:`unfit_floor` rules out every offload the search may take
    (:func:`~autopar.planner.savers.saver_levels`): then no plan of a model whose parameters are
    ``counts`` fits ``cluster``'s devices, on any mesh, pipelined or not (stages keep their
    optimizer and parameters on the devices, as ``offload=False`` does), whatever else its graph holds."""
    offloads = {s.offload for level in saver_levels(options, cluster) for s in level}
    return all(unfit_floor(counts, cluster, options, offload=o) is not None for o in offloads)


def unplannable(counts, cluster, options) -> bool:
    """Whether a model whose parameters are ``counts`` fits no plan (:func:`fits_no_saver`) and
    its one-stage search (the one that runs then) would say the host is short: every saver of its
    last level, whose misses it reports, offloads, and no offload's share fits the host
    (:func:`unfit_floor` is inf). That error reports no peak, so saying :func:`unfit_error` before
    any capture loses nothing."""
    last = saver_levels(options, cluster)[-1]
    return options.pipeline is not True and fits_no_saver(counts, cluster, options) and all(
        s.offload and unfit_floor(counts, cluster, options, offload=s.offload) == math.inf for s in last)


def unfit_error(counts, cluster, options) -> InfeasibleError:
    """The "no plan fits" of a model whose parameters are ``counts`` where :func:`fits_no_saver`
    says so, before any capture: what each offload the search may take would need at least."""
    precision = precision_of((c.dtype for c in counts), mixed_precision=options.mixed_precision)
    limit, host = cluster.memory_per_device * options.memory_fraction, host_limit(cluster, options)
    needs = []
    for o in dict.fromkeys(s.offload for level in saver_levels(options, cluster) for s in level):
        hosted = host_bytes_floor(counts, cluster, precision, options.optimizer, parameters=o == "parameters")
        if not o:
            needs.append(f"with their gradients and optimizer state they hold at least"
                         f" {format_bytes(unfit_floor(counts, cluster, options, offload=False))} per device")
        elif hosted > host:
            what = "the parameters" if o == "parameters" else "the optimizer"
            needs.append(f"with {what} offloaded the host would need at least {format_bytes(hosted)} per device")
        else:
            needs.append(f"with the optimizer offloaded the parameters alone hold at least"
                         f" {format_bytes(unfit_floor(counts, cluster, options, offload=o))} per device")
    hosts = (f"; the host's: {format_bytes(host)} per device, {options.memory_fraction:.0%} of its share of the node"
             if cluster.host is not None else "")
    return InfeasibleError(
        f"autopar: no plan fits: the model's {sum(c.numel for c in counts) / 1e9:.2f} B parameters on"
        f" {cluster.num_devices} devices: {'; '.join(needs)} (the devices' limit: {format_bytes(limit)}{hosts})."
        " Use more devices, devices or a host with more memory (Cluster.host), or a smaller model", smallest_peak=None)


def choices_floor(graph, captured, cost_model, *, offload: bool | str, recompute: bool | str = False) -> float:
    """A lower bound on the step peak of every plan of ``graph``, the larger of two moments':

    - when the backward starts, the inputs, the buffers, the parameters with their optimizer
      state and every tensor the forward saved are on the device (no gradient yet): each input's,
      buffer's and op's least bytes (what the ILP sums; an op's bytes count the storages it shares
      with others by its share of them, which no choice of shardings makes more than the step
      holds) and each parameter's least bytes over its placements (:func:`_least_bytes`); with
      ``recompute`` (which frees what ops save) the ops are left out;
    - at the optimizer step, the buffers and each parameter's least bytes with its gradient and
      Adam's scratch (:func:`_scratch`; the host's where the optimizer is offloaded)."""
    mesh, held, states, stepped = tuple(cost_model.mesh_shape), 0.0, 0.0, 0.0
    optimizer, master = cost_model.options.optimizer, cost_model.precision.master
    for node in graph.nodes:
        if node.kind != "parameter":
            least = float(node.memory.min()) if len(node.memory) else 0.0
            if not (recompute and node.kind == "op"):
                held += least
            stepped += least if node.kind == "buffer" else 0.0
            continue
        meta = captured.parameters[node.target]
        least = []
        for s in node.strategies:
            placement = s.outputs[0]
            p, g, o = _least_bytes(placement, cost_model.parameter_split(meta, placement, frozen=not node.requires_grad),
                                   mesh, offload)
            least.append((p, g, o, _scratch(p, o, optimizer, master=master, spread=_spread(placement, mesh))))
        states += min(p + o for p, _, o, _ in least)
        stepped += min(map(sum, least))
    return max(held + states, stepped)


def _scratch(p: float, o: float, optimizer: str, *, master: bool, spread: int = 1) -> float:
    """The least scratch Adam's foreach step holds for a parameter of ``p`` bytes and at least
    ``o`` optimizer bytes on a device, ZeRO sharding its state at most ``spread`` ways
    (:func:`~autopar.planner.peak.step_walk`): a tensor the size of the copy it steps, the
    parameter itself or a ZeRO shard of it (at least ``p / spread``), or its fp32 master's share
    of ``o``; none without moments, or with nothing to step (no optimizer bytes: frozen, offloaded)."""
    if not MOMENTS[optimizer] or not o:
        return 0.0
    return o * stepped_copy_share(optimizer) if master else p / spread


def host_floor(graph, captured, cost_model) -> float:
    """With the parameters offloaded (at ZeRO 0, the only stage such a plan takes): a lower bound
    on the host bytes per device of every plan of ``graph``, :func:`~autopar.planner.offload.offload`'s
    count of each parameter at its least bytes over its placements (the host keeps a rank's piece)."""
    least = {}
    for node in graph.nodes:
        if node.kind == "parameter":
            meta = captured.parameters[node.target]
            least[node.target] = min((cost_model.parameter_split(meta, s.outputs[0], frozen=not node.requires_grad)
                                      for s in node.strategies), key=lambda state: state[0])
    return offload(least, captured, {}, 0, cost_model.cluster, cost_model.precision, cost_model.options.optimizer,
                   parameters=True).host_bytes


def peak_floor(solved, captured, cost_model, *, offload: bool | str, recompute: bool | str,
               checkpoints: bool) -> float:
    """A lower bound on the step peak of every plan :func:`~autopar.planner.intra.build_plan`
    makes of ``solved`` (any ZeRO stage, offload, tiles): its backward's walk with nothing
    fetched and each parameter's least bytes (:func:`_least_bytes`), all of which only add to
    the peak. The walk's parts that do not depend on them stay in ``solved.derived`` for the build."""
    mesh = tuple(cost_model.mesh_shape)
    least = {node.target: _least_bytes(node.strategies[c].outputs[0], cost_model.parameter_split(
                 captured.parameters[node.target], node.strategies[c].outputs[0], frozen=not node.requires_grad),
                 mesh, offload)
             for node, c in zip(solved.graph.nodes, solved.choice) if node.kind == "parameter"}
    memory, _ = step_walk(solved.graph, solved.choice, captured, cost_model, least, recompute=recompute,
                          offload=bool(offload), offload_checkpoints=checkpoints, memo=solved.derived, step=False)
    return memory.total


def _least_bytes(placement, state: tuple[float, float, float], mesh, offload: bool | str) -> tuple:
    """The least (parameter, gradient, optimizer) bytes one parameter placed so (``state``: its
    bytes without ZeRO) holds on a device: ZeRO divides its gradient and optimizer state by at
    most the devices of the axes it is not sharded on; with the optimizer offloaded the device
    keeps its parameter and, until the step, its gradient where no axis is left for ZeRO-2 to
    reduce-scatter it over (it moves the others' to the host as made); with the parameters
    offloaded nothing."""
    p, g, o = state
    if offload == "parameters":
        return 0.0, 0.0, 0.0
    spread = _spread(placement, mesh)
    if offload:
        return p, g if spread == 1 else 0.0, 0.0
    return p, g / spread, o / spread


def _spread(placement, mesh) -> int:
    """The devices of the mesh axes ``placement`` does not shard over: ZeRO's most ways."""
    return math.prod(n for n, x in zip(mesh, placement) if not isinstance(x, Shard))


__all__ = ["Unbuilt", "choices_floor", "closest", "closest_miss", "fits_no_saver", "host_floor", "least_known_peak",
           "peak_floor", "unfit_error", "unfit_floor", "unplannable"]
