"""Whether a plan uses expert parallelism: stacked experts sharded on their experts dim.

transformers' routed experts hold their weights stacked (E, ...) (``experts.gate_up_proj``,
``experts.up_proj``, ``experts.down_proj``); traced as a dense dispatch
(:mod:`autopar.passes.capture.moe`) their batched matmuls are einsums taking those weights. A
mesh axis is expert-parallel when the weights are stored ``S(0)`` on it and the experts' einsums
take them ``S(0)`` there (ZeRO-3 also stores them ``S(0)`` but gathers them for use); for a
pipelined plan, an axis of its stages' meshes::

    expert_parallel_axes(compiled.plan)    # {1}: experts sharded over mesh axis 1
"""

from __future__ import annotations

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")


def expert_parallel_axes(plan) -> set[int]:
    """Mesh axes over which ``plan`` shards the experts (empty: no expert parallelism)."""
    placements = dict(plan.parameter_placements)
    for stage in plan.stages:
        placements.update(stage.parameter_placements)
    stored = {axis for fqn, placements in placements.items() if fqn.endswith(EXPERT_WEIGHTS)
              for axis, p in enumerate(placements) if p == "S(0)"}
    used = {axis for n in plan.nodes if n.op == "aten.einsum.default" and "experts" in (n.module or "")
            and len(n.inputs) == 2 for axis, p in enumerate(n.inputs[1].split(",")) if p.strip() == "S(0)"}
    return stored & used


__all__ = ["EXPERT_WEIGHTS", "expert_parallel_axes"]
