"""passes/ and cost_models/ install as autopar.passes and autopar.cost_models, both from this
editable checkout and from a built wheel."""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import autopar, autopar.passes.rules, autopar.cost_models.compute, autopar.planner.intra,"
         " autopar.solver, autopar.runtime.program, autopar.passes.codegen;"
         "print(autopar.passes.__file__); print(autopar.cost_models.__file__)")


def test_editable_install_maps_passes_and_cost_models_under_autopar():
    import autopar.cost_models
    import autopar.passes

    assert Path(autopar.passes.__file__).resolve() == ROOT / "passes" / "__init__.py"
    assert Path(autopar.cost_models.__file__).resolve() == ROOT / "cost_models" / "__init__.py"


def test_wheel_contains_and_imports_autopar_passes_and_cost_models(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("autopar-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for path in ("autopar/passes/__init__.py", "autopar/passes/rules/registry.py",
                 "autopar/cost_models/compute.py", "autopar/passes/codegen/__init__.py"):
        assert path in names
    assert not any(n.startswith(("passes/", "cost_models/")) for n in names)  # nothing generic at top level
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site processing, so the editable install's path hook (.pth) stays out; torch and
    # the other dependencies come from site-packages on the path, after the wheel's files.
    deps = sysconfig.get_paths()["purelib"]
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], env={"PYTHONPATH": f"{site}:{deps}", "PATH": "/usr/bin:/bin"},
                         cwd=tmp_path, check=True, capture_output=True, text=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in out), out
