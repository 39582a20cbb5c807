"""autopar: an auto-parallel graph compiler for PyTorch."""

from autopar.errors import (
    AutoparError,
    CaptureError,
    ClusterError,
    InfeasibleError,
    ShardingError,
    UnsupportedOpWarning,
)
from autopar.placement import Partial, Replicate, Shard
from autopar.cluster import Cluster

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "CaptureError",
    "Cluster",
    "ClusterError",
    "InfeasibleError",
    "Partial",
    "Replicate",
    "Shard",
    "ShardingError",
    "UnsupportedOpWarning",
]
