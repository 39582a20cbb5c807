"""Repeat labels (autopar.passes.capture.repeats): the groups of repeated blocks of a T5 (an
encoder stack and a decoder stack whose first blocks differ) and the iterations of a loop that
export unrolled, found at capture and tied by the planner into fewer solver nodes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from autopar import Cluster
from autopar.compile import compile
from autopar.core.options import Options
from autopar.passes.capture import saved
from autopar.passes.capture.layers import repeated_blocks
from autopar.passes.capture.repeats import MIN_ITERATIONS, loop_runs
from autopar.passes.capture.training import capture_for_training
from autopar.planner import microbatch
from autopar.planner.costgraph import build_cost_graph
from autopar.planner.intra import plan_intra
from autopar.planner.layers import balanced_groups, split_layers, window
from autopar.planner.microbatch import MicroBatchCostModel, microbatch_placements
from autopar.planner.simplify import simplify
from autopar.testing import run_programs
from one_process import one_process

STEPS = MIN_ITERATIONS + 4
MEASURE = saved._backward_part  # one call's backward, measured


class ScanLayer(nn.Module):
    """A recurrence over time steps, written as a Python loop (export unrolls it)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        x = self.inp(x)
        h = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.proj(h) + x[:, t])
            outs.append(h)
        return torch.stack(outs, dim=1)


class Scan(ScanLayer):
    """One :class:`ScanLayer` and a loss."""

    def forward(self, x):
        return super().forward(x).pow(2).sum()


class ScanLayers(nn.Module):
    """Four identical layers, each with a loop inside: pipeline layers whose steps repeat too."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ScanLayer() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).sum()


def _labels(cap) -> Counter:
    return Counter(n.meta["autopar_repeat"] for n in cap.graph_module.graph.nodes
                   if n.op == "call_function" and n.meta["autopar_repeat"] is not None)


def _solver_nodes(cap, share: bool) -> int:
    plan = plan_intra(cap, Cluster.local(world_size=2), Options(share_layers=share))
    return plan.solver.solver_nodes


def test_loop_runs_finds_back_to_back_copies_of_one_sequence_and_nothing_shorter():
    keys = list("xy") + list("abc") * MIN_ITERATIONS + list("z") + list("ab") * 3 + ["q"] * (MIN_ITERATIONS + 1)
    assert loop_runs(keys) == [(2, 3, MIN_ITERATIONS), (2 + 3 * MIN_ITERATIONS + 7, 1, MIN_ITERATIONS + 1)]
    assert loop_runs(list("abcd") * (MIN_ITERATIONS - 1)) == []


@pytest.fixture(scope="module")
def t5():
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build, config_of

    arch = next(a for a in architectures() if a.class_name == "T5ForConditionalGeneration")
    config = config_of(arch)
    config.num_layers = config.num_decoder_layers = 3
    model, inputs = build(arch, config=config)
    return model, inputs, capture_for_training(model, example_inputs=inputs)


def test_a_t5_has_two_groups_of_repeated_blocks_beside_its_different_first_blocks(t5):
    model, _, cap = t5
    assert repeated_blocks(model) == (("encoder.block.1", "encoder.block.2"),
                                      ("decoder.block.1", "decoder.block.2"))
    assert cap.layers == ()  # neither stack is all alike: no pipeline layers
    labels = _labels(cap)
    assert set(labels) == {"encoder.block.1", "encoder.block.2", "decoder.block.1", "decoder.block.2"}
    assert labels["encoder.block.1"] == labels["encoder.block.2"] > 0
    assert labels["decoder.block.1"] == labels["decoder.block.2"] > labels["encoder.block.1"]


def test_the_planner_ties_each_t5_group_into_one_decision_per_position(t5):
    _, _, cap = t5
    shared, alone = _solver_nodes(cap, True), _solver_nodes(cap, False)
    labels = _labels(cap)
    # each group's second block shares its first's solver nodes: about one block per group fewer
    assert alone - shared >= (labels["encoder.block.1"] + labels["decoder.block.1"]) // 2


def test_an_unrolled_loop_labels_one_iteration_per_time_step_and_ties_them():
    x = torch.randn(2, STEPS, 8)
    cap = capture_for_training(Scan(), example_inputs=(x,))
    labels = _labels(cap)
    iterations = sorted(labels, key=lambda label: int(label.rsplit(".", 1)[1]))
    assert iterations == [f"#0.{t}" for t in range(STEPS)]
    assert len(set(labels.values())) == 1 and labels["#0.0"] >= 3  # select, linear, add, tanh...
    shared, alone = _solver_nodes(cap, True), _solver_nodes(cap, False)
    assert alone - shared >= (STEPS - 2) * 2


@pytest.mark.slow
def test_a_t5_planned_with_its_groups_tied_trains_on_two_ranks_like_one_process(t5):
    model, inputs, _ = t5
    compiled = compile(model, Cluster.local(world_size=2), example_inputs=inputs)
    ref = one_process(model, inputs=inputs, steps=2, optimizer="sgd", lr=0.01)
    results = run_programs({"t5": (compiled, inputs, None)}, steps=2, lr=0.01, return_parameters=True)
    assert ref.mismatches(*results["t5"]) == []


def _backward_runs(monkeypatch, steps: int) -> tuple[int, list]:
    """(how many backwards the saved-tensor pass measures, every call's ``autopar_backward``) when
    capturing a :class:`Scan` of ``steps`` time steps."""
    runs = []
    monkeypatch.setattr(saved, "_backward_part", lambda *a: runs.append(1) or MEASURE(*a))
    torch.manual_seed(0)
    cap = capture_for_training(Scan(), example_inputs=(torch.randn(2, steps, 8),))
    return len(runs), [n.meta["autopar_backward"] for n in cap.graph_module.graph.nodes if n.op == "call_function"]


def test_the_saved_tensor_pass_measures_one_backward_per_distinct_call(monkeypatch):
    runs, parts = _backward_runs(monkeypatch, STEPS)
    more_runs, _ = _backward_runs(monkeypatch, STEPS + 8)
    assert runs < len(parts) // 2
    assert more_runs - runs <= 8  # a step adds only its x[:, t] (select's index differs)
    monkeypatch.setattr(saved, "_call_key", lambda *a: None)  # every call measured
    every_run, every_part = _backward_runs(monkeypatch, STEPS)
    assert every_run == len(parts) and every_part == parts  # the same measurements


def _window_graph(steps: int):
    """The micro-batch cost graph of the pipeline window of a :class:`ScanLayers` of ``steps`` time steps."""
    cap = capture_for_training(ScanLayers(), example_inputs=(torch.randn(4, steps, 8),))
    info = microbatch_placements(window(cap, split_layers(cap)))
    cost_model = MicroBatchCostModel(Cluster.local(world_size=2), Options(), pieces=2)
    return build_cost_graph(info.planned(), cost_model, microbatch=info)


def test_a_loop_inside_pipeline_layers_ties_its_steps_in_the_window_graph(monkeypatch):
    groups = len(simplify(_window_graph(STEPS)).groups)
    assert len(simplify(_window_graph(STEPS + 8)).groups) == groups  # time steps add no solver nodes
    monkeypatch.setattr(microbatch, "window_label", lambda part, repeat: part)  # the layers tied only
    assert len(simplify(_window_graph(STEPS)).groups) > groups + STEPS


def test_the_edges_of_a_loops_steps_share_their_micro_batch_costs():
    graph = _window_graph(STEPS)
    computed = {id(e.phases[0]) for e in graph.edges}  # each matrix computed once
    assert len(computed) < len(graph.edges) // 2


def _balanced_window_groups(steps: int) -> int:
    """Solver nodes of a :class:`Scan`'s whole graph as a pipeline window of two balanced groups."""
    cap = capture_for_training(Scan(), example_inputs=(torch.randn(4, steps, 8),))
    info = microbatch_placements(balanced_groups(cap, groups=2))
    cost_model = MicroBatchCostModel(Cluster.local(world_size=2), Options(), pieces=2)
    return len(simplify(build_cost_graph(info.planned(), cost_model, microbatch=info)).groups)


def test_a_balanced_pipeline_window_ties_a_loops_steps_as_one_stage_does():
    assert _balanced_window_groups(STEPS + 8) == _balanced_window_groups(STEPS)
