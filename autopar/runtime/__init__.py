"""Running emitted programs on torch.distributed: per-axis process groups, differentiable
collectives, and :class:`DistributedProgram` (one rank's module, ``step``, the full state).

Names load lazily: code generation imports :mod:`autopar.comm.collectives`, and the program
imports code generation.
"""

import importlib

_EXPORTS = {
    "DistributedModule": "autopar.runtime.program",
    "DistributedProgram": "autopar.runtime.program",
    "RankMesh": "autopar.comm.collectives",
    "use_mesh": "autopar.comm.collectives",
    "WithLoss": "autopar.passes.capture.loss",
    "loss_of": "autopar.passes.capture.loss",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autopar.runtime' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
