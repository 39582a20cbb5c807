"""The autopar command line: plan (zoo and file factories, progress, --out), show, diff (exit
status), explain, render, --help everywhere, and one-line errors with status 2; the quick-start
example runs."""

import dataclasses
import json
import os
import runpy
import sys

import pytest

from autopar.cli import main
from autopar.factory import FactoryError, build
from autopar.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def golden_path(name):
    return os.path.join(GOLDEN, f"{name}.json")


def test_plan_a_zoo_factory_names_its_positional_inputs_and_saves_the_plan(tmp_path, capsys):
    out = tmp_path / "gpt2.json"
    rc = main(["plan", "autopar.zoo:gpt2", "--arg", "layers=1", "--cluster", "dgx-a100", "--mesh", "2x4",
               "--no-profile", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0
    for phase in ("capturing the training graph", "captured in", "costing strategies on mesh (2, 4)",
                  "solving", "solved (optimal)", f"saved {out}"):
        assert phase in cap.err
    plan = Plan.load(out)
    assert plan.mesh_shape == (2, 4)
    assert set(plan.input_placements) == {"input_ids", "labels"}
    assert "predicted step time" in cap.out and "transformer.h.0" in cap.out


def test_plan_a_file_factory_with_a_loss_function(tmp_path, capsys):
    factory = tmp_path / "my_model.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n"
        "def make(width=64):\n"
        "    model = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))\n"
        "    return model, (torch.randn(32, width),), nn.functional.mse_loss, torch.randn(32, width)\n")
    out = tmp_path / "p.json"
    assert main(["plan", f"{factory}:make", "-a", "width=32", "--cluster", "local", "--nodes", "2",
                 "-q", "-o", str(out), "--baselines"]) == 0
    cap = capsys.readouterr()
    assert "predicted step time" not in cap.out  # --quiet: no summary, only the comparison
    plan = Plan.load(out)
    assert set(plan.parameter_placements) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    table = cap.out.split("baselines on the same cost model:\n")[1].splitlines()
    assert table[1].startswith("autopar ") and table[1].endswith(" 1.00x")
    assert [row.split()[0] for row in table[2:]] == ["data_parallel", "fsdp", "grid:"]
    for row in table[2:4]:  # on the same mesh these baselines restrict autopar's search: never faster
        assert float(row.split()[-1].rstrip("x")) >= 1.0


def test_show_explain_and_render_a_saved_plan(tmp_path, capsys):
    assert main(["show", golden_path("llama")]) == 0
    assert capsys.readouterr().out == Plan.load(golden_path("llama")).summary() + "\n"
    assert main(["explain", golden_path("llama"), "model.layers.0.self_attn", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model.layers.0.self_attn:") and "chosen" in out
    assert main(["render", golden_path("llama"), str(tmp_path / "p.html")]) == 0
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")


def test_diff_names_changed_shardings_and_cost_deltas_and_sets_the_exit_status(tmp_path, capsys):
    plan = Plan.load(golden_path("gpt2"))
    assert main(["diff", golden_path("gpt2"), golden_path("gpt2")]) == 0
    assert "no differences" in capsys.readouterr().out
    fqn = "transformer.h.0.attn.c_proj.weight"
    table = dict(plan.parameter_placements)
    table[fqn] = ("S(0)", "S(1)")
    t = plan.time
    changed = dataclasses.replace(plan, parameter_placements=table,
                                  time=dataclasses.replace(t, communication=t.communication * 1.5))
    changed.save(tmp_path / "b.json")
    assert main(["diff", golden_path("gpt2"), str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out
    assert f"{fqn}" in out and f"{','.join(plan.parameter_placements[fqn])} -> S(0),S(1)" in out
    assert "time.communication" in out and "(+50.0%)" in out and "step time" in out


@pytest.mark.parametrize("argv,message", [
    (["show", "/no/such/plan.json"], "no plan file at /no/such/plan.json"),
    (["plan", "no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
    (["plan", "autopar.zoo:nope"], "has no function 'nope'"),
    (["plan", "autopar.zoo:gpt2", "--mesh", "3x3"], "mesh (3, 3) has 9 devices"),
    (["plan", "autopar.zoo:gpt2", "--mesh", "2by8"], "--mesh must look like 2x8"),
    (["plan", "autopar.zoo:gpt2", "--arg", "nonsense"], "KEY=VALUE"),
    (["plan", "autopar.zoo:gpt2", "--cluster", "dgx-z9"], "unknown --cluster 'dgx-z9'"),
    (["plan", "autopar.zoo:mlp"], "return (model, example_inputs, loss_fn, example_target)"),
    (["explain", os.path.join(GOLDEN, "mlp.json"), "fc9"], "the plan has no module or node 'fc9'"),
    (["render", os.path.join(GOLDEN, "mlp.json"), "out.pdf"], "use a .html or .png file name"),
])
def test_user_errors_print_one_autopar_error_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(l for l in err.splitlines() if l.startswith("autopar: error: "))
    assert message in err and line


@pytest.mark.parametrize("command", ["plan", "show", "diff", "explain", "render", "demo", "profile"])
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert f"usage: autopar {command}" in capsys.readouterr().out


def test_factory_return_conventions():
    with pytest.raises(FactoryError, match=r"must return \(model, example_inputs\)"):
        build("builtins:list")
    spec = build("autopar.zoo:bert", {"layers": 1})
    assert set(spec.example_inputs) == {"input_ids", "labels"}


def test_the_console_script_points_at_main():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "autopar"]
    assert script.load() is main


def test_the_quick_start_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "qs.json"])
    runpy.run_path(os.path.join(ROOT, "examples", "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "predicted step time" in out and "saved qs.json" in out
    assert "transformer.h.0.mlp.c_fc:" in out  # the explain part
    mesh = json.loads((tmp_path / "qs.json").read_text())["mesh_shape"]
    assert mesh[0] * mesh[1] == 8  # one node's 8 GPUs, as whichever logical mesh plans fastest
