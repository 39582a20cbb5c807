"""Code generation: a captured graph + a :class:`ShardingAssignment` -> one rank's FX program.

``generate(graph_module, ctx)`` copies the graph and runs :data:`PASSES` in order; each is a plain
``graph_module, ctx -> graph_module`` function. The result is ordinary PyTorch whose ``.code``
shows every inserted collective::

    p_fc2_bias_to_partial = autopar_to_partial(p_fc2_bias, axis = 0, backward = 'identity')
    linear_1 = torch.ops.aten.linear.default(relu, p_fc2_weight, p_fc2_bias_to_partial)
    linear_1_all_reduce = autopar_all_reduce(linear_1, axis = 0, backward = 'identity')

(Megatron's row-parallel ``fc2``: the bias is added on one rank, the partial sums are
all-reduced, and that all-reduce is the identity backward.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import CodegenError
from autopar.core.ir import copy_graph_module
from autopar.passes.codegen.emit import (
    cleanup_pass,
    local_op_pass,
    local_shape_pass,
    reshard_pass,
    program_targets_pass,
)
from autopar.plan.annotate import annotate_pass
from autopar.plan.gradients import gradient_pass

PASSES = (annotate_pass, gradient_pass, reshard_pass, local_op_pass, local_shape_pass,
          program_targets_pass, cleanup_pass)


@dataclass(frozen=True)
class CodegenContext:
    """What the passes need besides the graph.

    ``trainable``: placeholder names of parameters that get gradients; ``loss_outputs``: indices
    (among the graph's tensor outputs) of the outputs that are differentiated; ``device``: where
    factory ops put their tensors (None: as captured).
    """

    assignment: ShardingAssignment
    rank: int
    trainable: frozenset = field(default_factory=frozenset)
    loss_outputs: tuple[int, ...] = ()
    device: torch.device | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.assignment.world_size:
            raise CodegenError(f"rank {self.rank} is outside a mesh of {self.assignment.world_size} ranks")
        object.__setattr__(self, "trainable", frozenset(self.trainable))
        object.__setattr__(self, "loss_outputs", tuple(self.loss_outputs))

    @property
    def coord(self) -> tuple[int, ...]:
        """This rank's mesh coordinate (ranks are numbered row-major over the mesh)."""
        coord = []
        rest = self.rank
        for n in reversed(self.assignment.mesh_shape):
            coord.append(rest % n)
            rest //= n
        return tuple(reversed(coord))


def generate(graph_module: torch.fx.GraphModule, ctx: CodegenContext) -> torch.fx.GraphModule:
    """One rank's program: run :data:`PASSES` on a copy of ``graph_module``."""
    gm = copy_graph_module(graph_module)
    for p in PASSES:
        gm = p(gm, ctx)
    return gm


__all__ = ["PASSES", "CodegenContext", "ShardingAssignment", "copy_graph_module", "generate"]
