"""A step time no plan of a captured graph can beat on a cluster, from its FLOPs alone.

Every plan's step time is at least its busiest device's compute seconds, which are at least
their mean over the devices. Each matmul, convolution and attention call is priced by the
roofline of :mod:`autopar.cost_models.compute` at a rate of at most ``peak(dtype) x
efficiency(class)`` on its local shapes, and no sharding, micro-batching, recomputation or
pipeline schedule makes the devices execute fewer FLOPs in all than the whole call's. So the
sum of each such call's forward and backward FLOPs at that rate, over the number of devices, is
a floor on the step time. It is far below a real plan's time (communication, memory-bound ops
and kernel overheads are left out); it serves to skip a search that cannot win.

With ``scaled`` (module path -> factor) the calls inside those modules count that many times:
the floor of another capture of the same model whose calls there do at least that much more
work (routed experts run densely: :func:`autopar.compile.dense_floor`), found without capturing it.
"""

from __future__ import annotations

import torch

from autopar.core.ir import spec_of_node
from autopar.cost_models.compute import node_flops, op_class
from autopar.cost_models.devices import COMPUTE_CLASSES
from autopar.planner.costs import model_precision


def step_time_floor(captured, cluster, options, *, scaled: dict[str, float] | None = None) -> float:
    """Seconds below which no plan of ``captured`` on ``cluster`` under ``options`` can step,
    the calls inside ``scaled``'s modules counted its factor times (the module docstring)."""
    device = cluster.device_spec  # calibrated where the cluster is, as the cost model sees it
    rate = device.peak(model_precision(captured, options).compute)
    seconds = 0.0
    for node in captured.graph_module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        kind = op_class(node.target)
        if kind in COMPUTE_CLASSES:
            factor = _factor(node.meta.get("autopar_module", ""), scaled) if scaled else 1.0
            seconds += factor * sum(node_flops(spec_of_node(node))) / (rate * device.class_efficiency(kind))
    return seconds / cluster.num_devices


def _factor(module: str, scaled: dict[str, float]) -> float:
    """The factor of the innermost of ``scaled``'s modules holding ``module``, else 1."""
    while True:
        if module in scaled:
            return scaled[module]
        if not module:
            return 1.0
        module = module.rpartition(".")[0]


__all__ = ["step_time_floor"]
