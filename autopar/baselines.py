"""Hand-made parallel plans, costed by the same model as autopar's own (each returns a Plan).

Each baseline is the planner's ILP restricted to the strategies that define it:

- ``data_parallel``: parameters stored and used replicated; user inputs split on their batch
  dim over every device; ``zero=1|2`` shards optimizer state (and gradients) over them.
- ``fsdp`` (ZeRO-3): parameters stored sharded over every device and gathered (replicated) on
  use; inputs batch-split.
- ``megatron(tp=, dp=)``: a ``(dp, tp)`` mesh; on the dp axis as data parallel (``zero=3``
  stores parameters sharded there), on the tp axis the batch stays whole and the solver picks
  the best tensor-parallel split (for transformers: Megatron's column/row linears,
  vocab-parallel embedding, head-sharded attention). With ``pp`` > 1 (or micro-batches,
  recomputation, ZeRO-1) it is ``pp`` equal pipeline stages, each such a ``(dp, tp)`` mesh,
  costed by the pipeline planner.
- ``grid``: the best ``megatron`` configuration over tp and ZeRO stage, and over pp,
  micro-batches and recomputation when the pipeline planner is on.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.compile import recorded, recorded_or_flat
from autopar.core.errors import AutoparError, InfeasibleError
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.planner.inter import evaluate_uniform, grid_search, uses_pipeline
from autopar.planner.intra import plan_intra, plan_intra_fastest
from autopar.planner.pipeline_model import build_model
from autopar.planner.pipeline_plan import build_pipeline_plan
from autopar.planner.restrictions import data_rule, fsdp_rule, megatron_rule


class BaselineError(AutoparError, ValueError):
    """A baseline's configuration does not fit the cluster or model."""


def _plan(model, cluster, *, example_inputs, example_target, loss_fn, options, allow, name, dp=1, zero=0):
    captured = capture_for_training(model, example_inputs=example_inputs, example_target=example_target,
                                    loss_fn=loss_fn, mixed_precision=options.mixed_precision if options else False,
                                    **(options or Options()).moe_capture())
    check_batch(captured, dp, name)
    return plan_intra(captured, cluster, options or Options(), allow=allow, name=name, zero=zero)


def check_batch(captured, dp: int, name: str) -> None:
    """Data parallelism splits every user input's dim 0 (the batch) evenly over ``dp`` ranks."""
    for inp in captured.inputs:
        shape = getattr(inp.meta, "shape", ())
        if inp.kind == "user_input" and len(shape) >= 1 and shape[0] % dp:
            raise BaselineError(
                f"{name}: input {inp.name!r} has batch {shape[0]}, which does not split evenly over"
                f" {dp} data-parallel ranks; use a batch that is a multiple of {dp}, or"
                " autopar.compile, which then keeps that input whole")


def data_parallel(model, cluster, *, example_inputs, example_target=None, loss_fn=None,
                  options: Options | None = None, zero: int = 0):
    """Every device holds the whole model and a slice of the batch; ``zero=1`` shards the
    optimizer state over the devices (DeepSpeed's ZeRO-1), ``zero=2`` the gradients too."""
    if zero not in (0, 1, 2):
        raise BaselineError(f"data_parallel: zero must be 0, 1 or 2 (ZeRO-3 is autopar.baselines.fsdp), got {zero!r}")
    return _plan(model, cluster, example_inputs=example_inputs, example_target=example_target,
                 loss_fn=loss_fn, options=options, allow=data_rule(cluster.mesh_shape),
                 name=f"data_parallel(zero={zero})" if zero else "data_parallel", dp=cluster.num_devices, zero=zero)


def fsdp(model, cluster, *, example_inputs, example_target=None, loss_fn=None,
         options: Options | None = None):
    """ZeRO-3: parameters, gradients and optimizer state sharded over every device."""
    return _plan(model, cluster, example_inputs=example_inputs, example_target=example_target,
                 loss_fn=loss_fn, options=options, allow=fsdp_rule(cluster.mesh_shape), name="fsdp",
                 dp=cluster.num_devices)


def megatron(model, cluster, *, example_inputs, example_target=None, loss_fn=None, tp: int,
             pp: int = 1, dp: int | None = None, micro_batches: int = 1, zero: int = 0,
             recompute: bool | str = False, options: Options | None = None):
    """Megatron-style tensor parallelism of degree ``tp``, ``pp`` equal pipeline stages (1F1B or
    GPipe as ``options.schedule`` says) of ``micro_batches``, and data parallelism ``dp`` with
    ZeRO stage ``zero`` (0, 1 or 3) and optional activation recomputation (True: whole layers,
    ``"selective"``: the cheap runs between their matmuls).

    With ``pp = 1``, one micro-batch, no recomputation, ZeRO 0/3 and ``options.pipeline`` not
    True it is the restricted intra-op ILP on the ``(dp, tp)`` mesh; otherwise the pipeline
    planner's costs (:func:`autopar.planner.inter.evaluate_uniform`).
    """
    n = cluster.num_devices
    options = options or Options()
    if zero not in (0, 1, 3):
        raise BaselineError(f"zero must be 0, 1 or 3, got {zero}")
    if not isinstance(tp, int) or tp < 1 or n % tp:
        raise BaselineError(f"tp={tp!r} must be a positive divisor of the {n} devices")
    if not isinstance(pp, int) or pp < 1 or n % (pp * tp):
        raise BaselineError(f"pp={pp!r} must be a positive int with pp * tp dividing the {n} devices")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise BaselineError(f"micro_batches must be a positive int, got {micro_batches!r}")
    dp = n // (tp * pp) if dp is None else dp
    if dp * tp * pp != n:
        raise BaselineError(f"dp * tp * pp = {dp} * {tp} * {pp} must equal the {n} devices")
    if pp > 1 or micro_batches > 1 or recompute or zero == 1 or options.pipeline is True:
        return _pipeline_megatron(model, cluster, example_inputs=example_inputs, example_target=example_target,
                                  loss_fn=loss_fn, tp=tp, pp=pp, dp=dp, micro_batches=micro_batches,
                                  zero=zero, recompute=recompute, options=options)
    mesh = cluster.with_mesh((dp, tp))
    allow = megatron_rule(mesh.mesh_shape, zero=zero)
    name = f"megatron(tp={tp},dp={dp},zero={zero})"
    return _plan(model, mesh, example_inputs=example_inputs, example_target=example_target,
                 loss_fn=loss_fn, options=options, allow=allow, name=name, dp=dp)


def _pipeline_megatron(model, cluster, *, example_inputs, example_target, loss_fn, tp, pp, dp,
                       micro_batches, zero, recompute, options):
    captured = capture_for_training(model, example_inputs=example_inputs, example_target=example_target,
                                    loss_fn=loss_fn, mixed_precision=options.mixed_precision, **options.moe_capture())
    layers = len(captured.layers)
    units = layers if layers >= 2 and layers % pp == 0 else None
    pipe = build_model(captured, cluster, dataclasses.replace(options, micro_batches=None, recompute=recompute),
                       units=units, any_microbatch=True)
    if pipe.units % pp:
        raise BaselineError(f"pp={pp} does not divide the model's {pipe.units} pipeline units"
                            f" ({layers} repeated layers): pick a pp that divides them")
    choice = evaluate_uniform(pipe, tp=tp, pp=pp, batches=micro_batches, zero=zero, recompute=recompute)
    if choice is None:
        raise InfeasibleError(
            f"megatron(tp={tp}, pp={pp}, dp={dp}, micro_batches={micro_batches}, zero={zero},"
            f" recompute={recompute}) does not fit in memory or does not split batch {pipe.batch}"
            f" evenly into {micro_batches} micro-batches over {dp} replicas; try more micro-batches,"
            " recompute=True, zero=3 or a larger tp/pp")
    return recorded(build_pipeline_plan(pipe, choice, name=choice.method, solve_time=0.0), captured, model,
                    loss_fn=loss_fn)


def tp_degrees(cluster) -> list[int]:
    """Tensor-parallel degrees worth trying: divisors of the device count up to one node."""
    n = cluster.num_devices
    per_node = cluster.devices_per_node or n
    return [t for t in range(1, n + 1) if n % t == 0 and t <= per_node]


def grid(model, cluster, *, example_inputs, example_target=None, loss_fn=None,
         options: Options | None = None):
    """The fastest Megatron configuration that fits, by exhaustive search: over tp and ZeRO 0/3
    on the whole mesh, or, when the pipeline planner is on (``options.pipeline``; "auto": a
    cluster of several devices and a model with repeated layers), over tp, pp, dp, micro-batches,
    ZeRO 0/1/3 and recomputation on the pipeline planner's costs; a pipelined configuration whose
    stages the model's micro-batch graph does not take gives way to the one-stage grid."""
    captured = capture_for_training(model, example_inputs=example_inputs, example_target=example_target,
                                    loss_fn=loss_fn, mixed_precision=options.mixed_precision if options else False,
                                    **(options or Options()).moe_capture())
    return recorded_or_flat(grid_on(captured, cluster, options=options), captured, model, loss_fn=loss_fn,
                            flat=lambda: grid_on(captured, cluster, options=dataclasses.replace(
                                options or Options(), pipeline=False)))


def grid_on(captured, cluster, *, options=None):
    options = options or Options()
    if uses_pipeline(captured, cluster, options):
        pipe = build_model(captured, cluster, options)
        choice = grid_search(pipe)
        return build_pipeline_plan(pipe, choice, name=f"grid: {choice.method}", solve_time=0.0)
    tries = {}
    for tp in tp_degrees(cluster):
        shape = (cluster.num_devices // tp, tp)
        tries[shape] = [(megatron_rule(shape, zero=zero), f"grid: megatron(tp={tp},dp={shape[0]},zero={zero})")
                        for zero in (0, 3)]
    try:
        return plan_intra_fastest(captured, cluster, options, tries)
    except InfeasibleError as exc:
        smallest = exc.smallest_peak or math.inf
        raise InfeasibleError(
            f"no Megatron configuration fits in memory; the smallest peak was {smallest / 2**30:.2f} GiB",
            smallest_peak=smallest,
        ) from None


__all__ = ["BaselineError", "data_parallel", "fsdp", "grid", "megatron"]
