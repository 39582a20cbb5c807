"""Hand-made parallel plans, costed by the same model as autopar's own (each returns a Plan).

Each baseline is the planner's ILP restricted to the strategies that define it:

- ``data_parallel``: parameters stored and used replicated; user inputs split on their batch
  dim over every device.
- ``fsdp`` (ZeRO-3): parameters stored sharded over every device and gathered (replicated) on
  use; inputs batch-split.
- ``megatron(tp=, dp=)``: a ``(dp, tp)`` mesh; on the dp axis as data parallel (``zero=3``
  stores parameters sharded there), on the tp axis the batch stays whole and the solver picks
  the best tensor-parallel split (for transformers: Megatron's column/row linears,
  vocab-parallel embedding, head-sharded attention).
- ``grid``: the best ``megatron`` configuration over tp and ZeRO stage.
"""

from __future__ import annotations

import math

from autopar.compile import capture_for_training
from autopar.errors import AutoparError, InfeasibleError
from autopar.options import Options
from autopar.placement import Replicate, Shard
from autopar.planner.intra import plan_intra


class BaselineError(AutoparError, ValueError):
    """A baseline's configuration does not fit the cluster or model."""


def _param_inputs(graph) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for e in graph.edges:
        if graph.nodes[e.src].kind == "parameter":
            out.setdefault(e.dst, set()).add(e.in_index)
    return out


def _rule(*, batch_axes, zero_axes, param_replicated_axes, whole_batch_axes=frozenset()):
    """A strategy filter: inputs batch-split on ``batch_axes`` and whole elsewhere, and no op
    working on the batch computes redundantly there; parameters
    stored sharded on ``zero_axes`` (replicated elsewhere among ``param_replicated_axes``) and
    consumed whole on ``param_replicated_axes``; on ``whole_batch_axes`` no activation is split
    on its dim 0 (the batch, or batch×sequence, in every model we know)."""
    cache = {}

    def allow(graph, i, strategy) -> bool:
        if id(graph) not in cache:
            cache.clear()
            cache[id(graph)] = _param_inputs(graph)
        node = graph.nodes[i]
        if node.kind == "user_input":
            (sh,) = strategy.outputs
            return all(isinstance(sh[a], Shard) and sh[a].dim == 0 if a in batch_axes
                       else isinstance(sh[a], Replicate) for a in range(len(sh)))
        if node.kind == "parameter":
            (sh,) = strategy.outputs
            for a in param_replicated_axes:
                want_shard = a in zero_axes
                if want_shard != isinstance(sh[a], Shard):
                    return False
            return True
        if node.kind == "op":
            if node.batch_dependent and any(strategy.replicated_on(a) for a in batch_axes):
                return False  # data parallelism: every rank works on its own part of the batch
            params = cache[id(graph)].get(i, ())
            for k in params:
                if not all(isinstance(strategy.inputs[k][a], Replicate) for a in param_replicated_axes):
                    return False
            activations = [s for k, s in enumerate(strategy.inputs) if k not in params] + list(strategy.outputs)
            for a in whole_batch_axes:
                if any(s[a] == Shard(0) for s in activations):
                    return False
        return True

    return allow


def _sharded_axes(mesh_shape) -> set[int]:
    return {a for a, n in enumerate(mesh_shape) if n > 1}


def _plan(model, cluster, *, example_inputs, example_target, loss_fn, options, allow, name):
    captured = capture_for_training(model, example_inputs=example_inputs,
                                    example_target=example_target, loss_fn=loss_fn)
    return plan_intra(captured, cluster, options or Options(), allow=allow, name=name)


def data_rule(mesh_shape):
    """The strategy filter of data parallelism over every mesh axis."""
    axes = _sharded_axes(mesh_shape)
    return _rule(batch_axes=axes, zero_axes=set(), param_replicated_axes=set(range(len(mesh_shape))))


def fsdp_rule(mesh_shape):
    """The strategy filter of ZeRO-3 over every mesh axis."""
    axes = _sharded_axes(mesh_shape)
    return _rule(batch_axes=axes, zero_axes=axes, param_replicated_axes=set(range(len(mesh_shape))))


def data_parallel(model, cluster, *, example_inputs, example_target=None, loss_fn=None,
                  options: Options | None = None):
    """Every device holds the whole model and a slice of the batch."""
    return _plan(model, cluster, example_inputs=example_inputs, example_target=example_target,
                 loss_fn=loss_fn, options=options, allow=data_rule(cluster.mesh_shape), name="data_parallel")


def fsdp(model, cluster, *, example_inputs, example_target=None, loss_fn=None,
         options: Options | None = None):
    """ZeRO-3: parameters, gradients and optimizer state sharded over every device."""
    return _plan(model, cluster, example_inputs=example_inputs, example_target=example_target,
                 loss_fn=loss_fn, options=options, allow=fsdp_rule(cluster.mesh_shape), name="fsdp")


def megatron_rule(mesh_shape, *, zero: int):
    """The strategy filter of a ``(dp, tp)`` Megatron configuration."""
    dp_axes = {0} if mesh_shape[0] > 1 else set()
    return _rule(batch_axes=dp_axes, zero_axes=dp_axes if zero >= 3 else set(), param_replicated_axes={0},
                 whole_batch_axes={1})


def megatron(model, cluster, *, example_inputs, example_target=None, loss_fn=None, tp: int,
             pp: int = 1, dp: int | None = None, micro_batches: int = 1, zero: int = 0,
             recompute: bool = False, options: Options | None = None):
    """Megatron-style tensor parallelism of degree ``tp`` with data parallelism ``dp``."""
    n = cluster.num_devices
    if pp != 1 or micro_batches != 1:
        raise BaselineError("pipeline stages (pp > 1, micro_batches > 1) are not built yet; use pp=1")
    if recompute:
        raise BaselineError("activation recomputation is not built yet; use recompute=False")
    if zero not in (0, 3):
        raise BaselineError(f"zero must be 0 or 3 (ZeRO-1/2 are not separate strategies yet), got {zero}")
    if not isinstance(tp, int) or tp < 1 or n % tp:
        raise BaselineError(f"tp={tp!r} must be a positive divisor of the {n} devices")
    dp = n // tp if dp is None else dp
    if dp * tp != n:
        raise BaselineError(f"dp * tp = {dp} * {tp} must equal the {n} devices")
    mesh = cluster.with_mesh((dp, tp))
    allow = megatron_rule(mesh.mesh_shape, zero=zero)
    name = f"megatron(tp={tp},dp={dp},zero={zero})"
    return _plan(model, mesh, example_inputs=example_inputs, example_target=example_target,
                 loss_fn=loss_fn, options=options, allow=allow, name=name)


def tp_degrees(cluster) -> list[int]:
    """Tensor-parallel degrees worth trying: divisors of the device count up to one node."""
    n = cluster.num_devices
    per_node = cluster.devices_per_node or n
    return [t for t in range(1, n + 1) if n % t == 0 and t <= per_node]


def grid(model, cluster, *, example_inputs, example_target=None, loss_fn=None,
         options: Options | None = None):
    """The fastest Megatron configuration (tp, dp, ZeRO 0/3) that fits, by exhaustive search."""
    captured = capture_for_training(model, example_inputs=example_inputs,
                                    example_target=example_target, loss_fn=loss_fn)
    return grid_on(captured, cluster, options=options)


def grid_on(captured, cluster, *, options=None):
    best, smallest = None, math.inf
    for tp in tp_degrees(cluster):
        mesh = cluster.with_mesh((cluster.num_devices // tp, tp))
        for zero in (0, 3):
            try:
                plan = plan_intra(captured, mesh, options or Options(),
                                  allow=megatron_rule(mesh.mesh_shape, zero=zero), name=f"grid: megatron(tp={tp},dp={mesh.mesh_shape[0]},zero={zero})")
            except InfeasibleError as exc:
                smallest = min(smallest, exc.smallest_peak or math.inf)
                continue
            if best is None or plan.predicted_step_time < best.predicted_step_time:
                best = plan
    if best is None:
        raise InfeasibleError(
            f"no Megatron configuration fits in memory; the smallest peak was {smallest / 2**30:.2f} GiB",
            smallest_peak=smallest,
        )
    return best


__all__ = ["BaselineError", "data_parallel", "fsdp", "grid", "megatron"]
