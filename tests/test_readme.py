"""README.md: its supported-ops table is the registry's, and its two commands are the ones CI runs."""

from pathlib import Path

from autopar.passes.rules.table import replace_in

ROOT = Path(__file__).resolve().parent.parent


def test_readme_ops_table_is_generated_from_the_registry():
    text = (ROOT / "README.md").read_text()
    assert replace_in(text) == text, "regenerate: python -m autopar.passes.rules.table --write README.md"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]" && autopar demo' in readme
