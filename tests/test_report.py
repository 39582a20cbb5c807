"""plan.summary(), plan.explain() and plan.render() on the golden plans (tests/golden) and on a
deep and a pipelined plan built from them: figures add up to the plan's totals, repeated layers
fold into one row, recorded alternatives are exactly the cost graph's one-node switches, the
HTML has one Gantt bar per stage x micro-batch and the PNG is a real picture."""

import html.parser
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from autopar import Cluster
from autopar.core.errors import PlanError
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.plan import Plan
from autopar.plan.render import (
    PNG_SIZE,
    RenderError,
    render,
    schedule_bars,
    sharding_rows,
    stage_memory,
    to_html,
)
from autopar.plan.report import layer_groups
from autopar.planner.alternatives import switch_costs
from autopar.planner.costgraph import PlannedGraph, build_cost_graph
from autopar.planner.costs import CostModel
from autopar.planner.intra import build_plan
from autopar.planner.solve import evaluate, solve_graph
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
        self.bars, self.rows, self.external = [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
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
    assert parser.rows == len(sharding_rows(plan)) > 0
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


def test_memory_bars_split_the_peak_stage_and_show_the_others_whole():
    plan = staged(deep(golden("llama"), 8), stages=4, micro_batches=4, schedule="1f1b")
    mem = stage_memory(plan)
    assert mem[0] == {p: getattr(plan.memory, p) for p in ("parameters", "gradients", "optimizer", "activations")}
    assert [m["total"] for m in mem[1:]] == [st.memory for st in plan.stages[1:]]


def test_a_single_stage_schedule_is_forward_then_backward_with_the_plans_own_seconds():
    plan = golden("gpt2")
    (f, b) = sorted(schedule_bars(plan), key=lambda x: x.start)
    assert (f.kind, b.kind) == ("forward", "backward")
    fwd_comm = sum(c.time for c in plan.collective_records if c.phase == "forward")
    assert f.end - f.start == pytest.approx(sum(n.forward_compute_time for n in plan.nodes) + fwd_comm, rel=1e-6)
    assert b.end == pytest.approx(plan.predicted_step_time)


def test_png_has_the_expected_size_and_is_not_blank(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    path = golden("bert").render(tmp_path / "plan.png")
    pixels = image.imread(path)
    assert pixels.shape[:2] == (PNG_SIZE[1], PNG_SIZE[0])
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
