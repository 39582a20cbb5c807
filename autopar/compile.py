"""``autopar.compile``: capture a model, plan it (or take a given plan), return a CompiledModel."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autopar.errors import AutoparError, PlanError
from autopar.options import Options
from autopar.passes.capture import CapturedGraph, capture
from autopar.plan import Plan
from autopar.planner.intra import graph_fingerprint, plan_intra, plan_intra_best_mesh

_WRAPPED = "model"


class InputError(AutoparError, ValueError):
    """example_inputs / loss_fn / target are inconsistent."""


class _WithLoss(nn.Module):
    """``loss_fn(model(*args, **kwargs), target)`` as one module (so the loss is in the graph)."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args, target, **kwargs):
        return self.loss_fn(self.model(*args, **kwargs), target)


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tuple of positional arguments or a dict of keyword arguments → (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        raise InputError("example_inputs must be a tuple of positional arguments or a dict of keyword"
                         " arguments, got a tensor: pass (x,)")
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(f"example_inputs must be a tuple or a dict, got {type(example_inputs).__name__}")
    return tuple(example_inputs), {}


def _strip_prefix(captured: CapturedGraph, prefix: str) -> CapturedGraph:
    """Names as the user's model spells them (the loss wrapper adds ``prefix``)."""

    def strip(name):
        return name[len(prefix):] if isinstance(name, str) and name.startswith(prefix) else name

    for node in captured.graph_module.graph.nodes:
        for key in ("autopar_module", "autopar_layer"):
            if node.meta.get(key):
                node.meta[key] = strip(node.meta[key])
    inputs = tuple(dataclasses.replace(i, name=strip(i.name)) for i in captured.inputs)
    return dataclasses.replace(
        captured, inputs=inputs,
        parameters={strip(k): v for k, v in captured.parameters.items()},
        buffers={strip(k): v for k, v in captured.buffers.items()},
        tied={strip(k): strip(v) for k, v in captured.tied.items()},
        layers=tuple(strip(x) for x in captured.layers),
        stamped=tuple(strip(x) for x in captured.stamped),
    )


def capture_for_training(model, *, example_inputs, example_target=None, loss_fn=None) -> CapturedGraph:
    """Capture the training graph: the model with its loss (its own, or ``loss_fn``)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be an nn.Module, got {type(model).__name__}: wrap a plain function"
                         " in an nn.Module whose forward calls it (its parameters must be the module's)")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable(output, target) -> scalar, got {type(loss_fn).__name__}")
    args, kwargs = split_inputs(example_inputs)
    if loss_fn is None:
        if example_target is not None:
            raise InputError("example_target was given without loss_fn: pass loss_fn=, or put the"
                             " labels in example_inputs (e.g. {'labels': y} for HF models)")
        captured = capture(model, args, kwargs=kwargs)
        if not any(o.kind == "loss" for o in captured.outputs):
            raise InputError(
                "the model's output is not a loss (a 0-dim tensor, or a .loss field): pass"
                " loss_fn=(output, target) -> scalar and example_target=, or give the model its labels"
            )
        return captured
    if example_target is None:
        raise InputError("loss_fn needs example_target= (an example of the target it compares with)")
    wrapped = _WithLoss(model, loss_fn)
    wrapped.train(model.training)
    captured = capture(wrapped, args, kwargs={**kwargs, "target": example_target})
    return _strip_prefix(captured, _WRAPPED + ".")


class CompiledModel:
    """A model, its captured training graph and the plan that parallelises it.

    ``code(rank)`` is the emitted program of one rank; ``runner()`` (inside a torchrun
    process, after ``init_process_group``) is this rank's program with ``step(inputs, target)``
    and ``parameters()`` for the user's optimizer.
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
            from autopar.runtime.pipeline import PipelineProgram

            self._program = PipelineProgram(self.captured, self.plan, model=self.model, loss_fn=self.loss_fn)
        elif self._program is None:
            from autopar.planner.assignment import assignment_of
            from autopar.runtime.program import DistributedProgram

            self._program = DistributedProgram(self.captured, assignment_of(self.plan, self.captured),
                                               model=self.model)
        return self._program

    def code(self, rank: int = 0) -> str:
        """The readable Python of ``rank``'s emitted program, collectives included."""
        return self.program.code(rank)

    def runner(self):
        """This rank's program: ``step(inputs, target=None) -> loss``, ``parameters()``."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AutoparError("runner() needs torch.distributed initialised: launch with torchrun"
                               " and call torch.distributed.init_process_group first, or use"
                               " autopar.testing.run_distributed for local tests")
        if dist.get_world_size() != self.plan.num_devices:
            raise PlanError(f"the plan is for {self.plan.num_devices} ranks but this launch has"
                            f" {dist.get_world_size()}: launch with --nproc-per-node/--nnodes to match")
        return self.program

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


def compile(model: nn.Module, cluster, *, example_inputs, example_target=None, loss_fn=None,
            options: Options | None = None, plan: Plan | None = None) -> CompiledModel:
    """Capture ``model`` and plan it on ``cluster`` (or check and take ``plan``).

    ``example_inputs`` is a tuple of positional arguments or a dict of keyword arguments. The
    training loss is ``loss_fn(output, target)`` when ``loss_fn`` is given (with
    ``example_target``), else the model's own: a 0-dim output or its ``.loss``. With
    ``options.pipeline`` (by default: on clusters of several nodes) the plan may split the model
    into pipeline stages (:func:`autopar.planner.inter.plan_inter`).
    """
    options = options or Options()
    captured = capture_for_training(model, example_inputs=example_inputs,
                                    example_target=example_target, loss_fn=loss_fn)
    if plan is None:
        from autopar.planner.inter import plan_inter, uses_pipeline

        if uses_pipeline(captured, cluster, options):
            plan = plan_inter(captured, cluster, options)
        elif options.search_meshes:
            plan = plan_intra_best_mesh(captured, cluster, options)
        else:
            plan = plan_intra(captured, cluster, options)
    else:
        check_plan_fits(plan, captured, cluster)
    if tuple(plan.mesh_shape) != tuple(cluster.mesh_shape):
        cluster = cluster.with_mesh(plan.mesh_shape)  # the same devices, viewed as the plan's mesh
    return CompiledModel(model, cluster, captured, plan, loss_fn)
