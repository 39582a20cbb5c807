"""plan.summary(), plan.explain() and plan.render() on the golden plans (tests/golden) and on a
deep and a pipelined plan built from them: figures add up to the plan's totals, repeated layers
fold into one row, recorded alternatives are exactly the cost graph's one-node switches, the
HTML has one Gantt bar per stage x micro-batch and the PNG is a real picture."""

import dataclasses
import html.parser
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from autopar import Cluster, compile, zoo
from autopar.core.errors import PlanError
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.plan import Plan
from autopar.plan.formatting import fmt_time, fold_numbered, natural_key
from autopar.plan.picture import MEMORY_COLORS, PHASE_COLORS, placement_color
from autopar.plan.render import RenderError, render, schedule_bars, sharding_map, stage_memory, to_html
from autopar.plan.render_png import DPI, MIN_HEIGHT, PNG_WIDTH, ROW
from autopar.plan.report import layer_groups
from autopar.planner.alternatives import switch_costs
from autopar.planner.costgraph import PlannedGraph, build_cost_graph
from autopar.planner.costs import CostModel
from autopar.planner.inter import search
from autopar.planner.intra import build_plan
from autopar.planner.microbatch import MicroBatchCostModel
from autopar.planner.pipeline_model import build_model
from autopar.planner.pipeline_plan import build_pipeline_plan
from autopar.planner.solve import evaluate, solve_graph
from autopar.planner.stage_alternatives import latency_change
from plan_builders import Stage, deep, golden, staged

NAMES = ("mlp", "gpt2", "llama", "bert")


# ----------------------------------------------------------------------------- summary


@pytest.mark.parametrize("name", NAMES)
def test_summary_rows_add_up_to_the_plan_totals_and_fit_in_100_columns(name):
    plan = golden(name)
    groups = layer_groups(plan)
    total = lambda attr: sum(getattr(g, attr) * g.count for g in groups)  # noqa: E731
    assert total("compute") == pytest.approx(plan.time.compute, rel=1e-9)
    assert total("communication") == pytest.approx(plan.time.communication + plan.time.resharding, rel=1e-9)
    assert total("parameters") == pytest.approx(plan.memory.parameters, rel=1e-9)
    assert total("optimizer") == pytest.approx(plan.memory.optimizer, rel=1e-9)
    assert total("flops") == pytest.approx(plan.flops_per_step, rel=1e-9)
    assert total("activations") <= plan.memory.activations  # the total also holds the inputs
    text = plan.summary()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "predicted step time" in text and "MFU" in text


def test_the_summary_gives_buffers_a_row_of_their_own_holding_their_bytes():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 96))  # 384 bytes, read whole

        def forward(self, x):
            return (self.proj(x) * self.scale[:32] + self.scale[32:64] - self.scale[64:]).square().mean()

    cluster = Cluster(mesh_shape=(2,), device="A100-80GB", intra_node_bandwidth=300e9)
    plan = compile(Scaled(), cluster, example_inputs=(torch.randn(8, 32),)).plan
    row = next(g for g in layer_groups(plan) if g.label == "(buffers, constants)")
    assert row.parameters == 96 * 4
    assert sum(g.parameters * g.count for g in layer_groups(plan)) == pytest.approx(plan.memory.parameters)
    assert any(line.startswith("(buffers, constants)") and "384B" in line for line in plan.summary().splitlines())


def test_summary_shows_each_weights_placement():
    plan = golden("mlp")
    text = plan.summary()
    for fqn, placements in plan.parameter_placements.items():
        module = fqn.rsplit(".", 1)[0]
        line = next(l for l in text.splitlines() if l.strip().startswith("weights") and module in l)
        assert f"{','.join(placements)}:" in line


def test_a_96_layer_model_reads_in_one_screen():
    plan = deep(golden("llama"), 96)
    text = plan.summary()
    rows = [l for l in text.splitlines() if l.startswith("model.layers.")]
    assert len(text.splitlines()) < 50
    merged = next(r for r in rows if r.split()[1] == "95")
    assert merged.startswith("model.layers.1-95 ")
    groups = layer_groups(plan)
    assert sum(g.count for g in groups if g.layers[0]) == 96
    assert sum(g.compute * g.count for g in groups) == pytest.approx(sum(n.compute_time for n in plan.nodes))


def test_summary_of_a_pipelined_plan_shows_its_stages_and_each_stages_bubble():
    plan = staged(deep(golden("llama"), 8), stages=2, micro_batches=4, schedule="1f1b")
    text = plan.summary()
    assert "2 pipeline stages x 4 micro-batches (1f1b)" in text
    assert "stage 0: ranks 0-3 as mesh (1, 4), (before layers) + model.layers.0-3;" in text
    assert "stage 1: ranks 4-7 as mesh (1, 4), model.layers.4-7 + (after layers);" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    groups = layer_groups(plan)
    assert {g.stage for g in groups} == {0, 1}
    for k, st in enumerate(plan.stages):
        idle = plan.predicted_step_time - plan.micro_batches * st.time
        assert sum(g.bubble * g.count for g in groups if g.stage == k) == pytest.approx(idle)
    row = next(line for line in text.splitlines() if line.startswith("model.layers.1-3 "))
    assert row.split()[-5:] == ["-", "-", "-", "-", "-"]  # memory and MFU per layer: not recorded


def _collective_total(text: str) -> str:
    rows = text.split("\ncollective ")[1].splitlines()
    return next(r for r in rows if r.startswith("total ")).split()[-2:]


@pytest.mark.parametrize("name", NAMES)
def test_the_collectives_listed_add_up_to_the_communication_the_summary_states(name):
    plan = golden(name)
    text = plan.summary()
    listed = sum(c.time for c in plan.collective_records)
    stated = plan.time.communication + plan.time.resharding
    assert " ".join(_collective_total(text)) == fmt_time(stated)
    rest = stated - listed
    assert (f"made replicated (not itemised) {fmt_time(rest)}" in " ".join(text.split())) == (rest > 1e-9 * stated)


def test_a_pipelined_summary_names_its_communication_instead_of_no_collectives():
    plan = staged(deep(golden("llama"), 8), stages=2, micro_batches=4, schedule="1f1b")
    assert plan.time.communication > 0 and not plan.collective_records
    text = " ".join(plan.summary().split())
    assert "collectives: none" not in text
    assert f"collectives: {fmt_time(plan.time.communication)} per step" in text


def test_fold_numbered_folds_consecutive_numbers_in_natural_order():
    names = ["block.10.attn", "block.2.attn", "block.0.attn", "block.1.attn", "block.9.attn", "head",
             "block.4.mlp.0.weight", "block.3.mlp.0.weight"]
    assert fold_numbered(names) == ["block.0-2.attn", "block.3-4.mlp.0.weight", "block.9-10.attn", "head"]
    assert sorted(["h.10", "h.9", "h.1"], key=natural_key) == ["h.1", "h.9", "h.10"]


def test_the_sharding_map_groups_weights_as_the_summary_rows_in_natural_order():
    plan = deep(golden("llama"), 12)
    groups = sharding_map(plan)
    assert [g.title for g in groups] == [
        g.label + (f" (x{g.count})" if g.count > 1 else "") for g in layer_groups(plan) if g.weights]
    assert any(g.title == "model.layers.1-11 (x11)" for g in groups)
    for g in groups:
        names = [name for name, _ in g.rows]
        assert names == sorted(names, key=natural_key)
    listed = {name for g in groups for name, _ in g.rows}
    layer = next(g for g in layer_groups(plan) if g.label == "model.layers.1-11")
    assert set(layer.weights) <= listed  # every weight of a folded layer once, by its name in the layer
    # a model without layers: numbered modules placed alike fold, in natural order
    flat = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, layer=None) for n in plan.nodes))
    (before,) = [g for g in sharding_map(flat) if g.title == "(before layers)"]
    names = [name for name, _ in before.rows]
    assert "model.layers.0-11.mlp.down_proj.weight" in names and names == sorted(names, key=natural_key)


def test_phases_memory_parts_and_placements_have_colours_of_their_own():
    phases = set(PHASE_COLORS.values())
    memory = set(MEMORY_COLORS.values())
    placements = {placement_color(p) for p in ("R", "P(sum)", *(f"S({d})" for d in range(6)))}
    assert len(placements) == 8
    assert not (phases & memory) and not (phases & placements) and not (memory & placements)


def test_the_communication_drawn_has_the_legends_colour(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    plan = staged(deep(golden("llama"), 8), stages=2, micro_batches=4, schedule="1f1b")
    page = to_html(plan)
    comm = PHASE_COLORS["communication"]
    assert 'class="gantt-comm"' in page and "fill-opacity" not in page
    assert page.count(f'fill="{comm}"') == 1 + sum(1 for b in schedule_bars(plan) if b.communication > 0)
    rgb = (image.imread(plan.render(tmp_path / "p.png"))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    want = np.array([int(comm[k:k + 2], 16) for k in (1, 3, 5)])
    drawn = (rgb == want).all(axis=1).sum()
    span = sum(b.communication for b in schedule_bars(plan)) / plan.predicted_step_time
    assert drawn > 0.5 * span * (PNG_WIDTH - 120) * 0.6 * 45  # the bars' tails, not only the legend


@pytest.mark.parametrize("suffix", [".json", ".html", ".png"])
def test_plan_files_get_the_permissions_of_any_new_file(tmp_path, suffix):
    pytest.importorskip("matplotlib") if suffix == ".png" else None
    plan = golden("mlp")
    old = os.umask(0o022)
    try:
        path = tmp_path / f"plan{suffix}"
        plan.save(path) if suffix == ".json" else plan.render(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
        os.umask(0o077)
        plan.save(path) if suffix == ".json" else plan.render(path)  # replaced atomically, umask honoured
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir()] == [f"plan{suffix}"]  # no temporary file left


# ----------------------------------------------------------------------------- explain


def _mlp_graph(mesh=(4,)):
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(512, 2048), nn.Linear(2048, 512)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    with torch.device("meta"):
        model, x, y = MLP(), torch.randn(4096, 512), torch.randn(4096, 512)
    captured = capture_for_training(model, example_inputs=(x,), example_target=y,
                                    loss_fn=nn.functional.mse_loss)
    cluster = Cluster(mesh_shape=mesh, device="A100-80GB", intra_node_bandwidth=300e9)
    options = Options()
    cost_model = CostModel(cluster, options)
    graph = build_cost_graph(PlannedGraph.of(captured), cost_model)
    solved = solve_graph(graph, options, None, method="test")
    return graph, solved, build_plan(solved, captured, cluster, cost_model, options, name="test")


def test_recorded_alternatives_are_the_cost_graphs_one_node_switches():
    graph, solved, plan = _mlp_graph()
    base = evaluate(graph, solved.choice)
    checked = 0
    for i, node in enumerate(graph.nodes):
        if node.kind != "op" or node.size < 2:
            continue
        delta, own = switch_costs(graph, solved.choice, i,
                                  out_edges=[e for e in graph.edges if e.src == i],
                                  in_edges=[e for e in graph.edges if e.dst == i])
        choice = plan.node(node.name)
        assert own[solved.choice[i]] == pytest.approx(choice.communication_time, rel=1e-9, abs=1e-15)
        for s in range(node.size):
            switched = solved.choice.copy()
            switched[i] = s
            assert evaluate(graph, switched) - base == pytest.approx(delta[s], rel=1e-9, abs=1e-12)
        stored = [a.step_time_delta for a in choice.top_alternatives]
        others = sorted(delta[s] for s in range(node.size) if s != solved.choice[i])
        assert stored == pytest.approx(others[:3])
        checked += 1
    assert checked >= 3


def test_explain_a_module_lists_each_node_with_chosen_and_alternative_costs():
    plan = golden("llama")
    text = plan.explain("model.layers.1.mlp")
    assert "model.layers.1.mlp:" in text and "gate_proj.weight = " in text
    linears = [n for n in plan.nodes if n.module and n.module.startswith("model.layers.1.mlp.")
               and n.op == "aten.linear.default"]
    assert len(linears) == 3
    for n in linears:
        assert f"{n.node} = aten.linear.default in {n.module.rsplit('.', 1)[1]}: {n.alternatives} strategies" in text
        for a in n.top_alternatives:
            assert a.strategy in text
    one = plan.explain(linears[0].node, top=1)
    assert one.count("\n    [") == 1


def test_explain_unknown_target_suggests_close_names():
    with pytest.raises(PlanError, match="did you mean 'model.layers.1.mlp'"):
        golden("llama").explain("model.layer.1.mlp")


def test_explain_in_a_pipelined_plan_names_the_stage_mesh_and_lists_chosen_strategies():
    plan = staged(deep(golden("llama"), 8), stages=2, micro_batches=4, schedule="gpipe")
    text = plan.explain("model.layers.5.mlp")
    assert "pipeline stage 1 on mesh (1, 4)" in text and "down_proj.weight = " in text and "(stage 1)" in text
    node = next(n for n in plan.nodes if n.module == "model.layers.5.mlp.down_proj")
    assert f"{node.node} " in text and node.strategy in text


@pytest.fixture(scope="module")
def pipelined():
    """A GPT-2 planned with pipeline stages on a (2, 4) mesh: 2 stages of mesh (1, 4), 2
    micro-batches; the pipeline model and choice it was built from come with it."""
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=1024, heads=8, vocab=1024, seq=256, batch=2, device="meta")
    captured = capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})
    cluster = Cluster(mesh_shape=(2, 4), device="A100-80GB", intra_node_bandwidth=300e9, inter_node_bandwidth=25e9)
    pm = build_model(captured, cluster, Options())
    choice = search(pm)
    plan = build_pipeline_plan(pm, choice, name="pipelined", solve_time=0.0)
    assert len(plan.stages) == 2 and plan.micro_batches == 2 and {st.mesh_shape[1] for st in plan.stages} == {4}
    return pm, choice, plan


def test_latency_change_follows_the_pipeline_latency_formula():
    times, batches = [1.0, 3.0], 4  # latency (B - 1) * max + sum = 3 * 3 + 4 = 13
    assert latency_change(times, 0, batches)(0.5) == pytest.approx(0.5)  # stage 0 stays the faster
    assert latency_change(times, 0, batches)(2.5) == pytest.approx(3 * 3.5 + 6.5 - 13)  # now the slowest
    assert latency_change(times, 1, batches)(1.0) == pytest.approx(3 * 4 + 5 - 13)
    assert latency_change(times, 1, batches)(-1.0) == pytest.approx(3 * 2 + 3 - 13)


def test_a_pipelined_plan_records_each_stage_nodes_alternatives_as_the_window_graphs_switches(pipelined):
    pm, choice, plan = pipelined
    batches, times = choice.batches, choice.stage_times
    latency = (batches - 1) * max(times) + sum(times)
    index = {n.node: n for n in plan.nodes}
    checked = 0
    for k, (_, _, _, cfg) in enumerate(choice.stages):
        b = pm.microbatch(cfg.dp, batches)
        cm = MicroBatchCostModel(pm.tp_cluster(cfg.tp), pm.options, pieces=pm.batch // b, step_weight=1 / batches)
        graph = build_cost_graph(pm.info.planned(), cm, microbatch=pm.info)
        chosen = pm.candidates[cfg.tp][cfg.candidate].strategy_of()
        base_choice = np.array([n.strategies.index(chosen[n.name]) for n in graph.nodes])
        base = evaluate(graph, base_choice)
        for i, node in enumerate(graph.nodes):
            mine = [index[g] for g in pm.info.window.source.get(node.name, ()) if g in plan.stages[k].nodes]
            if node.kind != "op" or node.size < 2 or not mine:
                continue
            deltas = []
            for s in range(node.size):
                if s == base_choice[i]:
                    continue
                switched = base_choice.copy()
                switched[i] = s
                new = list(times)
                new[k] += evaluate(graph, switched) - base
                deltas.append((batches - 1) * max(new) + sum(new) - latency)
            for n in mine:
                assert n.alternatives == node.size
                assert [a.step_time_delta for a in n.top_alternatives] == pytest.approx(sorted(deltas)[:3], abs=1e-12)
                checked += 1
    assert checked > 20


def test_explain_a_pipelined_plans_node_shows_its_alternatives_on_the_stage_mesh(pipelined):
    plan = pipelined[2]
    text = plan.explain("transformer.h.3.mlp")
    assert "pipeline stage 1 on mesh (1, 4)" in text and "chosen" in text
    node = next(n for n in plan.nodes if n.module == "transformer.h.3.mlp.c_fc" and n.top_alternatives)
    assert f"{node.node} = {node.op} in c_fc: {node.alternatives} strategies" in text
    assert all(a.strategy in text for a in node.top_alternatives)
    assert all(a.strategy.count(",") == a.strategy.count("[") for a in node.top_alternatives)  # (dp, tp) each


def test_explain_says_why_a_stage_node_shows_no_alternatives():
    old = staged(deep(golden("llama"), 8), stages=2, micro_batches=4, schedule="gpipe")  # no split recorded
    assert "re-plan to see them" in old.explain("model.layers.5.mlp")
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=64, heads=4, seq=64, batch=16, device="meta")
    one_per_node = Cluster(mesh_shape=(4, 1), device="A100-80GB", intra_node_bandwidth=300e9,
                           inter_node_bandwidth=25e9)  # stages of mesh (dp, 1): nothing to choose on tp
    plan = compile(model, one_per_node, example_inputs={"input_ids": args[0], **kwargs},
                   options=Options(pipeline=True)).plan  # pipelined, even where one stage is as fast
    assert plan.stages and {st.mesh_shape[1] for st in plan.stages} == {1}
    text = " ".join(plan.explain("transformer.h.1.mlp").split())
    assert "with a single strategy on their stage's mesh" in text and "re-plan" not in text


def test_every_stage_records_its_memory_split_and_the_pictures_and_summary_show_it(pipelined, tmp_path):
    plan = pipelined[2]
    parts = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication")
    mem = stage_memory(plan)
    for st, bars in zip(plan.stages, mem):
        assert set(bars) == set(parts) and sum(bars.values()) == pytest.approx(st.memory)
        assert bars == {p: getattr(st.breakdown, p) for p in parts}
    worst = max(plan.stages, key=lambda st: st.memory)
    assert worst.breakdown == plan.memory
    text = plan.summary()
    for k, st in enumerate(plan.stages):
        line = " ".join(" ".join(text.split(f"stage {k}: ")[1].split("\n")[:3]).split())  # unwrapped
        assert f"peak {st.memory / 2**30:.2f} GiB = parameters {st.breakdown.parameters / 2**30:.2f}" in line
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan


def test_plans_saved_before_alternatives_were_recorded_still_load_summarise_and_explain():
    data = golden("mlp").to_dict()
    for n in data["nodes"]:
        for key in ("flops", "forward_compute_time", "activation_memory", "top_alternatives"):
            del n[key]
    del data["parameter_memory"]
    old = Plan.from_dict(data)
    assert "predicted step time" in old.summary()
    node = next(n for n in old.nodes if n.alternatives > 1)
    assert "re-plan to see" in old.explain(node.node)


def test_alternatives_survive_the_json_round_trip(tmp_path):
    plan = golden("gpt2")
    assert any(n.top_alternatives for n in plan.nodes)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan


# ----------------------------------------------------------------------------- render


class _Bars(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.bars, self.rows, self.external, self.groups = [], 0, [], []
        self._in_group = False

    def handle_data(self, data):
        if self._in_group:
            self.groups.append(data)
            self._in_group = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "shard-group" in (a.get("class") or "").split():
            self._in_group = True
        if "gantt-bar" in (a.get("class") or "").split():
            self.bars.append((int(a["data-stage"]), int(a["data-micro-batch"]), a["data-kind"]))
        if "shard-row" in (a.get("class") or "").split():
            self.rows += 1
        if tag in ("script", "link", "img", "iframe") or any(v and "://" in v and k in ("src", "href")
                                                             for k, v in attrs):
            self.external.append(tag)


@pytest.mark.parametrize("stages,micro,schedule", [(1, 1, None), (2, 4, "gpipe"), (4, 8, "1f1b")])
def test_html_has_one_forward_and_one_backward_bar_per_stage_and_micro_batch(tmp_path, stages, micro, schedule):
    if stages > 1 and Stage is None:
        pytest.skip("autopar.plan has no pipeline Stage yet")
    base = golden("llama")
    plan = base if stages == 1 else staged(deep(base, 8), stages=stages, micro_batches=micro, schedule=schedule)
    path = render(plan, tmp_path / "plan.html")
    parser = _Bars()
    parser.feed(open(path, encoding="utf-8").read())
    for kind in ("forward", "backward"):
        got = sorted((s, m) for s, m, k in parser.bars if k == kind)
        assert got == [(s, m) for s in range(stages) for m in range(micro)]
    assert parser.rows == sum(len(g.rows) for g in sharding_map(plan)) > 0
    assert parser.groups == [g.title for g in sharding_map(plan)]
    assert parser.external == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_bars_respect_dependencies_the_schedules_order_and_the_stage_times(schedule):
    S, B = 4, 6
    plan = staged(deep(golden("llama"), 8), stages=S, micro_batches=B, schedule=schedule)
    bars = {(b.stage, b.micro_batch, b.kind): b for b in schedule_bars(plan)}
    span = max(b.end for b in bars.values())
    assert span == pytest.approx(plan.predicted_step_time)
    for (s, m, kind), b in bars.items():
        assert b.end > b.start >= 0
        if kind == "forward" and s > 0:
            assert b.start >= bars[(s - 1, m, "forward")].end - 1e-12
        if kind == "backward":
            assert b.start >= bars[(s, m, "forward")].end - 1e-12
            if s < S - 1:
                assert b.start >= bars[(s + 1, m, "backward")].end - 1e-12
    for s in range(S):
        mine = sorted((b for b in bars.values() if b.stage == s), key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))  # one pass at a time
        in_flight, peak = 0, 0
        for b in mine:
            in_flight += 1 if b.kind == "forward" else -1
            peak = max(peak, in_flight)
        assert peak == plan.stages[s].in_flight
        busy = sum(b.end - b.start for b in mine)  # a stage works B x its time per micro-batch
        ratios = [sum(x.end - x.start for x in bars.values() if x.stage == k) / plan.stages[k].time
                  for k in range(S)]
        assert busy / plan.stages[s].time == pytest.approx(ratios[0], rel=1e-9)


def test_memory_bars_of_a_plan_saved_before_stages_recorded_their_split():
    plan = staged(deep(golden("llama"), 8), stages=4, micro_batches=4, schedule="1f1b")
    assert all(st.breakdown is None for st in plan.stages)
    mem = stage_memory(plan)
    assert mem[0] == {p: getattr(plan.memory, p) for p in ("parameters", "gradients", "optimizer", "activations",
                                                           "temporaries", "communication")}
    assert [m["total"] for m in mem[1:]] == [st.memory for st in plan.stages[1:]]


def test_a_single_stage_schedule_is_forward_then_backward_with_the_plans_own_seconds():
    plan = golden("gpt2")
    (f, b) = sorted(schedule_bars(plan), key=lambda x: x.start)
    assert (f.kind, b.kind) == ("forward", "backward")
    fwd_comm = sum(c.time for c in plan.collective_records if c.phase == "forward")
    assert f.end - f.start == pytest.approx(sum(n.forward_compute_time for n in plan.nodes) + fwd_comm, rel=1e-6)
    assert b.end == pytest.approx(plan.predicted_step_time)


def test_png_is_as_tall_as_its_sharding_map_needs_and_is_not_blank(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    small = image.imread(golden("mlp").render(tmp_path / "mlp.png"))
    assert small.shape[:2] == (MIN_HEIGHT, PNG_WIDTH)
    plan = golden("bert")
    pixels = image.imread(plan.render(tmp_path / "plan.png"))
    lines = sum(len(g.rows) + 1 for g in sharding_map(plan))
    assert pixels.shape[1] == PNG_WIDTH and pixels.shape[0] > MIN_HEIGHT
    assert pixels.shape[0] >= lines * ROW * DPI  # every map line drawn at full height
    rgb = pixels[..., :3].reshape(-1, 3)
    assert (rgb.std(axis=0) > 0.05).all()
    assert len(np.unique((rgb * 255).astype(np.uint8), axis=0)) > 20


def test_render_refuses_unknown_formats_and_explains_a_missing_matplotlib(tmp_path, monkeypatch):
    plan = golden("mlp")
    with pytest.raises(RenderError, match=r"\.html or \.png"):
        plan.render(tmp_path / "plan.pdf")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RenderError, match="pip install matplotlib"):
        plan.render(tmp_path / "plan.png")
    assert not list(tmp_path.iterdir())


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium here (/usr/bin/chromium absent)")
def test_html_screenshot_in_headless_chromium_is_not_blank(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    html_path = golden("llama").render(tmp_path / "plan.html")
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,1000", f"file://{html_path}"], check=True, timeout=60,
                   capture_output=True)
    rgb = image.imread(str(shot))[..., :3].reshape(-1, 3)
    assert (rgb.std(axis=0) > 0.05).all()


def test_html_is_self_contained_text():
    page = to_html(golden("gpt2"))
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<style>" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
