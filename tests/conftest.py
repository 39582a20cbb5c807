"""Shared pytest set-up: ``--autopar-update-golden`` rewrites golden plan files instead of
failing on a mismatch (see autopar.regression); rule tests run torch on one thread; a test that
starts processes must be marked ``slow`` (``pytest -m "not slow"`` is the fast tier)."""

import multiprocessing.process
import os

import pytest
import torch
import torch.distributed as dist

from autopar.regression import UPDATE_ENV


def pytest_addoption(parser):
    parser.addoption("--autopar-update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json plans that are missing or no longer match")


def pytest_configure(config):
    if config.getoption("--autopar-update-golden"):
        os.environ[UPDATE_ENV] = "1"


@pytest.fixture(autouse=True, scope="module")
def _one_thread_for_rule_checks(request):
    # The rule checker runs thousands of tiny ops: on a shared 2-core machine intra-op threads
    # only add contention (5-10x slower), so rule tests use one.
    if not request.module.__name__.rsplit(".", 1)[-1].startswith("test_rules_"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request, monkeypatch):
    """Starting a process (rank spawns, pools) in a test not marked ``slow`` fails it at once, so
    the fast tier stays fast. (Processes started by module-scoped fixtures are set up before
    this runs: their modules are marked slow as a whole.)"""
    if request.node.get_closest_marker("slow") is None:
        def refuse(self):
            raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process (no process is started)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def memo_capture():
    """Capture each model once for every planner call of a module: ``autopar.compile`` and the
    baselines each call ``capture_for_training``, which is deterministic. A call is the same capture
    when it passes the same model, example inputs, target and loss (the same objects) and the same
    precision."""
    import importlib

    import autopar.baselines

    compile_module = importlib.import_module("autopar.compile")  # autopar.compile is also the function
    original = compile_module.capture_for_training
    seen = {}

    def capture_once(model, *, example_inputs=None, example_target=None, loss_fn=None, **kw):
        key = (id(model), id(example_inputs), id(example_target), id(loss_fn), tuple(sorted(kw.items())))
        if key not in seen:  # the objects are kept, so their ids stay theirs
            seen[key] = ((model, example_inputs, example_target, loss_fn),
                         original(model, example_inputs=example_inputs, example_target=example_target,
                                  loss_fn=loss_fn, **kw))
        return seen[key][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compile_module, "capture_for_training", capture_once)
        mp.setattr(autopar.baselines, "capture_for_training", capture_once)
        yield
