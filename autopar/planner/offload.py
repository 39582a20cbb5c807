"""What offloading the optimizer to the host (ZeRO-Offload) changes in a one-program plan; the
runtime's side is :class:`~autopar.runtime.mixed.MasterWeights` on the host.

Each rank's stepped tensors (its parameter pieces, or at ZeRO-1/2 its flat chunks of them) get a
host copy: the master, in fp32 under mixed precision and in the parameter's dtype otherwise; the
optimizer's state and its ``.grad`` are of the same size on the host, and the foreach step adds one
scratch tensor of each. The device keeps the parameters and, until the step, their gradients
(ZeRO-2 moves each reduce-scattered chunk to the host as backward makes it: no gradient stays on
the device). A step moves every stepped element's gradient down and its updated value up, in the
program's dtype, and the CPUs step them; nothing of it overlaps compute (the runtime does it
after backward), so the seconds add up::

    seconds = elements * 2 * itemsize / cluster.host_link_bandwidth + elements / host_step_rate
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.precision import MOMENTS
from autopar.plan.records import trainable_parameters
from autopar.planner.costgraph import with_memory


@dataclass(frozen=True)
class Offloaded:
    """A plan's offload: per-parameter device bytes ``(parameter, gradient, 0)``, the host's
    peak bytes per device and the step's added seconds."""

    parameter_memory: dict
    host_bytes: float
    seconds: float


def host_copies(optimizer: str) -> int:
    """Host tensors per stepped element: the master, its gradient, the optimizer's states and, for
    an optimizer with states, the foreach step's scratch."""
    return 2 + MOMENTS[optimizer] + (1 if MOMENTS[optimizer] else 0)


def offloaded_graph(graph, cost_model):
    """``graph`` with each parameter's memory less its optimizer state (kept on the host): what
    the ILP bounds for an offloaded plan."""
    p, g, o = cost_model.state_bytes
    keep = (p + g) / (p + g + o) if p + g + o else 1.0
    nodes = [n.with_memory(n.memory * keep) if n.kind == "parameter" else n for n in graph.nodes]
    return with_memory(graph, nodes)


def offload(parameter_memory: dict, captured, sharded: dict, zero: int, cluster, precision, optimizer: str, *,
            parameters: bool = False) -> Offloaded:
    """The :class:`Offloaded` of a plan whose parameters hold ``parameter_memory`` (FQN ->
    bytes per device, ZeRO applied) at ZeRO stage ``zero`` (``sharded``: the ZeRO-sharded
    parameters, :func:`~autopar.plan.records.zero_parameters`) in ``precision``. ``parameters``:
    the program's parameters live on the host too (:mod:`autopar.planner.fetched` prices their
    fetches): the device keeps none of them, the host also holds their program-dtype copies under
    mixed precision (without it they are the masters), and the step moves nothing over the link."""
    mesh = tuple(cluster.mesh_shape)
    copies = host_copies(optimizer)
    device, elements, host, moved = {}, 0, 0.0, 0.0
    for fqn, (p, g, o) in parameter_memory.items():
        dtype = captured.parameters[fqn].dtype
        if not dtype.is_floating_point:
            device[fqn] = (p, g, o)
            continue
        itemsize = precision.dtype(dtype).itemsize
        if zero and fqn in sharded:
            _, numel, _, axes = sharded[fqn]
            n = -(-numel // math.prod(mesh[a] for a in axes))
        else:
            n = round(p / itemsize)
        elements += n
        host += n * (4 if precision.master else itemsize) * copies
        if parameters:
            host += p if precision.master else 0.0
            device[fqn] = (0.0, 0.0, 0.0)
            continue
        moved += n * 2 * itemsize  # its gradient down, its value up
        device[fqn] = (p, 0.0 if zero == 2 and fqn in sharded else g, 0.0)
    seconds = moved / cluster.host_link_bandwidth + elements / cluster.host_step_rate(optimizer)
    return Offloaded(device, float(host), seconds)


def host_bytes_floor(counts, cluster, precision, optimizer: str, *, parameters: bool = False) -> float:
    """Bytes per device below which no offloaded plan's host share goes (:func:`offload`'s
    count; ``counts``: the model's :class:`~autopar.plan.records.ParameterCount`): every trainable
    floating element has its master, gradient, states and scratch on some device's host share
    (with ``parameters`` under mixed precision, its program copy too), so the fullest holds at
    least their mean over the devices."""
    copies = host_copies(optimizer)
    total = 0.0
    for c in counts:
        if c.trainable:
            itemsize = precision.itemsize(c.dtype)
            per_element = (4 if precision.master else itemsize) * copies + (itemsize if parameters and precision.master
                                                                            else 0)
            total += c.numel * per_element
    return total / cluster.num_devices


def host_limit(cluster, options) -> float:
    """Bytes of its node's host an offloaded plan may use per device."""
    return cluster.host_memory_per_device * options.memory_fraction


def host_step_floor(captured, cluster, optimizer: str, *, precision=None, parameters: bool = False) -> float:
    """Seconds below which no offloaded plan's CPU step goes (the second term above, for the
    parameters' offload too): every trainable floating element is stepped on some device's host
    share, so the busiest steps at least their mean over the devices. With ``precision`` (the
    program's), plus the link's seconds those elements take: each one's gradient goes down in the
    program's dtype and, with the optimizer alone on the host (not ``parameters``), its value
    comes back up (:func:`offload`; :mod:`autopar.planner.fetched` for the parameters')."""
    trainable = trainable_parameters(captured)
    elements = sum(math.prod(i.meta.shape) for i in captured.inputs if i.node in trainable)
    seconds = elements / (cluster.num_devices * cluster.host_step_rate(optimizer))
    if precision is not None:
        moved = elements * precision.compute.itemsize * (1 if parameters else 2)
        seconds += moved / (cluster.num_devices * cluster.host_link_bandwidth)
    return seconds


__all__ = ["Offloaded", "host_bytes_floor", "host_copies", "host_limit", "host_step_floor", "offload", "offloaded_graph"]
