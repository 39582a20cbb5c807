"""A memory saver's view of a cost graph (the optimizer or the parameters on the host, recompute)
differs from the graph in memory only: its simplified form is the graph's, memory re-summed, and
equals simplifying the view afresh. Restriction filters remember their verdicts per strategy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar import Cluster, Options, zoo
from autopar.passes.capture.training import capture_for_training
from autopar.planner import intra
from autopar.planner.fetched import fetched_graph
from autopar.planner.offload import offloaded_graph
from autopar.planner.peak import recomputing_graph
from autopar.planner.restrictions import megatron_rule
from autopar.planner.simplify import simplify
from autopar.planner.solve import restrict, solve_graph

A100 = dataclasses.replace(Cluster.preset("dgx-a100", nodes=1, use_profile=False), mesh_shape=(2, 4))


@pytest.fixture(scope="module")
def costed():
    model, (args, kwargs) = zoo.gpt2(layers=3, hidden=128, heads=4, vocab=512, seq=256, batch=16, device="meta")
    captured = capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})
    graph, cost_model = intra._costed(captured, A100, Options(), "autopar")
    return captured, graph, cost_model


def _views(captured, graph, cost_model):
    offloaded = offloaded_graph(graph, cost_model)
    fetching = fetched_graph(graph, cost_model, captured)
    return {"optimizer offloaded": offloaded, "selective": recomputing_graph(graph, captured, cost_model, selective=True),
            "recompute, optimizer offloaded": recomputing_graph(offloaded, captured, cost_model),
            "recompute, parameters offloaded": recomputing_graph(fetching, captured, cost_model)}


def test_a_saver_view_re_sums_the_graph_s_reduction_to_what_simplifying_it_gives(costed):
    captured, graph, cost_model = costed
    base = simplify(graph)
    assert base.followers and base.tied_layers  # folds and ties to re-sum through
    for name, view in _views(captured, graph, cost_model).items():
        costs = view.memo["costs of"]  # a fetching view's parameters cost their host seconds: its own
        assert costs is (fetched_graph(graph, cost_model, captured) if "parameters" in name else graph), name
        base = simplify(costs)
        fresh, summed = simplify(view), base.with_memory(view)
        assert not all(np.array_equal(a, b) for a, b in zip(fresh.memory, base.memory)), name  # memory differs
        assert summed.constant_memory == fresh.constant_memory, name
        assert all(np.array_equal(a, b) for a, b in zip(summed.memory, fresh.memory)), name
        assert summed.groups == fresh.groups and summed.fixed == fresh.fixed, name
        assert all(np.array_equal(a, b) for a, b in zip(summed.costs, fresh.costs)), name
        assert summed.edges.keys() == fresh.edges.keys(), name
        alone = dataclasses.replace(view)  # a replace() starts without the memo: simplified afresh
        assert "costs of" not in alone.memo
        ours, theirs = (solve_graph(g, Options(), None, method=name) for g in (view, alone))
        assert list(ours.choice) == list(theirs.choice), name


def test_a_restriction_remembers_verdicts_that_a_fresh_filter_gives(costed):
    _, graph, _ = costed
    for zero in (0, 3):
        remembered = restrict(graph, megatron_rule((2, 4), zero=zero))
        fresh = restrict(graph, lambda g, i, s: megatron_rule((2, 4), zero=zero)(g, i, s))  # nothing to remember
        assert [n.strategies for n in remembered.nodes] == [n.strategies for n in fresh.nodes]
        assert sum(len(n.strategies) for n in remembered.nodes) < sum(len(n.strategies) for n in graph.nodes)
