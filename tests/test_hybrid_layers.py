"""Hybrid stacks: a container of layers of a few kinds, each kind repeated (Zamba's, Jamba's and
Qwen3-Next's interleaved Mamba and attention layers), holds layers: each is a recompute region
and a pipeline cut point, none is stamped. A container with a child unlike every other holds
none. Zamba, recomputing layer by layer on 2 ranks, trains like one process. Where a pattern of
kinds repeats in at least three runs, the pipeline search's segments are those runs (the layers
before and after the longest such run join the pre and post parts), and a pipelined plan cut
between them trains like one process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.core.options import Options
from autopar.passes.capture import capture
from autopar.passes.capture.layers import repeated_containers
from autopar.planner.layers import split_layers, window
from autopar.runtime.recompute import layer_runs
from autopar.testing import run_programs
from one_process import one_process


class Mixer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class Attention(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, kinds, width=8):
        super().__init__()
        self.blocks = nn.ModuleList(Mixer(width) if k == "m" else Attention(width) for k in kinds)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("kinds, layers", [("mmamma", True), ("mamamm", True), ("mmmma", False), ("amm", False)])
def test_a_stack_holds_layers_when_every_kind_repeats(kinds, layers):
    model = Stack(kinds)
    expected = {"blocks": tuple(f"blocks.{i}" for i in range(len(kinds)))} if layers else {}
    assert repeated_containers(model) == expected
    cap = capture(model, (torch.randn(2, 8),))
    assert cap.layers == (expected.get("blocks", ()))
    assert cap.stamped == ()  # a hybrid stack is traced in full
    if layers:  # every compute node of a block is in its layer
        for node in cap.graph_module.graph.nodes:
            module = node.meta["autopar_module"]
            if node.op == "call_function" and module.startswith("blocks."):
                assert node.meta["autopar_layer"] == ".".join(module.split(".")[:2])


@pytest.fixture(scope="module")
def zamba():
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build, config_of

    arch = next(a for a in architectures() if a.class_name == "ZambaForCausalLM")
    config = config_of(arch)
    # Mamba layers, and hybrid ones (the shared attention block, then Mamba) from the third on
    config.num_hidden_layers = 5
    config.layers_block_type = ["linear_attention", "linear_attention", "hybrid", "linear_attention", "hybrid"]
    model, inputs = build(arch, config=config)
    return model, inputs


def test_zambas_mamba_and_hybrid_layers_are_layers(zamba):
    model, inputs = zamba
    kinds = {type(layer).__name__ for layer in model.model.layers}
    assert len(kinds) == 2, kinds  # Mamba layers and hybrid (shared attention + Mamba) layers
    cap = capture(model, (), kwargs=inputs)
    assert cap.layers == tuple(f"model.layers.{i}" for i in range(len(model.model.layers)))


@pytest.mark.slow  # rank processes
def test_zamba_recomputing_layer_by_layer_trains_like_one_process(zamba):
    model, inputs = zamba
    local = Cluster.local(world_size=2)
    plan = baselines.data_parallel(model, local, example_inputs=inputs, options=Options(recompute=True))
    assert plan.recompute is True
    compiled = compile(model, local.with_mesh(plan.mesh_shape), plan=plan, example_inputs=inputs)
    runs = layer_runs(compiled.program.emit(0))
    assert {layer for _, layer in runs.values() if layer} == {f"model.layers.{i}" for i in range(5)}
    results = run_programs({"dp recompute": (compiled, inputs, None)}, steps=3, lr=0.1, return_parameters=True,
                           timeout=900)
    ref = one_process(model, inputs=inputs, steps=3, optimizer="sgd", lr=0.1)
    bad = [line for losses, params in results.values() for line in ref.mismatches(losses, params)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("kinds, period", [("mamamama", 2), ("mmammamma", 3), ("aaaa", 1), ("mmaammaa", None)])
def test_pipeline_segments_are_the_shortest_repeating_run_of_at_least_three(kinds, period):
    cap = capture(Stack(kinds), (torch.randn(2, 8),))
    segments = split_layers(cap)
    assert (segments and segments.period) == period
    if period:
        assert segments.num_layers == len(kinds) // period
        assert segments.held(1, 1) == tuple(f"blocks.{i}" for i in range(period, 2 * period))
        assert segments.representative(f"blocks.{len(kinds) - 1}") == f"blocks.{2 * period - 1}"
        parts = window(cap, segments).part
        assert {parts[n.name] for n in cap.graph_module.graph.find_nodes(op="placeholder")
                if n.meta["autopar_layer"] == "blocks.1"} == {"first" if period > 1 else "layer"}


@pytest.mark.parametrize("kinds, period, prefix, suffix", [
    ("aamamamam", 2, 1, 0), ("mamamaa", 2, 0, 1), ("ammmmammmmammmmaa", 5, 0, 2), ("mmaammaa", None, 0, 0),
    ("amamamaaaaaaaa", None, 0, 0)])  # the last: its longest run (9 a's) leaves out more than a third
def test_a_pattern_that_does_not_repeat_to_the_ends_leaves_its_ends_to_the_pre_and_post_parts(kinds, period, prefix,
                                                                                               suffix):
    cap = capture(Stack(kinds), (torch.randn(2, 8),))
    segments = split_layers(cap)
    assert (segments and segments.period) == period
    if not period:
        return
    names = [f"blocks.{i}" for i in range(len(kinds))]
    assert segments.prefix == tuple(names[:prefix]) and segments.suffix == tuple(names[len(names) - suffix:])
    assert segments.num_layers == (len(kinds) - prefix - suffix) // period
    assert segments.held(0, segments.num_layers - 1) == tuple(names)  # every layer in some stage
    assert {n.meta["autopar_layer"] for n in segments.pre} - {None} == set(names[:prefix])
    assert {n.meta["autopar_layer"] for n in segments.post} - {None} == set(names[len(names) - suffix:])
    parts = window(cap, segments).part
    first = {parts.get(n.name) for n in cap.graph_module.graph.find_nodes(op="placeholder")
             if n.meta["autopar_layer"] == names[prefix]}
    assert first == {"first"}
    if prefix:  # a prefix's parameters are the pre part's, not the first segment's
        assert not {parts.get(n.name) for n in cap.graph_module.graph.find_nodes(op="placeholder")
                    if n.meta["autopar_layer"] == names[0]} - {None}


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("kinds, first_stage", [("mamamama", 4), ("aamamamam", 5)])  # the second: blocks.0 a prefix
def test_a_pipeline_cut_between_runs_of_a_hybrid_stack_trains_like_one_process(kinds, first_stage):
    torch.manual_seed(0)
    model = Stack(kinds)
    inputs = (torch.randn(4, 8),)
    local = Cluster.local(world_size=2)
    plan = baselines.megatron(model, local, tp=1, pp=2, micro_batches=2, options=Options(pipeline=True),
                              example_inputs=inputs)
    assert [s.layers for s in plan.stages] == [tuple(f"blocks.{i}" for i in range(first_stage)),
                                               tuple(f"blocks.{i}" for i in range(first_stage, len(kinds)))]
    compiled = compile(model, local.with_mesh(plan.mesh_shape), plan=plan, example_inputs=inputs)
    # the sum loss grows the weights fast: at lr=0.05 nine layers reach 2e3 in 3 steps, where fp32's
    # rounding of a micro-batch's sum leaves the band of one process's
    results = run_programs({"pp2": (compiled, inputs, None)}, steps=3, lr=0.01, return_parameters=True, timeout=900)
    ref = one_process(model, inputs=inputs, steps=3, optimizer="sgd", lr=0.01)
    bad = [line for losses, params in results.values() for line in ref.mismatches(losses, params)]
    assert not bad, "\n".join(bad)
