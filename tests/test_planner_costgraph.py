"""Cost-graph building shortcuts give exactly what the slow, general paths give."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar import Cluster, zoo
from autopar.core.ir import spec_of_node
from autopar.core.options import Options
from autopar.core.reshard import price
from autopar.passes.capture import capture
from autopar.planner.costgraph import build_cost_graph, op_call
from autopar.planner.costs import CostModel


@pytest.mark.parametrize("name", ["gpt2", "resnet", "moe"])
def test_call_walk_gives_spec_of_node_and_the_argument_nodes(name):
    model, (args, kwargs) = getattr(zoo, name)()
    cap = capture(model, args, kwargs=kwargs)
    checked = 0
    for node in cap.graph_module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        spec, key, nodes = op_call(node)
        expected = spec_of_node(node)
        assert spec == expected, node.format_node()
        assert str(pytree.tree_flatten(spec.args)[1]) == str(pytree.tree_flatten(expected.args)[1])
        assert nodes == [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
        hash(key)
        checked += 1
    assert checked > 20


def test_edge_matrices_use_the_exact_bytes_of_each_resharding():
    """Resharding patterns are costed once per pair of shardings and scaled to each tensor: the
    bytes must equal those core.reshard.price gives for the tensor itself, and every entry of an
    edge matrix (costed per distinct pair) the sum of its collectives' seconds."""
    model, (args, kwargs) = zoo.gpt2()
    cap = capture(model, args, kwargs=kwargs)
    cluster = Cluster.preset("dgx-a100", nodes=2, use_profile=False)
    cm = CostModel(cluster, Options())
    graph = build_cost_graph(cap, cluster.mesh_shape, cm)
    for e in graph.edges[::5]:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        grad = src.requires_grad and e.meta.dtype.is_floating_point
        for a, s in enumerate(src.strategies):
            for b, t in enumerate(dst.strategies):
                out, need = s.outputs[e.out_index], t.inputs[e.in_index]
                steps = cm.collectives(e.meta, out, need, t, grad=grad, regather=src.kind == "parameter")
                forward = [(c.kind, c.axis, c.nbytes) for c in price(out, need, shape=e.meta.shape,
                                                                     itemsize=e.meta.dtype.itemsize,
                                                                     mesh_shape=cluster.mesh_shape)]
                assert [(k, ax, nb) for ph, k, ax, nb in steps if ph == "forward"] == forward
                assert e.cost[a, b] == sum(cluster.collective_time(k, nb, ax) for _, k, ax, nb in steps)
