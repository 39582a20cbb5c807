"""examples/train_torchrun.py under real torchrun (2 gloo ranks) trains with a saved plan and
its losses equal the unmodified model trained in one process (AdamW: against float64 within
fp32's measured noise, :mod:`one_process`, widened by the 6 decimals the example prints)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.runtime.launch import free_port

pytestmark = pytest.mark.slow  # rank processes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_torchrun.py"


def test_torchrun_training_with_a_saved_plan_matches_one_process(tmp_path):
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_torchrun
    finally:
        sys.path.pop(0)
    from one_process import one_process

    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--plan-only", str(plan)], check=True,
                   capture_output=True, cwd=tmp_path)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(EXAMPLE), str(plan)],
                         check=True, capture_output=True, text=True, cwd=tmp_path, timeout=300).stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out)]
    model, example = train_torchrun.build()
    ref = one_process(model, inputs=example, steps=train_torchrun.STEPS, optimizer="adamw", lr=1e-3)
    assert len(losses) == train_torchrun.STEPS
    ref.check(losses, loss_resolution=5e-7)  # the example prints 6 decimals
