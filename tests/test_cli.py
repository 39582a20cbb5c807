"""The autopar command line: plan (zoo and file factories, progress, --out), show, diff (exit
status), explain, render, --help everywhere, and one-line errors with status 2; a closed pipe
ends it quietly, a missing factory lists the factories there, capture keeps third-party noise
(not the user's warnings) off the terminal; the quick-start example runs."""

import dataclasses
import io
import json
import logging
import os
import runpy
import subprocess
import sys

import pytest
from torch import nn
from transformers.utils import logging as hf_logging

from autopar import zoo
from autopar.cli import SIGPIPE_STATUS, main
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
    assert set(plan.input_placements) == {"input", "target"}  # nn.Sequential.forward(input), not args_0
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


def test_a_closed_pipe_ends_the_output_quietly_in_process(monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["explain", golden_path("llama"), "model"]) == SIGPIPE_STATUS == 141
    assert capsys.readouterr().err == ""


def test_autopar_piped_into_head_prints_one_line_and_no_error():
    autopar = os.path.join(os.path.dirname(sys.executable), "autopar")
    assert len(Plan.load(golden_path("llama")).explain("model")) > 2**16  # more than a pipe holds
    done = subprocess.run(["bash", "-c", f"{autopar} explain {golden_path('llama')} model | head -1;"
                           " exit ${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("model: ") and done.stdout.count("\n") == 1
    assert done.stderr == "" and done.returncode in (0, SIGPIPE_STATUS)


def test_a_missing_factory_lists_the_factories_there_and_only_those(capsys):
    assert main(["plan", "autopar.zoo:gpt3"]) == 2
    err = capsys.readouterr().err
    assert "has no function 'gpt3' (did you mean 'gpt2'?)" in err
    listed = err.split("factories there: ")[1].strip().split(", ")

    def builds_a_model(name):
        try:
            return isinstance(build(f"autopar.zoo:{name}", {"device": "meta"}).model, nn.Module)
        except FactoryError:  # a class, an exception, a config function
            return False

    assert listed == sorted(name for name in zoo.__all__ if builds_a_model(name))  # all of them, nothing else
    assert {"vit", "resnet"} <= set(listed) and not {"MLP", "ZooError", "llama2_70b_config"} & set(listed)


def test_capture_drops_transformers_loss_type_noise_but_not_the_users_own_warnings(tmp_path, capsys):
    factory = tmp_path / "hf_gpt2.py"
    factory.write_text(
        "import warnings\nimport torch\nfrom transformers import GPT2Config, GPT2LMHeadModel\n"
        "def make():\n"
        "    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=8, use_cache=False,\n"
        "                     bos_token_id=0, eos_token_id=0)\n"
        "    model = GPT2LMHeadModel(cfg)\n"
        "    model.register_forward_pre_hook(lambda m, a: warnings.warn('the user warns in forward'))\n"
        "    ids = torch.randint(0, 64, (2, 8))\n"
        "    return model, {'input_ids': ids, 'labels': ids.clone()}\n")
    hf_logging.get_logger("transformers")  # transformers' Logger.warning_once: once per message and process
    logging.Logger.warning_once.cache_clear()
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    hf = logging.getLogger("transformers")
    hf.addHandler(handler)
    try:
        with pytest.warns(UserWarning, match="the user warns in forward"):
            assert main(["plan", f"{factory}:make", "--cluster", "local", "--nodes", "2", "-q"]) == 0
    finally:
        hf.removeHandler(handler)
    assert not [r for r in seen if "loss_type" in r.getMessage()]
    assert "loss_type" not in capsys.readouterr().err
    spec = build(f"{factory}:make")
    logging.Logger.warning_once.cache_clear()
    hf.addHandler(handler)
    try:
        with pytest.warns(UserWarning):
            spec.model(**spec.example_inputs)  # outside capture transformers does print it
    finally:
        hf.removeHandler(handler)
    assert [r for r in seen if "loss_type" in r.getMessage()]


@pytest.mark.slow  # plans full-size models (on fake tensors)
@pytest.mark.parametrize("script,argv,shows", [
    ("llama70b_2x8_h100.py", ["--png"], "saved llama70b_plan.json and llama70b_plan.html and llama70b_plan.png"),
    ("custom_model.py", [], "blocks.1.mlp:"),
])
def test_the_examples_the_readme_names_run(tmp_path, monkeypatch, capsys, script, argv, shows):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    runpy.run_path(os.path.join(ROOT, "examples", script), run_name="__main__")
    out = capsys.readouterr().out
    assert "predicted step time" in out and shows in out
    assert any(p.suffix == ".html" for p in tmp_path.iterdir())


def test_plan_offloads_the_optimizer_when_asked_and_says_so(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "autopar.zoo:gpt2", "--arg", "layers=1", "--cluster", "gh200", "--nodes", "2",
                 "--no-profile", "--offload", "yes", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    plan = Plan.load(out)
    assert plan.offload and plan.mesh_shape == (2,) and plan.cluster.device_spec.name == "GH200-96GB"
    assert "optimizer offloaded to the host (ZeRO-Offload)" in cap.out and "asked for" in cap.out
