"""Running emitted programs on torch.distributed: :class:`DistributedProgram` (one rank's
module, ``step``, the full state), :class:`PipelineProgram` (stages over micro-batches),
checkpoints (:mod:`~autopar.runtime.checkpoint`) and local rank processes
(:mod:`~autopar.runtime.launch`)."""

from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.program import DistributedModule, DistributedProgram

__all__ = ["DistributedModule", "DistributedProgram", "PipelineProgram"]
