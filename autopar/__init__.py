"""autopar: an auto-parallel graph compiler for PyTorch.

    import autopar
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2)
    compiled = autopar.compile(model, cluster, example_inputs={"input_ids": ids, "labels": ids})
    print(compiled.plan.summary())

Layers, bottom first; each imports only itself and the layers above it in this list
(tests/test_layers.py checks it):

1. core — errors, placements, the shared IR, options, rank layout, the resharding planner (autopar.core)
2. capture — torch.export on fake tensors, layers, the loss wrapper (autopar.passes.capture)
3. rules — one sharding rule per ATen op family (autopar.passes.rules)
4. cost models — devices, compute, memory, collectives, the Cluster (autopar.cost_models)
5. plan — the Plan as data, its JSON, summary, explain and pictures (autopar.plan)
6. planning — cost graph, simplification, restrictions, intra-op ILP, stage DP (autopar.planner, autopar.solver)
7. communication — differentiable collectives, gradient buckets, process groups; imports only core (autopar.comm)
8. codegen — per-rank FX programs that call the communication layer (autopar.passes.codegen)
9. runtime — runs programs and pipelines, checkpoints, local rank processes (autopar.runtime)
10. API — compile, baselines, CLI, profiler, testing helpers, zoo (the rest of autopar)
"""

import importlib

from autopar.compile import CompiledModel, compile  # noqa: A004  (the public verb)
from autopar.core.errors import (
    AutoparError,
    CaptureError,
    CheckpointError,
    ClusterError,
    InfeasibleError,
    PlanError,
    ShardingError,
    SolverTimeLimitWarning,
    UnsupportedDtypeError,
    UnsupportedOpWarning,
)
from autopar.core.options import Options
from autopar.core.placement import Partial, Replicate, Shard
from autopar.cost_models.cluster import Cluster
from autopar.plan import Plan
from autopar.runtime.scaler import LossScale

__version__ = "0.1.0"
_LAZY = {"baselines": "autopar.baselines", "testing": "autopar.testing", "zoo": "autopar.zoo",
         "checkpoint": "autopar.runtime.checkpoint", "verify": "autopar.runtime.verify"}


def __getattr__(name):
    # heavier namespaces load on first use: autopar.baselines, .testing, .zoo, .checkpoint, .verify
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


__all__ = [
    "AutoparError",
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "ClusterError",
    "CompiledModel",
    "InfeasibleError",
    "LossScale",
    "Options",
    "Partial",
    "Plan",
    "PlanError",
    "Replicate",
    "Shard",
    "ShardingError",
    "SolverTimeLimitWarning",
    "UnsupportedDtypeError",
    "UnsupportedOpWarning",
    "compile",
]
