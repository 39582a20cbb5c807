"""Golden plans: the example models re-planned on dgx-a100 (1 x 8) match tests/golden/*.json;
a changed sharding fails with a diff naming the parameter, a cost regression beyond the
tolerance fails, an improvement within it passes; --autopar-update-golden rewrites atomically.

Regenerate after an intended planner change: pytest tests/test_regression.py --autopar-update-golden
"""

import dataclasses
import json
import os
import re
import warnings

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, zoo
from autopar.compile import compile
from autopar.core.errors import PlanError
from autopar.plan import Plan
from autopar.regression import UPDATE_ENV, GoldenStaleWarning, PlanMismatch, assert_plan_matches, diff_plans
from plan_builders import deep, staged

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

# Two layers at realistic widths on the meta device: the shardings are worth checking, capture
# and solving stay fast.
MODELS = {
    "mlp": lambda: zoo.mlp(inp=1024, hidden=4096, out=1024, batch=8192, device="meta"),
    "gpt2": lambda: zoo.gpt2(layers=2, hidden=1024, heads=16, vocab=8192, seq=512, batch=8, device="meta"),
    "llama": lambda: zoo.llama(layers=2, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=8192, seq=512,
                               batch=8, device="meta"),
    "bert": lambda: zoo.bert(layers=2, hidden=1024, heads=16, ffn=4096, vocab=8192, seq=512, batch=8,
                             device="meta"),
}



@pytest.fixture(autouse=True)
def _update_only_when_replanning(request, monkeypatch):
    # --autopar-update-golden must rewrite goldens from fresh plans only, never from the
    # deliberately perturbed plans the other tests feed to assert_plan_matches.
    if not request.node.name.startswith("test_replanning"):
        monkeypatch.delenv(UPDATE_ENV, raising=False)


def plan_model(name: str) -> Plan:
    """The plan tests/golden/<name>.json holds, made afresh."""
    model, (args, kwargs) = MODELS[name]()
    cluster = Cluster.preset("dgx-a100", nodes=1, use_profile=False)  # datasheet constants only
    if name == "mlp":
        target = torch.empty(8192, 1024, device="meta")
        return compile(model, cluster, example_inputs=args, loss_fn=F.mse_loss, example_target=target).plan
    return compile(model, cluster, example_inputs={"input_ids": args[0], **kwargs}).plan


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replanning_the_example_model_matches_its_golden_plan(name):
    assert_plan_matches(plan_model(name), f"golden/{name}.json", cost_rtol=0.02)


def _golden(name) -> Plan:
    return Plan.load(os.path.join(GOLDEN, f"{name}.json"))


def _with_placement(plan, fqn, placements):
    table = dict(plan.parameter_placements)
    table[fqn] = placements
    return dataclasses.replace(plan, parameter_placements=table)


def test_a_changed_parameter_sharding_fails_with_a_diff_naming_the_parameter(tmp_path):
    plan = _golden("gpt2")
    fqn = "transformer.h.1.mlp.c_fc.weight"
    old = plan.parameter_placements[fqn]
    new = ("R", "S(0)") if old != ("R", "S(0)") else ("R", "R")
    with pytest.raises(PlanMismatch) as err:
        assert_plan_matches(_with_placement(plan, fqn, new), os.path.join(GOLDEN, "gpt2.json"))
    text = str(err.value)
    assert "shardings changed" in text
    assert f"{fqn}" in text and f"{','.join(old)} -> {','.join(new)}" in text
    assert "--autopar-update-golden" in text


def test_a_changed_node_strategy_fails_and_names_the_node():
    plan = _golden("llama")
    k, node = next((k, n) for k, n in enumerate(plan.nodes) if n.top_alternatives)
    alt = node.top_alternatives[0]
    nodes = list(plan.nodes)
    nodes[k] = dataclasses.replace(node, inputs=alt.inputs, outputs=alt.outputs)
    with pytest.raises(PlanMismatch, match=f"strategy changed for 1 node.*\n  {node.node} "):
        assert_plan_matches(dataclasses.replace(plan, nodes=tuple(nodes)), os.path.join(GOLDEN, "llama.json"))


def _scaled(plan, factor):
    t = plan.time
    return dataclasses.replace(plan, time=dataclasses.replace(t, compute=t.compute * factor))


def test_a_step_time_regression_beyond_the_tolerance_fails_with_the_moved_fields():
    plan = _golden("bert")
    slower = _scaled(plan, 1.05)  # compute is most of the step: > 2 % slower overall
    assert slower.predicted_step_time > plan.predicted_step_time * 1.02
    with pytest.raises(PlanMismatch) as err:
        assert_plan_matches(slower, os.path.join(GOLDEN, "bert.json"), cost_rtol=0.02)
    text = str(err.value)
    assert "step time regressed by more than 2.0%" in text
    assert "time.compute" in text and "(+5.0%)" in text
    assert "shardings changed" not in text


def test_a_regression_within_the_tolerance_and_any_small_improvement_pass():
    plan = _golden("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_plan_matches(_scaled(plan, 1.005), os.path.join(GOLDEN, "bert.json"), cost_rtol=0.02)
        assert_plan_matches(_scaled(plan, 0.99), os.path.join(GOLDEN, "bert.json"), cost_rtol=0.02)


def test_a_large_improvement_passes_but_warns_that_the_golden_file_is_stale():
    with pytest.warns(GoldenStaleWarning, match="step time"):
        assert_plan_matches(_scaled(_golden("bert"), 0.5), os.path.join(GOLDEN, "bert.json"))


def test_peak_memory_regression_fails():
    plan = _golden("mlp")
    m = plan.memory
    bigger = dataclasses.replace(plan, memory=dataclasses.replace(m, activations=m.activations + 0.1 * m.total))
    with pytest.raises(PlanMismatch, match="peak memory regressed"):
        assert_plan_matches(bigger, os.path.join(GOLDEN, "mlp.json"))


def test_update_mode_rewrites_a_mismatching_golden_file_atomically_and_keeps_a_matching_one(tmp_path):
    plan = _golden("mlp")
    path = tmp_path / "sub" / "g.json"
    with pytest.raises(PlanMismatch, match="no golden plan"):
        assert_plan_matches(plan, path)
    assert_plan_matches(plan, path, update=True)  # created
    assert Plan.load(path) == plan
    before = os.stat(path).st_mtime_ns
    assert_plan_matches(plan, path, update=True)  # matching: left alone
    assert os.stat(path).st_mtime_ns == before
    fqn = next(iter(plan.parameter_placements))
    changed = _with_placement(plan, fqn, ("S(0)",) * len(plan.mesh_shape))
    assert_plan_matches(changed, path, update=True)
    assert Plan.load(path).parameter_placements[fqn] == ("S(0)",) * len(plan.mesh_shape)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["g.json"]  # no temporary left behind


def test_update_mode_rewrites_a_golden_file_of_an_older_schema(tmp_path):
    path = tmp_path / "old.json"
    data = _golden("mlp").to_dict()
    data["schema_version"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="older autopar"):
        assert_plan_matches(_golden("mlp"), path)
    assert_plan_matches(_golden("mlp"), path, update=True)
    assert Plan.load(path) == _golden("mlp")


def test_the_environment_variable_turns_on_update_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_UPDATE_GOLDEN", "1")
    assert_plan_matches(_golden("mlp"), tmp_path / "new.json")
    assert json.loads((tmp_path / "new.json").read_text())["name"] == _golden("mlp").name


def test_relative_golden_paths_are_taken_from_the_calling_file():
    assert_plan_matches(_golden("gpt2"), "golden/gpt2.json")


def test_diff_of_a_plan_with_itself_is_empty_and_lists_every_cost_field():
    plan = _golden("llama")
    d = diff_plans(plan, plan)
    assert not d.sharding_changed and d.regressions(0.0) == []
    assert d.text() == "no differences"
    assert set(d.costs) >= {"step time", "peak memory", "time.communication", "memory.optimizer", "mfu"}


def test_pipelined_plans_diff_by_stage_placements_and_stage_layout(tmp_path):
    base = staged(deep(_golden("llama"), 8), stages=2, micro_batches=4, schedule="1f1b")
    base.save(tmp_path / "pipe.json")
    st = base.stages[1]
    fqn = "model.layers.5.mlp.down_proj.weight"
    moved = dict(st.parameter_placements)
    moved[fqn] = ("R", "S(0)") if moved[fqn] != ("R", "S(0)") else ("R", "R")
    changed = dataclasses.replace(base, stages=(base.stages[0], dataclasses.replace(st, parameter_placements=moved)))
    with pytest.raises(PlanMismatch, match=f"s1 param +{re.escape(fqn)} +{re.escape(','.join(st.parameter_placements[fqn]))} -> "):
        assert_plan_matches(changed, tmp_path / "pipe.json")
    assert_plan_matches(Plan.load(tmp_path / "pipe.json"), tmp_path / "pipe.json")  # itself: passes
    four = staged(deep(_golden("llama"), 8), stages=4, micro_batches=4, schedule="1f1b")
    text = diff_plans(base, four).text()
    assert "pipeline changed:" in text and "- 2 stage(s), 4 micro-batch(es), schedule 1f1b" in text
    assert "+ stage 3: ranks=(6, 7)" in text
