"""One rank's program of a pipeline stage: the stage's graph (:func:`autopar.plan.split.split_stages`)
after code generation's analysis (:func:`autopar.plan.split.analysed_stage`, boundary outputs
differentiated like losses: their gradients come from the next stage), through the other passes."""

from __future__ import annotations

import torch

from autopar.core.errors import PipelineError
from autopar.passes.codegen import PASSES, CodegenContext
from autopar.plan.annotate import annotate_pass
from autopar.plan.gradients import gradient_pass
from autopar.plan.split import StageGraph, analysed_stage


def generate_stage(stage: StageGraph, *, rank: int, device=None) -> torch.fx.GraphModule:
    """The program of the rank at position ``rank`` of ``stage``'s mesh (row-major)."""
    if PASSES[:2] != (annotate_pass, gradient_pass):
        raise PipelineError("code generation no longer starts with the annotate and gradient passes;"
                            " update analysed_stage")
    ctx = CodegenContext(assignment=stage.assignment, rank=rank, trainable=stage.trainable,
                         loss_outputs=stage.differentiated, device=device)
    gm = analysed_stage(stage)
    for p in PASSES[2:]:
        gm = p(gm, ctx)
    return gm


__all__ = ["generate_stage"]
