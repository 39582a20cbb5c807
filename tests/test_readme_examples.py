"""Every code block of README.md runs as written and shows what the README says it shows, so that
no example can rot.

Each block runs in a fresh folder where the repository's ``examples/`` is reachable:

- a Python block as a user pastes it into ``python``: ``python -c`` in a subprocess, whose main
  module has no file, as in the interactive interpreter (rank processes then do not re-run it);
  a block that defines ``test_`` functions is saved as a test file and run by pytest twice, first
  writing its golden files (``AUTOPAR_UPDATE_GOLDEN=1``), then checking against them;
- a shell block line by line, ``&&`` parts in order: ``autopar ...`` through
  :func:`autopar.cli.main`, what the ``autopar`` console script runs, in this process; any other
  command in bash. Each must exit 0, except the ones :data:`EXIT_STATUS` names.

Two commands are left out, on purpose: ``pip install`` (this environment was made by it;
``.ci/run`` installs from scratch) and ``python -m pytest`` (the suite this test is part of; CI
runs it). Blocks that start rank processes (``run_distributed``, ``autopar demo``) are marked
slow; the others plan big models on fake tensors in the fast tier. :data:`CHECKS` says what each
block must show beyond running.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN = {"pip install": "set-up: this environment was installed by it (.ci/run does it from scratch)",
           "python -m pytest": "the test suite this test belongs to (CI runs it)"}
EXIT_STATUS = {"autopar diff": 1}  # the README: "exit 1 if any" difference, and its two plans differ
SLOW = ("run_distributed", "autopar demo")


def readme_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced block of ``text``."""
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block, ``&&`` parts split, comments dropped."""
    out = []
    for line in code.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split("&&")]
    return out


def _not_run(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


def _params():
    out = []
    for line, lang, code in readme_blocks((ROOT / "README.md").read_text()):
        marks = [pytest.mark.slow] if any(s in code for s in SLOW) else []
        out.append(pytest.param(lang, code, id=f"README.md:{line}-{lang}", marks=marks))
    return out


@pytest.fixture
def folder(tmp_path, monkeypatch):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _python(code: str, folder: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"the README's Python block failed:\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _pytest(code: str, folder: Path) -> None:
    (folder / "test_readme_block.py").write_text(code)
    for update in ("1", "0"):  # write the golden files, then check against them
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_readme_block.py"],
                              cwd=folder, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "AUTOPAR_UPDATE_GOLDEN": update})
        assert done.returncode == 0, f"pytest on the README's test block failed:\n{done.stdout}\n{done.stderr}"


def _shell(code: str, capsys) -> dict[str, str]:
    """Run the block's commands; their output (stdout) by command."""
    outputs = {}
    for command in shell_commands(code):
        if _not_run(command):
            continue
        if command.startswith("autopar "):
            status = main(shlex.split(command)[1:])
            out = capsys.readouterr().out
        else:
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900)
            status, out = done.returncode, done.stdout
        want = next((s for prefix, s in EXIT_STATUS.items() if command.startswith(prefix)), 0)
        assert status == want, f"`{command}` exited {status}, not {want}:\n{out}\n{capsys.readouterr().err}"
        outputs[command] = out
    return outputs


# ----------------------------------------------------------------------------- what each block shows


def _command(outputs: dict, prefix: str) -> str:
    return next(out for command, out in outputs.items() if command.startswith(prefix))


def _realistic(plan: Plan) -> None:
    """A plan of a model worth planning: memory and utilisation far from zero."""
    assert plan.predicted_peak_memory > 2**29 and plan.mfu > 0.1, plan.summary()


def _shows_alternatives(text: str) -> None:
    assert "chosen" in text and re.search(r"^    \[.*\s[+-][\d.]+[mu]?s\s", text, re.M), text
    assert "single strategy" not in text


def check_cli(outputs: dict, folder: Path) -> None:
    plan = Plan.load(folder / "plan.json")
    _realistic(plan)
    _shows_alternatives(_command(outputs, "autopar explain"))
    assert _command(outputs, "autopar show") == plan.summary() + "\n"
    assert "changed" in _command(outputs, "autopar diff")
    assert (folder / "plan.html").read_text().startswith("<!DOCTYPE html>")
    baselines = _command(outputs, "autopar plan examples/custom_model.py").split("baselines on the same cost model:")
    assert len(baselines) == 2 and "data_parallel" in baselines[1]


def check_plans(out: str, folder: Path) -> None:
    plan = Plan.load(folder / "plan.json")
    _realistic(plan)
    assert plan.summary() in out
    _shows_alternatives(out.split(plan.summary(), 1)[1])
    assert (folder / "plan.html").read_text().startswith("<!DOCTYPE html>")


def check_tour(out: str, folder: Path) -> None:
    assert "predicted step time" in out  # the summary
    assert re.search(r"= autopar_\w*(all_reduce|all_gather|reduce_scatter|all_to_all)\(", out)  # rank 0's code
    distributed, reference = (ast.literal_eval("[" + part.strip("[] \n") + "]")
                              for part in out.strip().splitlines()[-1].split("] ["))
    assert distributed == pytest.approx(reference, rel=1e-5)


def check_golden(folder: Path) -> None:
    assert Plan.load(folder / "golden" / "gpt2.json").name == "autopar"


def check_demo(outputs: dict, folder: Path) -> None:
    assert "MATCH" in _command(outputs, "autopar demo")
    assert (folder / "autopar-demo" / "plan.png").stat().st_size > 0


# a block's distinctive text -> its check
CHECKS = {
    "autopar plan autopar.zoo:gpt2_small": check_cli,
    "autopar demo": check_demo,
    "print(plan.explain(": check_plans,
    "run_distributed": check_tour,
    "assert_plan_matches": check_golden,
}


@pytest.mark.parametrize("lang,code", _params())
def test_readme_block_runs_and_shows_what_it_says(lang, code, folder, capsys):
    checks = [check for key, check in CHECKS.items() if key in code]
    if lang == "python" and re.search(r"^def test_", code, re.M):
        _pytest(code, folder)
        result = None
    elif lang == "python":
        result = _python(code, folder)
    elif lang == "bash":
        commands = shell_commands(code)
        if all(_not_run(c) for c in commands):
            pytest.skip("; ".join(sorted({_not_run(c) for c in commands})))
        result = _shell(code, capsys)
    else:
        pytest.fail(f"the README has a ```{lang} block this test cannot run: use python or bash")
    for check in checks:
        check(folder) if result is None else check(result, folder)


def test_every_readme_block_is_run_or_left_out_for_a_stated_reason():
    blocks = readme_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 6 and {lang for _, lang, _ in blocks} == {"python", "bash"}
    left_out = [c for _, lang, code in blocks if lang == "bash" for c in shell_commands(code) if _not_run(c)]
    assert sorted(left_out) == ['pip install -e ".[dev]"', "pip install torch==2.13.0", "python -m pytest -q"]
    for key in CHECKS:  # every check still finds its block
        assert any(key in code for _, _, code in blocks), key
