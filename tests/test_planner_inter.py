"""Inter-operator planning: stage splits of small GPTs on fake 2×8 clusters, Megatron/grid with
pp > 1, the Plan's JSON round trip with stages, and the pieces (units, sub-meshes, micro-batch
placements, ZeRO costs). The stage DP itself is tested in tests/test_solver_stages.py."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.core.errors import InfeasibleError, PlanError
from autopar.core.options import Options, OptionsError
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.capture.training import capture_for_training
from autopar.plan import Plan, Stage
from autopar.planner.candidates import candidates
from autopar.planner.costgraph import build_cost_graph
from autopar.planner.inter import evaluate_uniform, grid_search, search
from autopar.planner.layers import layer_units, split_layers, window
from autopar.planner.microbatch import MicroBatchCostModel, loss_casts, microbatch_placements
from autopar.planner.pipeline_model import build_model, submesh_sizes
from autopar.planner.pipeline_plan import allocate_ranks, build_pipeline_plan
from autopar.planner.stage_costs import evaluate
from autopar.planner.stage_table import DataParallelCosts

# ----------------------------------------------------------------------------- pieces


def test_layer_units_allow_every_even_pipeline_depth_of_the_grid():
    assert layer_units(96, num_devices=1024, max_units=32) == 32   # pp 1..32, 3 layers per unit
    assert layer_units(80, num_devices=1536, max_units=32) == 16   # 16 beats 20 (5, 10, 20 ∤ 1536)
    assert layer_units(105, num_devices=2520, max_units=32) == 21
    assert layer_units(8, num_devices=16, max_units=32) == 8


def test_submesh_shapes_are_alpa_shapes_no_smaller_than_the_average_stage():
    two_nodes = Cluster.preset("dgx-a100", nodes=2, use_profile=False)
    assert submesh_sizes(two_nodes, 8) == [2, 4, 8, 16]
    assert submesh_sizes(two_nodes, 2) == [8, 16]
    big = Cluster.preset("dgx-a100", nodes=128, use_profile=False)
    assert submesh_sizes(big, 32) == [32, 64, 128, 256, 512, 1024]


def test_allocate_ranks_gives_whole_nodes_first_and_never_straddles():
    ranks = allocate_ranks([4, 8, 2, 2])
    assert ranks[1] == tuple(range(0, 8)) and ranks[0] == (8, 9, 10, 11)
    assert ranks[2] == (12, 13) and ranks[3] == (14, 15)


def test_zero_stages_cost_and_memory_by_hand():
    cluster = Cluster.preset("dgx-a100", nodes=2, use_profile=False)
    dpc = DataParallelCosts(cluster, (2, 2, 12))  # mixed-precision Adam
    params = [("w", 1e6, 2, True), ("b", 1e3, 2, True)]  # (name, local numel, itemsize, trained)
    sub = dataclasses.replace(cluster, mesh_shape=(4, 4))  # dp = 4 across the two nodes, tp = 4

    def t(kind):
        return sum(sub.collective_time(kind, n * i, 0) for _, n, i, _ in params)

    n = 1e6 + 1e3
    mb, step, states, gathered, largest = dpc.costs(params, dp=4, tp=4, zero=0)
    assert (mb, step, gathered) == (0.0, pytest.approx(t("all_reduce")), 0.0)
    assert list(states) == [2 * n, 2 * n, 12 * n] and largest == 2e6  # w's gradient, whole
    mb, step, states, _, largest = dpc.costs(params, dp=4, tp=4, zero=1)  # optimizer states sharded
    assert step == pytest.approx(t("reduce_scatter") + t("all_gather")) and mb == 0.0
    assert list(states) == [2 * n, 2 * n, 3 * n] and largest == 2e6
    mb, step, states, gathered, largest = dpc.costs(params, dp=4, tp=4, zero=3)  # gathered twice per micro-batch
    assert mb == pytest.approx(2 * t("all_gather") + t("reduce_scatter")) and step == 0.0
    assert list(states) == [n / 2, n / 2, 3 * n] and gathered == 2 * n and largest == 2e6 / 4
    fp32 = DataParallelCosts(cluster, (4, 4, 8), copy=True)  # fp32 Adam: a shard copies its elements
    assert list(fp32.costs(params, dp=4, tp=4, zero=1)[2]) == [4 * n, 4 * n, 3 * n]
    frozen = [("w", 1e6, 2, False)]  # a frozen weight: held, never reduced or stepped
    assert dpc.costs(frozen, dp=4, tp=4, zero=1)[:3] == (0.0, 0.0, pytest.approx([2e6, 0, 0]))
    mb, step, states, gathered, largest = dpc.costs(frozen, dp=4, tp=4, zero=3)
    assert list(states) == [2e6 / 4, 0, 0] and gathered == 2e6 and step == 0.0 and largest == 0.0
    assert mb == pytest.approx(2 * sub.collective_time("all_gather", 2e6, 0))


def test_a_bf16_model_splits_into_micro_batches_and_data_parallel_replicas():
    """BERT's bf16 loss is summed in fp32 and cast back (``_to_copy`` of a Partial sum, which no rule
    passes through): the cast takes it whole and the window still splits on the batch."""
    import torch

    from autopar import zoo

    model, (args, kwargs) = zoo.bert(layers=2, hidden=64, heads=4, seq=32, batch=8, dtype=torch.bfloat16,
                                     device="meta")
    captured = capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})
    whole = window(captured, split_layers(captured))
    info, casts = microbatch_placements(whole), loss_casts(whole)
    assert casts and info.splittable
    assert all(info.mb_out[c] == (Replicate(),) for c in casts)
    plan = compile(model, _cluster(25e9), example_inputs={"input_ids": args[0], **kwargs},
                   options=Options(pipeline=True, micro_batches=4)).plan
    assert plan.stages and plan.micro_batches == 4


# ----------------------------------------------------------------------------- small GPTs


@pytest.fixture(scope="module")
def gpt():
    from autopar import zoo

    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=512, heads=8, vocab=512, seq=256, batch=32,
                                     device="meta")
    inputs = {"input_ids": args[0], **kwargs}  # captured as compile captures it under OPTIONS (mixed)
    return model, inputs, capture_for_training(model, example_inputs=inputs, mixed_precision=True)


def candidates_of(info, tp_cluster):
    cm = MicroBatchCostModel(tp_cluster, OPTIONS, pieces=info.batch)
    return candidates(build_cost_graph(info.planned(), cm, microbatch=info), OPTIONS,
                      tp=tp_cluster.num_devices, layer_weight=3)


def _cluster(inter_bandwidth):
    return Cluster(mesh_shape=(2, 8), device="A100-80GB", inter_node_bandwidth=inter_bandwidth)


OPTIONS = Options(mixed_precision=True, pipeline=True, recompute=False)


@pytest.fixture(scope="module")
def slow_link(gpt):
    """The pipeline model of the small GPT on two nodes joined by a 1 GB/s link."""
    return build_model(gpt[2], _cluster(1e9), OPTIONS)


def test_microbatch_placements_follow_the_batch_to_the_loss(gpt):
    _, _, captured = gpt
    info = microbatch_placements(window(captured, split_layers(captured)))
    assert info.batch == 32 and info.splittable
    assert info.mb_out["input_ids"] == (Shard(0),)
    assert all(p == (Replicate(),) for n, p in info.mb_out.items() if info.kind.get(n) == "parameter")
    loss = captured.outputs[0].node
    assert isinstance(info.mb_out[loss][0], Partial)  # a sum over the micro-batches
    sdpa = next(n for n in info.specs if "scaled_dot_product_attention" in str(info.specs[n].op))
    assert info.mb_out[sdpa] == (Shard(0),)
    # costs are per micro-batch: a layer's activations and its output are linear in the samples
    one_device = Cluster(mesh_shape=(1,), device="A100-80GB")
    (only,), _ = candidates_of(info, one_device)
    small, large = (evaluate(info, one_device, OPTIONS, [only], b=b)[0] for b in (2, 8))
    layer = small.parts.index("layer")
    assert large.activations[layer] == pytest.approx(4 * small.activations[layer], rel=1e-12)
    assert large.boundary == 4 * small.boundary == 4 * 2 * 256 * 512 * 2  # b · seq · hidden · bf16
    # more samples take longer, but less than proportionally (kernel overheads, weights read once)
    assert small.fwd[layer] < large.fwd[layer] < 4 * small.fwd[layer]
    assert evaluate(info, one_device, OPTIONS, [only], b=3)[0] is None  # 3 does not divide 32


def test_slow_inter_node_link_gives_one_stage_per_node(gpt, slow_link):
    _, _, captured = gpt
    pipe = slow_link
    choice = search(pipe)
    plan = build_pipeline_plan(pipe, choice, name="autopar", solve_time=0.0)
    # data parallelism across nodes would all-reduce every gradient over the 1 GB/s link:
    # each node runs a contiguous half of the model and only activations cross
    assert [s.ranks for s in plan.stages] == [tuple(range(8)), tuple(range(8, 16))]
    layers = [layer for s in plan.stages for layer in s.layers]
    assert layers == list(captured.layers)
    assert plan.stages[0].has_pre and plan.stages[1].has_post
    assert not plan.stages[0].has_post and not plan.stages[1].has_pre
    # 1F1B: the first of two stages holds two micro-batches in flight (if there are two)
    assert [s.in_flight for s in plan.stages] == [min(2, plan.micro_batches), 1]
    # the step time is the pipeline formula over the stages' times
    t = [s.time for s in plan.stages]
    assert plan.predicted_step_time == pytest.approx((plan.micro_batches - 1) * max(t) + sum(t), rel=1e-12)
    grid = grid_search(pipe)
    assert choice.latency <= grid.latency * (1 + 1e-12)
    # every node of the graph is in exactly one stage, in graph order within a stage
    names = [n for s in plan.stages for n in s.nodes]
    assert sorted(names) == sorted(n.name for n in captured.graph_module.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("link", [1e9, 25e9])
def test_equal_stage_meshes_search_within_alpas_space_and_above_the_grid(gpt, link):
    pipe = build_model(gpt[2], _cluster(link), dataclasses.replace(OPTIONS, stage_meshes="equal"))
    equal = search(pipe)
    assert len({(devices, cfg.dp, cfg.tp) for _, _, devices, cfg in equal.stages}) == 1
    free = search(dataclasses.replace(pipe, options=dataclasses.replace(OPTIONS, stage_meshes="any")))
    assert free.latency <= equal.latency * (1 + 1e-12) <= grid_search(pipe).latency * (1 + 1e-12)


def test_stage_placements_and_json_round_trip(gpt, tmp_path):
    _, _, captured = gpt
    pipe = build_model(captured, _cluster(25e9), OPTIONS)
    plan = build_pipeline_plan(pipe, search(pipe), name="autopar", solve_time=0.0)
    assert sorted(r for s in plan.stages for r in s.ranks) == list(range(16))
    params = set()
    for stage in plan.stages:
        dp, tp = stage.mesh_shape
        assert dp * tp == len(stage.ranks)
        params |= set(stage.parameter_placements)
        if "input_ids" in stage.input_placements:  # the batch is split over dp
            assert stage.input_placements["input_ids"][0] == ("S(0)" if dp > 1 else "R")
        for name in stage.nodes:
            choice = next((n for n in plan.nodes if n.node == name), None)
            if choice is not None:
                assert all(len(s.split(",")) == 2 for s in choice.inputs + choice.outputs)
    assert params == set(captured.parameters)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan and again.stages == plan.stages and again.micro_batches == plan.micro_batches


def test_megatron_with_pipeline_stages_matches_the_formula(gpt):
    model, inputs, captured = gpt
    cluster = _cluster(25e9)
    options = Options(mixed_precision=True)
    plan = baselines.megatron(model, cluster, example_inputs=inputs, tp=4, pp=2, micro_batches=4, options=options)
    assert plan.micro_batches == 4 and plan.schedule == "1f1b"
    assert [s.mesh_shape for s in plan.stages] == [(2, 4), (2, 4)]
    assert [len(s.layers) for s in plan.stages] == [2, 2]
    t0, t1 = (s.time for s in plan.stages)
    assert plan.predicted_step_time == pytest.approx(3 * max(t0, t1) + t0 + t1, rel=1e-12)
    busy = 4 * (t0 * 8 + t1 * 8)
    assert plan.bubble_fraction == pytest.approx(1 - busy / (plan.predicted_step_time * 16))
    assert [s.in_flight for s in plan.stages] == [2, 1]
    gpipe = baselines.megatron(model, cluster, example_inputs=inputs, tp=4, pp=2, micro_batches=4,
                               options=Options(mixed_precision=True, schedule="gpipe"))
    assert [s.in_flight for s in gpipe.stages] == [4, 4]
    assert gpipe.predicted_peak_memory > plan.predicted_peak_memory
    assert gpipe.predicted_step_time == pytest.approx(plan.predicted_step_time)
    # Megatron's tp axis: the tp-sharded weights are column/row pairs, the batch whole on tp
    for st in plan.stages:
        for name, placement in st.parameter_placements.items():
            if name.endswith("c_fc.weight"):
                assert placement == ("R", "S(1)")   # Conv1D (in, out): column parallel
            if name.endswith("mlp.c_proj.weight"):
                assert placement == ("R", "S(0)")   # row parallel
    with pytest.raises(baselines.BaselineError):
        baselines.megatron(model, cluster, example_inputs=inputs, tp=4, pp=3, options=options)


def test_grid_with_pipelines_never_beats_autopar(gpt, slow_link):
    model, inputs, captured = gpt
    cluster = _cluster(1e9)
    grid = baselines.grid(model, cluster, example_inputs=inputs, options=OPTIONS)
    auto = compile(model, cluster, example_inputs=inputs, options=OPTIONS).plan
    assert grid.name.startswith("grid: megatron(")
    assert auto.stages and grid.stages
    assert auto.predicted_step_time <= grid.predicted_step_time * (1 + 1e-12)
    pipe = slow_link
    best = grid_search(pipe)
    assert grid.predicted_step_time == pytest.approx(best.latency, rel=1e-12)
    # the grid's configuration is a point of autopar's search with the same cost
    same = evaluate_uniform(pipe, tp=best.stages[0][3].tp, pp=len(best.stages), batches=best.batches,
                            zero=best.stages[0][3].zero, recompute=best.stages[0][3].recompute)
    assert same.latency == best.latency


def test_memory_pressure_turns_on_recomputation_or_zero(gpt):
    _, _, captured = gpt
    roomy = build_model(captured, _cluster(25e9), Options(mixed_precision=True, pipeline=True))
    free = search(roomy)
    plan = build_pipeline_plan(roomy, free, name="a", solve_time=0.0)
    tight = Cluster(mesh_shape=(2, 8), device="A100-80GB", inter_node_bandwidth=25e9,
                    device_memory=plan.predicted_peak_memory * 0.5)
    pipe = build_model(captured, tight, Options(mixed_precision=True, pipeline=True, memory_fraction=1.0))
    squeezed = build_pipeline_plan(pipe, search(pipe), name="b", solve_time=0.0)
    assert squeezed.predicted_peak_memory <= tight.device_memory
    assert all(s.memory <= tight.device_memory for s in squeezed.stages)
    assert squeezed.predicted_step_time >= plan.predicted_step_time
    tiny = Cluster(mesh_shape=(2, 8), device="A100-80GB", inter_node_bandwidth=25e9, device_memory=1e6)
    with pytest.raises(InfeasibleError, match="fits in"):
        search(build_model(captured, tiny, Options(mixed_precision=True, pipeline=True)))


# ----------------------------------------------------------------------------- options and plan


def test_pipeline_options_are_checked():
    with pytest.raises(OptionsError):
        Options(pipeline="yes")
    with pytest.raises(OptionsError):
        Options(micro_batches=0)
    with pytest.raises(OptionsError):
        Options(schedule="interleaved")
    with pytest.raises(OptionsError):
        Options(recompute="sometimes")
    with pytest.raises(OptionsError, match="stage_meshes"):
        Options(stage_meshes="mixed")


def test_stage_checks_its_ranks_and_placements():
    with pytest.raises(PlanError, match="distinct ranks"):
        Stage(index=0, ranks=(0, 1, 2), mesh_shape=(2, 2), layers=(), has_pre=True, has_post=True, nodes=(),
              parameter_placements={}, input_placements={}, time=1.0, memory=1.0)
    with pytest.raises(PlanError, match="placements"):
        Stage(index=0, ranks=(0, 1), mesh_shape=(1, 2), layers=(), has_pre=True, has_post=True, nodes=(),
              parameter_placements={"w": ("R",)}, input_placements={}, time=1.0, memory=1.0)
