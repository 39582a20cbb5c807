"""The parameters on the host, fetched per layer (ZeRO-Infinity; :mod:`autopar.planner.fetched`,
:mod:`autopar.runtime.fetch`): the rewrite of a rank's program, the plan's price of it (host
bytes and link seconds against hand-made bounds), verify measuring device and host apart, and
training like one process on gloo ranks (where host and device are the same RAM, the copies are
still made, freed and sent back as on a GPU); the same spawn trains a plan whose recomputed
layers' checkpoints wait on the host (``test_runtime_checkpoints.py``).
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines, compile, zoo
from autopar.core.errors import CodegenError
from autopar.core.options import Options
from autopar.plan.assignment import assignment_of
from autopar.runtime.fetch import Fetcher, autopar_fetch, fetch_parameters
from autopar.runtime.program import DistributedProgram
from autopar.runtime.verify.report import PEAK_RTOL
from autopar.testing import run_programs
from models import ResidualStack, TiedBatchNorm
from one_process import adamw, check_sgd_and_adamw

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)
ONE = dataclasses.replace(A100, mesh_shape=(1,), devices_per_node=1)
LR = 0.01


def _net():
    torch.manual_seed(0)
    return ResidualStack(3, 6, head=5), torch.randn(8, 6), torch.randn(8, 5)


def _kw(x, y, options=None):
    return {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss, "options": options or Options()}


def test_each_layer_fetches_its_parameters_once_and_prefetches_the_next_layers():
    net, x, y = _net()
    cluster = Cluster.local(world_size=2)
    kw = _kw(x, y, Options(offload="parameters"))
    compiled = compile(net, cluster, plan=baselines.data_parallel(net, cluster, **kw), **kw)
    assert compiled.plan.offload and compiled.plan.offload_parameters and compiled.program.offload_parameters
    emitted = compiled.program.emit(0)
    placeholders = {n.name: n for n in emitted.graph.find_nodes(op="placeholder")}
    params = [n for n in placeholders if n.startswith("p_")]
    fetched = fetch_parameters(emitted, set(params), Fetcher(torch.device("cpu")))
    assert "autopar_fetch" not in emitted.code  # the emitted program is left as it was
    fetches = [n for n in fetched.graph.nodes if n.target is autopar_fetch]
    groups = [tuple(p.name for p in f.args[1]) for f in fetches]
    assert groups == [(f"p_blocks_{i}_fc_weight", f"p_blocks_{i}_fc_bias") for i in range(3)] + [
        ("p_head_weight", "p_head_bias")]
    for k, f in enumerate(fetches):  # the next group ahead, the previous behind, each in its layer
        assert tuple(p.name for p in f.kwargs["ahead"]) == (groups[k + 1] if k + 1 < len(groups) else ())
        assert tuple(p.name for p in f.kwargs["behind"]) == (groups[k - 1] if k else ())
        assert f.meta["autopar_layer"] == (f"blocks.{k}" if k < 3 else None)
    # every use of an offloaded parameter reads a fetched copy, none the host piece
    for p in params:
        assert all(u.target is autopar_fetch for u in fetched.graph.find_nodes(op="placeholder", target=p)[0].users)
    items = [n for n in fetched.graph.nodes if n.target is operator.getitem and n.args[0] in fetches]
    assert len(items) == len(params)
    with pytest.raises(CodegenError, match="ZeRO 0"):
        DistributedProgram(compiled.captured, assignment_of(compiled.plan, compiled.captured), model=net, zero=1,
                           offload_parameters=True)


def test_a_fetch_copies_and_the_gradient_goes_back_to_the_host_piece():
    host = torch.nn.Parameter(torch.randn(4, 3))
    fetcher = Fetcher(torch.device("cpu"))
    (copy,) = autopar_fetch(fetcher, (host,))
    assert torch.equal(copy, host) and copy.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    fetcher.prefetch((host,))
    (again,) = autopar_fetch(fetcher, (host,))  # taken from what was prefetched
    assert not fetcher._ahead and again.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    (copy * 2 + again).sum().backward()
    assert torch.equal(host.grad, torch.full((4, 3), 3.0))


@pytest.fixture(scope="module")
def llama():
    model, (args, kwargs) = zoo.llama(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=32000, seq=1024,
                                      batch=8, device="meta")
    return model, {"input_ids": args[0], **kwargs}


def _plan(llama, offload, **options):
    model, inputs = llama
    return compile(model, ONE, example_inputs=inputs, options=Options(offload=offload, **options))


def test_the_plan_keeps_no_parameter_on_the_device_and_prices_the_host_and_the_link(llama):
    off = _plan(llama, True, mixed_precision=True, recompute=False).plan
    fetching = _plan(llama, "parameters", mixed_precision=True, recompute=False).plan
    n = sum(p.numel() for p in llama[0].parameters())  # elements, each 2 bytes in bf16
    assert fetching.memory.parameters < 1024 and fetching.memory.gradients == 0 and fetching.memory.optimizer == 0
    # the host holds what the optimizer's offload holds and the program's bf16 parameters
    assert fetching.host_memory == pytest.approx(off.host_memory + 2 * n)
    link, rate = ONE.host_link_bandwidth, ONE.host_step_rate()
    # fetched twice and the gradients sent down: at most all of it paid, at least what compute cannot hide
    serial = 3 * 2 * n / link + n / rate
    assert serial - fetching.time.compute <= fetching.time.offload <= serial
    fast_host = dataclasses.replace(ONE, host=dataclasses.replace(ONE.host, link_bandwidth=1e15))
    fast = compile(llama[0], fast_host, example_inputs=llama[1],
                   options=Options(offload="parameters", mixed_precision=True, recompute=False)).plan
    assert fast.time.offload == pytest.approx(n / rate, rel=1e-3)  # a fast link leaves the CPU step


@pytest.mark.parametrize("options", [{"mixed_precision": True, "recompute": False}, {"recompute": True}],
                         ids=["mixed", "fp32-recompute"])
def test_verify_measures_a_fetching_plans_device_and_host_within_tolerance(llama, options):
    compiled = _plan(llama, "parameters", **options)
    plan = compiled.plan
    assert plan.offload_parameters and bool(plan.recompute) == options["recompute"]
    (rank,) = compiled.verify().ranks
    assert rank.measured.memory["parameters"] < 1024  # only the rotary buffer stays on the device
    assert rank.measured.host_peak == pytest.approx(plan.host_memory, rel=0.01)
    assert abs(rank.peak_ratio - 1) <= PEAK_RTOL, rank.peak_ratio
    assert not rank.problems(), rank.problems()


@pytest.mark.parametrize("options", [{"mixed_precision": True, "recompute": True}, {"recompute": False}],
                         ids=["mixed-recompute", "fp32"])
def test_verify_agrees_where_the_fetched_parameters_make_the_peak(options):
    model, (args, kwargs) = zoo.llama(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=32000, seq=32,
                                      batch=1, device="meta")
    compiled = compile(model, ONE, example_inputs={"input_ids": args[0], **kwargs},
                       options=Options(offload="parameters", **options))
    (rank,) = compiled.verify().ranks
    # 32 tokens: the pieces fetched and their gradients, not activations, hold most of the peak
    assert rank.measured.memory["temporaries"] > 0.9 * rank.measured.peak
    assert abs(rank.peak_ratio - 1) <= 0.01 and not rank.problems(), rank.problems()


def _fetching(net, cluster, kw, baseline, **bkw):
    plan = getattr(baselines, baseline)(net, cluster, **kw, **bkw)
    compiled = compile(net, cluster, plan=plan, **kw)
    assert compiled.plan.offload_parameters
    return compiled.program


@pytest.mark.slow
def test_fetched_parameters_and_offloaded_checkpoints_on_two_ranks_train_like_one_process():
    net, x, y = _net()
    cluster = Cluster.local(world_size=2)
    recomputing = baselines.data_parallel(net, cluster, **_kw(x, y, Options(recompute=True, offload=False)))
    checkpoints = compile(net, cluster, plan=dataclasses.replace(recomputing, offload_activations=True), **_kw(x, y))
    assert checkpoints.program.checkpoint_host is not None
    programs = {
        "dp-recompute-checkpoints-offloaded": checkpoints.program,
        "dp": _fetching(net, cluster, _kw(x, y, Options(offload="parameters")), "data_parallel"),
        "dp-recompute": _fetching(net, cluster, _kw(x, y, Options(offload="parameters", recompute=True)),
                                  "data_parallel"),
        "tp": _fetching(net, cluster, _kw(x, y, Options(offload="parameters")), "megatron", tp=2),
    }
    mixed = {"dp-mixed": _fetching(net, cluster, _kw(x, y, Options(offload="parameters", mixed_precision=True)),
                                   "data_parallel")}
    torch.manual_seed(0)
    tied, ids, labels = TiedBatchNorm(), torch.randint(0, 16, (8,)), torch.randint(0, 16, (8,))
    tkw = {"example_inputs": (ids, labels), "options": Options(offload="parameters")}
    tied_program = compile(tied, cluster, plan=baselines.data_parallel(tied, cluster, **tkw), **tkw).program
    entries = {name: (p, (x,), y) for name, p in {**programs, **mixed}.items()}
    results = run_programs({**entries, "tied": (tied_program, (ids, labels), None)}, optimizer=["sgd", adamw],
                           lr=LR, return_parameters=True)
    check_sgd_and_adamw({k: results[k] for k in programs}, net, inputs=(x,), target=y, loss_fn=F.mse_loss, lr=LR)
    check_sgd_and_adamw({k: results[k] for k in mixed}, net, inputs=(x,), target=y, loss_fn=F.mse_loss, lr=LR,
                        precision="mixed")
    check_sgd_and_adamw({"tied": results["tied"]}, tied, inputs=(ids, labels), target=None, loss_fn=None, lr=LR)
