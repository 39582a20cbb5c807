"""Cost-graph building: the shortcuts give exactly what the slow, general paths give, and the
builder's micro-batch mode agrees with its whole-graph mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar import Cluster, zoo
from autopar.core.ir import spec_of_node
from autopar.core.options import Options
from autopar.core.reshard import price
from autopar.passes.capture import capture
from autopar.passes.capture.training import capture_for_training
from autopar.planner.costgraph import PlannedGraph, build_cost_graph
from autopar.planner.costs import CostModel
from autopar.planner.graph_walk import op_call
from autopar.planner.layers import balanced_groups
from autopar.planner.microbatch import MicroBatchCostModel, microbatch_placements


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
    graph = build_cost_graph(PlannedGraph.of(cap), cm)
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


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_one_micro_batch_prices_a_window_as_the_whole_graph(name):
    """The builder's two modes agree: the whole graph as a window of one micro-batch on one
    replica, costed on the virtual mesh (1, 4), has the strategies, bytes, compute (constants
    included: a stage computes them for every micro-batch) and resharding seconds of the plain
    mesh (4,)."""
    model, (args, kwargs) = getattr(zoo, name)()
    captured = capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})
    info = microbatch_placements(balanced_groups(captured, groups=4))
    tp = Cluster(mesh_shape=(4,), device="A100-80GB")
    options = Options(mixed_precision=True)
    whole = build_cost_graph(PlannedGraph.of(captured), CostModel(tp, options))
    window = build_cost_graph(info.planned(), MicroBatchCostModel(tp, options, pieces=1), microbatch=info)
    assert info.splittable and len(window.nodes) == len(whole.nodes) and len(window.edges) == len(whole.edges)
    for node in whole.nodes:
        twin = window.nodes[window.index[node.name]]
        assert twin.strategies == node.strategies and list(twin.memory) == list(node.memory)
        assert twin.compute == pytest.approx(node.compute, rel=1e-12, abs=0)
    names = {(whole.nodes[e.src].name, whole.nodes[e.dst].name, e.in_index): e.cost for e in whole.edges}
    for e in window.edges:
        assert e.cost == pytest.approx(names[(window.nodes[e.src].name, window.nodes[e.dst].name, e.in_index)],
                                       rel=1e-12, abs=0)
        assert e.cost == pytest.approx(e.phases[0] + e.phases[1] + e.phases[2], rel=1e-12, abs=0)
    assert [whole.nodes[i].name for i in whole.unary] == [window.nodes[i].name for i in window.unary]
    for i, j in zip(whole.unary, window.unary):  # the loss ends replicated
        assert window.unary[j] == pytest.approx(whole.unary[i], rel=1e-12, abs=0)
    assert sum(node.fixed for node in whole.nodes) > 0 and any(e.phases[2].any() for e in window.edges)
