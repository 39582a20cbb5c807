"""``autopar.compile``: capture a model, plan it (or take a given plan), return a CompiledModel."""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from autopar.core.errors import AutoparError, InfeasibleError, PipelineError, PlanError
from autopar.core.options import Options
from autopar.core.precision import named
from autopar.cost_models.cluster import Cluster
from autopar.passes.capture import CapturedGraph
from autopar.passes.capture.inputs import SUPPORTED_DTYPES
from autopar.passes.capture.loss import unwrap
from autopar.passes.capture.moe import dense_work, routed_experts
from autopar.passes.capture.training import capture_for_training
from autopar.plan import Plan
from autopar.plan.assignment import assignment_of
from autopar.plan.records import module_parameter_counts, parameter_counts
from autopar.plan.stage_records import with_stage_records
from autopar.planner.inter import plan_inter, uses_pipeline
from autopar.planner.intra import graph_fingerprint, plan_intra, plan_intra_best_mesh
from autopar.planner.misses import fits_no_saver, unfit_error, unfit_floor, unplannable
from autopar.planner.offload import host_step_floor
from autopar.planner.time_floor import step_time_floor
from autopar.runtime.microbatch import stage_capture
from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.program import DistributedProgram
from autopar.runtime.scaler import LossScale
from autopar.runtime.verify.report import Verification
from autopar.runtime.verify.run import verify


class CompiledModel:
    """A model, its captured training graph and the plan that parallelises it.

    ``code(rank)`` is the emitted program of one rank; ``runner(checkpoint=None)`` (inside a
    torchrun process, after ``init_process_group``) is this rank's program with
    ``step(inputs, target)``, ``clip_grad_norm_(max_norm)``, ``parameters()`` for the user's
    optimizer and ``optimizer_step(opt)`` to step it (under fp16 mixed precision: with dynamic
    loss scaling, :mod:`autopar.runtime.scaler`).
    """

    def __init__(self, model, cluster, captured: CapturedGraph, plan: Plan, loss_fn=None):
        self.model = model
        self.cluster = cluster
        self.captured = captured
        self.plan = plan
        self.loss_fn = loss_fn
        self._program = None

    @property
    def program(self):
        """The :class:`~autopar.runtime.program.DistributedProgram` of this plan, or for a plan
        with pipeline stages its :class:`~autopar.runtime.pipeline.PipelineProgram` (built once)."""
        if self._program is None and self.plan.stages:
            self._program = PipelineProgram(self.captured, self.plan, model=self.model, loss_fn=self.loss_fn)
        elif self._program is None:
            self._program = DistributedProgram(self.captured, assignment_of(self.plan, self.captured),
                                               model=self.model, precision=self.plan.precision, zero=self.plan.zero,
                                               recompute=self.plan.recompute, offload=self.plan.offload,
                                               offload_parameters=self.plan.offload_parameters,
                                               tiles=self.plan.tiles,
                                               offload_activations=self.plan.offload_activations)
        return self._program

    def code(self, rank: int = 0) -> str:
        """The readable Python of ``rank``'s emitted program, collectives included."""
        return self.program.code(rank)

    def runner(self, checkpoint=None, *, loss_scale: LossScale | None = None):
        """This rank's program, started (collective) from ``checkpoint``: a Hugging Face folder
        (``save_pretrained``), an autopar checkpoint directory, or None for the model's own
        tensors (a model on ``device="meta"``: its initialisers, under this process's RNG).
        Each rank makes only its own pieces. ``step(inputs, target=None)`` returns the loss as a
        0-dim tensor; ``parameters()`` are for the user's optimizer, which
        ``optimizer_step(opt)`` steps. ``loss_scale``: how fp16 mixed precision scales the loss
        (default ``LossScale()``, torch.amp.GradScaler's defaults; other precisions ignore it)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AutoparError("runner() needs torch.distributed initialised: launch with torchrun"
                               " and call torch.distributed.init_process_group first, or use"
                               " autopar.testing.run_distributed for local tests")
        if dist.get_world_size() != self.plan.num_devices:
            raise PlanError(f"the plan is for {self.plan.num_devices} ranks but this launch has"
                            f" {dist.get_world_size()}: launch with --nproc-per-node/--nnodes to match")
        return self.program.start(checkpoint, loss_scale=loss_scale)

    def verify(self, rank: int | None = None) -> Verification:
        """Run the plan's programs for one training step on fake tensors under a fake process group
        (one rank of each distinct program, or ``rank``) and compare memory, collectives and FLOPs
        with the plan's predictions (:mod:`autopar.runtime.verify`); print it or ``.to_json()``."""
        return verify(self.plan, self.captured, self.model, loss_fn=self.loss_fn, rank=rank)

    def __repr__(self) -> str:
        return f"CompiledModel(plan={self.plan.name!r}, mesh={self.plan.mesh_shape})"


def check_plan_fits(plan: Plan, captured: CapturedGraph, cluster) -> None:
    """Raise PlanError when ``plan`` was made for another model or mesh."""
    if plan.fingerprint != graph_fingerprint(captured):
        raise PlanError(
            "this plan was made for a different model or different input shapes (graph"
            " fingerprints differ): re-plan with autopar.compile(model, cluster, example_inputs=...)"
        )
    if plan.num_devices != cluster.num_devices:
        raise PlanError(
            f"the plan is for {plan.num_devices} devices (mesh {tuple(plan.mesh_shape)}) but the"
            f" cluster has {cluster.num_devices}: use a matching cluster or re-plan"
        )


TIE = 1e-9  # relative: a pipeline no faster than this over the one-stage plan is not worth its runtime


def search_plan(captured: CapturedGraph, cluster, options: Options, *, beat: float | None = None) -> Plan | None:
    """autopar's plan for ``captured``: the faster of the one-stage search (every logical mesh
    with ``options.search_meshes``; skipped under ``Options(pipeline=True)``) and the pipeline
    search (:func:`~autopar.planner.inter.plan_inter`, when
    :func:`~autopar.planner.inter.uses_pipeline`), which also holds one-stage plans with
    micro-batches, recomputation or ZeRO-1; not run beside the one-stage search where the parameters
    with their gradients and optimizer state fit no device (:func:`~autopar.planner.misses.unfit_floor`
    without offload: pipeline stages hold theirs). On a tie (:data:`TIE`) the one-stage plan wins: one
    program, no pipeline schedule. The name says which search won and what the other found;
    InfeasibleError (the closest miss) only when neither finds a plan that fits. ``beat``: seconds
    (another capture's plan) a plan must step below to matter; the one-stage search cuts the
    tries that cannot short (:func:`~autopar.planner.intra.plan_intra_fastest`); None where no
    plan found is faster (and, when neither search found one, where a try was cut).
    """
    searches = {}
    if options.pipeline is not True:
        searches["one-stage"] = plan_intra_best_mesh if options.search_meshes else plan_intra
    # pipeline stages keep their optimizer and parameters on the devices
    if options.offload not in (True, "parameters") and uses_pipeline(captured, cluster, options):
        searches["pipeline"] = plan_inter
    found, misses, cut = {}, [], set()
    for kind, search in searches.items():
        if kind == "pipeline" and "one-stage" in searches and unfit_floor(parameter_counts(captured), cluster,
                                                                          options, offload=False) is not None:
            continue  # the parameters with their states alone fit no stage: the one-stage search says why
        try:
            plan = search(captured, cluster, options, **({} if kind == "pipeline" else {"beat": beat}))
        except InfeasibleError as exc:
            misses.append(exc)
            continue
        if plan is None:
            cut.add(kind)  # a plan of it may fit, none faster than ``beat``
        else:
            found[kind] = plan
    if not found:
        if cut:
            return None
        raise min(misses, key=lambda exc: exc.smallest_peak or math.inf)
    kind = min(found, key=lambda k: found[k].predicted_step_time * (1 + TIE if k == "pipeline" else 1))
    if beat is not None and found[kind].predicted_step_time >= beat:
        return None
    if len(searches) == 1:
        return found[kind]
    other = next(k for k in searches if k != kind)
    what = (f"{found[other].predicted_step_time * 1e3:.1f} ms" if other in found else
            f"none under {beat * 1e3:.1f} ms (cut short there)" if other in cut else "no plan fits")
    return dataclasses.replace(found[kind], name=f"autopar ({kind} search won; {other} search: {what})")


def _search_dispatches(model, captured_as, cluster, options: Options) -> tuple[Plan, CapturedGraph]:
    """(plan, its captured graph): under ``Options(moe_dispatch="auto")`` a model with routed
    experts is captured with its own sorted dispatch and, where it may win, with the dense one
    (expert parallelism available); each is searched (:func:`search_plan`) in the order of their
    step-time floors (:func:`~autopar.planner.time_floor.step_time_floor`) and the faster kept
    (dense on a tie), with the host's optimizer step where every plan offloads it
    (:func:`~autopar.planner.offload.host_step_floor`). One whose floor is over the other's plan is
    not searched: it cannot win; the second searched cuts short the tries that cannot beat the
    first's plan (``beat``).
    Until the dense dispatch is captured its floor is bounded from the sorted capture
    (:func:`dense_floor`), so it is not even captured where that bound already loses, nor where the
    parameters alone fit no plan (:func:`~autopar.planner.misses.fits_no_saver`: the sorted search
    then says why). Otherwise the one capture ``options`` says."""
    if options.moe_dispatch != "auto" or not routed_experts(unwrap(model)):
        captured = captured_as(None)
        return search_plan(captured, cluster, options), captured
    chosen = {dispatch: dataclasses.replace(options, moe_dispatch=dispatch) for dispatch in ("dense", "sorted")}
    captures = {"sorted": captured_as("sorted")}
    if fits_no_saver(parameter_counts(captures["sorted"]), cluster, chosen["sorted"]):  # both hold these parameters
        return search_plan(captures["sorted"], cluster, chosen["sorted"]), captures["sorted"]
    # where the parameters with their states fit no device, every plan of either offloads its optimizer
    host = host_step_floor(captures["sorted"], cluster, options.optimizer) if unfit_floor(
        parameter_counts(captures["sorted"]), cluster, chosen["sorted"], offload=False) is not None else 0.0
    floors = {"dense": dense_floor(model, captures["sorted"], cluster, chosen["dense"]) + host,
              "sorted": step_time_floor(captures["sorted"], cluster, chosen["sorted"]) + host}
    found, misses, skipped, slower = {}, [], {}, {}

    def loses(dispatch):
        return found and floors[dispatch] > min(p.predicted_step_time for p in found.values()) * (1 + TIE)

    todo = ["dense", "sorted"]
    while todo:
        dispatch = min(todo, key=floors.get)  # dense first on equal floors
        if loses(dispatch):
            skipped[dispatch] = floors[dispatch]
            todo.remove(dispatch)
        elif dispatch not in captures:  # its floor so far was a bound: the real one may reorder the two
            captures[dispatch] = captured_as(dispatch)
            floors[dispatch] = step_time_floor(captures[dispatch], cluster, chosen[dispatch]) + host
        else:
            todo.remove(dispatch)
            beat = None
            if found:  # the other's plan, which this one must beat to win (dense wins a tie)
                fastest = min(p.predicted_step_time for p in found.values())
                beat = fastest * (1 + TIE) if dispatch == "dense" else fastest / (1 + TIE)
            try:
                plan = search_plan(captures[dispatch], cluster, chosen[dispatch], beat=beat)
            except InfeasibleError as exc:
                misses.append(exc)
                continue
            if plan is None:
                slower[dispatch] = fastest
            else:
                found[dispatch] = plan
    if not found:
        raise min(misses, key=lambda exc: exc.smallest_peak or math.inf)
    kind = min(found, key=lambda k: found[k].predicted_step_time * (1 + TIE if k == "sorted" else 1))
    other = next(k for k in floors if k != kind)
    floored = "its FLOPs with the host's optimizer step" if host else "its FLOPs alone"
    what = (f"{found[other].predicted_step_time * 1e3:.1f} ms" if other in found else
            f"not searched, {floored} take at least {skipped[other] * 1e3:.1f} ms" if other in skipped
            else f"no plan under {slower[other] * 1e3:.1f} ms (its search was cut short there)" if other in slower
            else "no plan fits")
    return dataclasses.replace(found[kind], name=f"{found[kind].name} ({kind} experts won; {other}: {what})"), \
        captures[kind]


def dense_floor(model, captured_sorted: CapturedGraph, cluster, options: Options) -> float:
    """A floor on the step time of ``model`` captured with the dense expert dispatch, from its
    capture with the sorted one: the same calls, those inside the routed experts counted as many
    times as the dense dispatch does their work at least (:func:`~autopar.passes.capture.moe.dense_work`)."""
    work = dense_work(unwrap(model), capacity_factor=options.moe_capacity_factor)
    return step_time_floor(captured_sorted, cluster, options, scaled=work)


def recorded(plan: Plan, captured: CapturedGraph, model: nn.Module, *, loss_fn=None) -> Plan:
    """``plan`` with its pipeline stages' collective records (:mod:`autopar.plan.stage_records`),
    counted on the graph the pipeline runtime cuts its stages from; a one-program plan (its
    records made by the planner) as it is. ``compile`` records a given pipelined plan that has
    none."""
    if not plan.stages:
        return plan
    small = stage_capture(model, captured, plan, loss_fn=loss_fn)
    return with_stage_records(plan, small, precision=named(plan.precision))


def recorded_or_flat(plan: Plan, captured: CapturedGraph, model: nn.Module, *, flat, loss_fn=None) -> Plan:
    """:func:`recorded` ``plan``; where its pipeline stages cannot be cut from the graph the model
    gives at the micro-batch size (PipelineError: the model traces another graph there), the
    one-stage plan ``flat()`` makes, its reason saying why."""
    try:
        return recorded(plan, captured, model, loss_fn=loss_fn)
    except PipelineError as exc:
        one = flat()
        return dataclasses.replace(one, why=one.why + (
            f"one stage: the pipelined plan ({plan.predicted_step_time * 1e3:.1f} ms) cannot run: {exc}",))


def compile(model: nn.Module, cluster, *, example_inputs, example_target=None, loss_fn=None,
            options: Options | None = None, plan: Plan | None = None) -> CompiledModel:
    """Capture ``model`` and plan it on ``cluster`` (or check and take ``plan``).

    ``example_inputs`` is a tuple of positional arguments or a dict of keyword arguments. The
    training loss is ``loss_fn(output, target)`` when ``loss_fn`` is given (with
    ``example_target``), else the model's own: a 0-dim output or its ``.loss``. With
    ``options.pipeline`` (by default: on several devices) the plan may split the model into
    pipeline stages; :func:`search_plan` keeps the faster of the one-stage and pipelined plans.
    Under ``options.mixed_precision`` (or a given mixed ``plan``) the graph is the model's bf16
    (fp16) copy's (:func:`~autopar.passes.capture.training.capture_for_training`). Routed experts are
    captured as ``options.moe_dispatch`` says ("auto": both ways, the faster plan kept; a given
    plan: as its options say). Where the parameters with their gradients and optimizer state fit
    no device and the search would end on a host too small for any offload
    (:func:`~autopar.planner.misses.unplannable`), the InfeasibleError comes before any capture.
    """
    options = options or Options()
    mixed = named(plan.precision).mixed_precision if plan is not None else options.mixed_precision

    def captured_as(dispatch):
        return capture_for_training(model, example_inputs=example_inputs, example_target=example_target,
                                    loss_fn=loss_fn, mixed_precision=mixed, **options.moe_capture(dispatch))

    if plan is None:
        counts = module_parameter_counts(model) if isinstance(model, nn.Module) else ()
        plannable = all(c.dtype in SUPPORTED_DTYPES for c in counts)  # else capture says which is not
        if counts and plannable and isinstance(cluster, Cluster) and unplannable(counts, cluster, options):
            raise unfit_error(counts, cluster, options)  # no capture can change that: said before any
        plan, captured = _search_dispatches(model, captured_as, cluster, options)
        plan = recorded_or_flat(plan, captured, model, loss_fn=loss_fn, flat=lambda: search_plan(
            captured, cluster, dataclasses.replace(plan.options, pipeline=False)))
    else:  # captured as the plan was (its options say how routed experts were traced)
        options = dataclasses.replace(options, moe_dispatch=plan.options.moe_dispatch,
                                      moe_capacity_factor=plan.options.moe_capacity_factor)
        captured = captured_as(None)
        check_plan_fits(plan, captured, cluster)
        if any(st.collective_records is None for st in plan.stages):  # made by plan_inter, or an older file
            plan = recorded(plan, captured, model, loss_fn=loss_fn)
    if tuple(plan.mesh_shape) != tuple(cluster.mesh_shape):
        cluster = cluster.with_mesh(plan.mesh_shape)  # the same devices, viewed as the plan's mesh
    return CompiledModel(model, cluster, captured, plan, loss_fn)
