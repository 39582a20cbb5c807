"""Apply a plan's shardings to another model of the same structure (e.g. a scaled-down copy)
on another mesh of the same rank, and cost it there."""

from __future__ import annotations

from autopar.core.errors import PlanError
from autopar.core.placement import format_sharding
from autopar.planner.intra import plan_intra


def transfer_plan(plan, captured, cluster, options, *, name: str | None = None):
    """A Plan for ``captured`` on ``cluster`` with every node, parameter and input placed as in
    ``plan`` (matched by node name / FQN). Raises PlanError when a placement does not fit."""
    if len(cluster.mesh_shape) != len(plan.mesh_shape):
        raise PlanError(f"the plan has {len(plan.mesh_shape)} mesh axes; the target mesh"
                        f" {tuple(cluster.mesh_shape)} must have as many")
    by_node = {n.node: n for n in plan.nodes}

    def wanted(node):
        if node.kind == "parameter":
            return plan.parameter_placements.get(node.target)
        if node.kind == "user_input":
            return plan.input_placements.get(node.target)
        n = by_node.get(node.name) if node.kind == "op" else None
        return (n.inputs, n.outputs, n.local) if n is not None else None

    def described(node, strategy):
        if node.kind in ("parameter", "user_input"):
            return tuple(str(p) for p in strategy.outputs[0])
        return (tuple(format_sharding(s) for s in strategy.inputs),
                tuple(format_sharding(s) for s in strategy.outputs), strategy.local)

    def allow(graph, i, strategy):
        want = wanted(graph.nodes[i])
        return want is None or described(graph.nodes[i], strategy) == want

    result = plan_intra(captured, cluster, options, allow=allow, name=name or plan.name, zero=plan.zero)
    got = {n.node: (n.inputs, n.outputs, n.local) for n in result.nodes}
    for node, n in by_node.items():
        if node in got and got[node] != (n.inputs, n.outputs, n.local):
            raise PlanError(f"node {node}'s strategy {n.strategy} does not fit the target model and"
                            f" mesh {tuple(cluster.mesh_shape)} (a sharded dim does not divide)")
    for table, what in ((plan.parameter_placements, result.parameter_placements),
                        (plan.input_placements, result.input_placements)):
        for key, placements in table.items():
            if key in what and what[key] != placements:
                raise PlanError(f"{key}'s placement {','.join(placements)} does not fit the target"
                                f" model and mesh {tuple(cluster.mesh_shape)}")
    return result
