"""Intra-op planning end to end with known answers: Megatron for a compute-heavy MLP, data
parallelism for a large batch, sharded parameters under a tight memory budget, the data-parallel
plan's cost by hand, and the Plan's JSON round trip."""

import math

import pytest
import torch
from torch import nn

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.core.errors import InfeasibleError, PlanError
from autopar.core.ir import spec_of_node
from autopar.core.options import Options
from autopar.cost_models.compute import compute_time
from autopar.plan import Plan
from models import mlp

A100X4 = Cluster(mesh_shape=(4,), device="A100-80GB", intra_node_bandwidth=300e9)
# Known-answer tests keep the 4-GPU mesh one-dimensional: viewing it as 2x2 costs the same
# collectives with fewer latency steps, which is a (tiny) win the mesh search would take.
ONE_MESH = Options(search_meshes=False)


def _mlp(tokens, hidden, ffn):
    with torch.device("meta"):
        model = mlp(hidden, ffn)
        x, y = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    return model, dict(example_inputs=(x,), example_target=y, loss_fn=nn.functional.mse_loss)


def test_compute_heavy_small_batch_mlp_is_megatron_column_then_row_with_one_forward_reduction():
    model, kw = _mlp(4096, 4096, 16384)
    plan = compile(model, A100X4, **kw, options=ONE_MESH).plan
    assert plan.parameter_placements["fc1.weight"] == ("S(0)",)  # column parallel
    assert plan.parameter_placements["fc2.weight"] == ("S(1)",)  # row parallel
    assert plan.input_placements["args_0"] == ("R",)
    forward = plan.collectives(phase="forward")
    # One reduction of the row-parallel partial sums. The MSE loss can consume a hidden-dim
    # shard, so the optimum reduce-scatters (Megatron's sequence-parallel half of the
    # all-reduce) instead of all-reducing: half the bytes on the wire. The loss, summed over
    # those shards, is then all-reduced: one fp32 scalar.
    assert [(c.kind, c.nbytes) for c in forward] == [("reduce_scatter", 4096 * 4096 * 4), ("all_reduce", 4)]
    node = plan.node(forward[0].node)
    assert node.op == "aten.broadcast_tensors.default"


def test_megatron_baseline_is_column_then_row_and_never_beats_autopar():
    model, kw = _mlp(4096, 4096, 16384)
    auto = compile(model, A100X4, **kw).plan  # searches meshes: can only be faster
    mega = baselines.megatron(model, A100X4, tp=4, **kw)
    assert mega.parameter_placements["fc1.weight"] == ("R", "S(0)")
    assert mega.parameter_placements["fc2.weight"] == ("R", "S(1)")
    assert auto.predicted_step_time <= mega.predicted_step_time


def test_large_batch_small_model_is_pure_data_parallel():
    model, kw = _mlp(65536, 1024, 4096)
    plan = compile(model, A100X4, **kw, options=ONE_MESH).plan
    assert set(plan.parameter_placements.values()) == {("R",)}
    assert plan.input_placements == {"args_0": ("S(0)",), "target": ("S(0)",)}
    assert {c.kind for c in plan.collectives(phase="backward")} == {"all_reduce"}
    # forward: only the loss's mean over the data-parallel ranks (one fp32 scalar)
    assert [(c.kind, c.nbytes, c.node) for c in plan.collectives(phase="forward")] == [("all_reduce", 4, "mse_loss")]


def test_memory_budget_below_replicated_parameters_shards_them_and_fits():
    model, kw = _mlp(8192, 4096, 16384)
    replicated_state = (4096 * 16384 * 2 + 16384 + 4096) * 16  # fp32 Adam: 4 + 4 + 8 bytes
    budget = replicated_state * 0.6
    small = Cluster(mesh_shape=(4,), device="A100-80GB", intra_node_bandwidth=300e9, device_memory=budget)
    plan = compile(model, small, **kw, options=Options(memory_fraction=1.0, search_meshes=False)).plan
    assert plan.predicted_peak_memory <= budget
    assert any("S(" in p[0] for p in plan.parameter_placements.values())
    with pytest.raises(InfeasibleError) as err:
        tiny = Cluster(mesh_shape=(4,), device="A100-80GB", intra_node_bandwidth=300e9, device_memory=1e6)
        compile(model, tiny, **kw)
    assert err.value.smallest_peak > 1e6
    assert "GiB" in str(err.value) or "bytes" in str(err.value)


def test_data_parallel_objective_equals_the_hand_computed_cost():
    model, kw = _mlp(4096, 512, 2048)
    compiled = compile(model, A100X4, **kw, options=ONE_MESH)
    plan = baselines.data_parallel(model, A100X4, **kw)
    # compute: every op on its quarter of the batch (roofline of the cost model, tested apart)
    from autopar.core.ir import gradient_inputs, gradient_values
    from autopar.passes.rules.registry import strategies
    from autopar.plan.records import trainable_parameters
    from autopar.planner.costs import CostModel

    compute = 0.0
    graph = compiled.captured.graph_module.graph
    reached = gradient_values(graph, trainable_parameters(compiled.captured))  # the batch gets no gradient
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        choice = plan.node(node.name)
        strat = next(s for s in strategies(spec_of_node(node), (4,))
                     if tuple(",".join(map(str, x)) for x in s.inputs) == choice.inputs
                     and tuple(",".join(map(str, x)) for x in s.outputs) == choice.outputs)
        fwd, bwd = compute_time(spec_of_node(node), strat, (4,), A100X4.device_spec,
                                grads=gradient_inputs(node, reached))
        compute += fwd + bwd
    # communication: one ring all-reduce of each fp32 gradient over 4 GPUs on NVSwitch
    link = A100X4.links[0]
    grads = [512 * 2048, 2048, 2048 * 512, 512]
    allreduce = sum(2 * 3 / 4 * (4 * n) / link.bandwidth + 2 * 3 * link.latency for n in grads)
    assert plan.time.compute == pytest.approx(compute, rel=1e-9)
    assert plan.time.communication == pytest.approx(allreduce, rel=1e-9)
    assert plan.time.resharding < 1e-4  # only the scalar loss is all-reduced
    assert plan.predicted_step_time == pytest.approx(compute + allreduce + plan.time.resharding, rel=1e-12)
    _ = CostModel  # the planner's costs come from the same cost model


def test_plan_json_round_trip_and_errors(tmp_path):
    model, kw = _mlp(4096, 512, 2048)
    plan = compile(model, A100X4, **kw).plan
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    again = compile(model, A100X4, **kw, plan=loaded)
    assert again.plan == plan
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not a valid plan file"):
        Plan.load(bad)
    newer = plan.to_dict() | {"schema_version": 99}
    with pytest.raises(PlanError, match="schema version"):
        Plan.from_dict(newer)
    other, kw2 = _mlp(4096, 512, 1024)
    with pytest.raises(PlanError, match="different model"):
        compile(other, A100X4, **kw2, plan=plan)
    assert "data_parallel" not in plan.summary()
    assert "predicted step time" in plan.summary()
    assert not math.isnan(plan.mfu) and 0 < plan.mfu < 1


def _example(model, args, kwargs) -> dict:
    import inspect

    names = list(inspect.signature(model.forward).parameters)
    return {**dict(zip(names, args)), **kwargs}


_ZOO: dict = {}


def _zoo_model(name, dtype, **sizes):
    """``(model, example inputs)`` of a zoo model, built once per module: with ``memo_capture``
    every planner call on it (several tests, both cluster sizes) shares one capture."""
    from autopar import zoo

    key = (name, dtype, tuple(sorted(sizes.items())))
    if key not in _ZOO:
        model, (args, kwargs) = getattr(zoo, name)(dtype=dtype, **sizes)
        _ZOO[key] = model, _example(model, args, kwargs)
    return _ZOO[key]


def _assert_never_slower(model, example, cluster):
    """autopar's plan is at least as fast as every baseline's (data parallel, FSDP, the grid with
    and without pipelining) and fits wherever one of them does."""
    auto = compile(model, cluster, example_inputs=example).plan
    runs = [(baselines.data_parallel, None), (baselines.fsdp, None), (baselines.grid, Options(pipeline=False)),
            (baselines.grid, None)]
    for baseline, options in runs:
        try:
            other = baseline(model, cluster, example_inputs=example, options=options)
        except InfeasibleError:
            continue
        assert auto.predicted_step_time <= other.predicted_step_time * (1 + 1e-9), (auto.name, other.name)
    return auto


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize(("name", "dtype"), [("gpt2", torch.float32), ("llama", torch.float32),
                                             ("bert", torch.bfloat16)])  # bf16 BERT: a cast closes its loss
def test_autopar_is_never_predicted_slower_than_a_baseline(memo_capture, name, dtype, nodes):
    model, example = _zoo_model(name, dtype, layers=2, hidden=64, heads=4, batch=16, seq=32)
    _assert_never_slower(model, example, Cluster.preset("dgx-a100", nodes=nodes))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "nodes", "dtype"), [
    ("gpt2_small", 2, torch.bfloat16), ("phi3_mini", 2, torch.bfloat16), ("bart_large", 1, torch.bfloat16),
    ("mistral_7b", 2, torch.float32)])
def test_autopar_is_never_predicted_slower_than_a_baseline_at_full_size(memo_capture, name, nodes, dtype):
    """Full-size configs on the meta device (benchmarks/never_worse.py prints every row)."""
    model, example = _zoo_model(name, dtype, seq=1024, batch=16)
    _assert_never_slower(model, example, Cluster.preset("dgx-a100", nodes=nodes))


def test_compile_keeps_the_one_stage_plan_when_the_pipeline_search_finds_none(monkeypatch):
    """A model the pipeline search cannot fit but the one-stage planner can is planned, and the
    plan's name says which search won."""
    import importlib

    from autopar import zoo

    compile_module = importlib.import_module("autopar.compile")  # the module, not autopar.compile the function
    def no_fit(*args, **kwargs):
        raise InfeasibleError("no pipelined plan fits", smallest_peak=1e12)

    monkeypatch.setattr(compile_module, "plan_inter", no_fit)
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=64, heads=4, batch=16, seq=32)
    plan = compile(model, Cluster.preset("dgx-a100", nodes=2), example_inputs=_example(model, args, kwargs)).plan
    assert not plan.stages and plan.name == "autopar (one-stage search won; pipeline search: no plan fits)"
    with pytest.raises(InfeasibleError, match="no pipelined plan fits"):
        compile(model, Cluster.preset("dgx-a100", nodes=2), example_inputs=_example(model, args, kwargs),
                options=Options(pipeline=True))
