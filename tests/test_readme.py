"""README.md: its generated sections (ops table, ring vs parameter server) are up to date, and its two
commands are the ones CI runs."""

from pathlib import Path

import pytest

from autopar.core.errors import AutoparError
from autopar.readme import regenerate, ring_vs_parameter_server

ROOT = Path(__file__).resolve().parent.parent


def test_readme_generated_sections_are_up_to_date():
    text = (ROOT / "README.md").read_text()
    assert regenerate(text) == text, "regenerate: python -m autopar.readme --write README.md"
    with pytest.raises(AutoparError, match="markers"):
        regenerate("no markers here")


def test_ring_all_reduce_stays_flat_while_a_parameter_server_grows_with_workers():
    rows = [line.split("|")[1:-1] for line in ring_vs_parameter_server().splitlines()[2:]]
    seconds = [[float(cell.strip().removesuffix(" s")) for cell in row[1:]] for row in rows]
    ring = [r[0] for r in seconds]
    one_server = [r[1] for r in seconds]
    assert max(ring) < 2 * 1e9 / (25e9 / 8) * 1.05          # near 2 S / B however many workers
    assert one_server[-1] / one_server[0] > 50               # 1 server: linear in workers
    assert all(r[0] < r[1] for r in seconds[1:])             # ring wins from 4 workers on


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]" && autopar demo' in readme
