"""Sharding rules, one module per op family, all registered into one registry keyed by ATen op.

``strategies(spec, mesh_shape)`` lists what an op can do on a mesh; ``coverage(gm)`` says which
ops of a captured graph have a rule. Importing this package registers every family, and the
elementwise rules derived from torch's op tags and decompositions (``derived``).
"""

from autopar.core.ir import OpSpec, Strategy, TensorMeta, spec_of_call, spec_of_node
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.rules import (  # noqa: F401  (each import registers a family)
    attention,
    complex,
    conv,
    derived,
    embedding,
    factory,
    indexing,
    linalg,
    loss,
    matmul,
    moe,
    norm,
    pointwise,
    pooling,
    reduction,
    scan,
    softmax,
    view,
)
from autopar.passes.rules.registry import (
    AxisOption,
    axis_options,
    coverage,
    has_rule,
    register,
    registered_ops,
    strategies,
)

__all__ = [
    "AxisOption",
    "OpSpec",
    "Partial",
    "Replicate",
    "Shard",
    "Strategy",
    "TensorMeta",
    "axis_options",
    "coverage",
    "has_rule",
    "register",
    "registered_ops",
    "spec_of_call",
    "spec_of_node",
    "strategies",
]
