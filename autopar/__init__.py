"""autopar: an auto-parallel graph compiler for PyTorch.

    import autopar
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2)
    compiled = autopar.compile(model, cluster, example_inputs={"input_ids": ids, "labels": ids})
    print(compiled.plan.summary())
"""

from autopar.errors import (
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
from autopar.placement import Partial, Replicate, Shard
from autopar.cluster import Cluster
from autopar.options import Options
from autopar.plan import Plan
from autopar.compile import CompiledModel, compile  # noqa: A004  (the public verb)

__version__ = "0.1.0"


def __getattr__(name):
    # heavier namespaces load on first use: autopar.baselines, autopar.testing, autopar.zoo
    if name in ("baselines", "testing", "zoo", "checkpoint"):
        import importlib

        return importlib.import_module(f"autopar.{name}")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


__all__ = [
    "AutoparError",
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "ClusterError",
    "CompiledModel",
    "InfeasibleError",
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
