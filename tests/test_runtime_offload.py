"""The optimizer offloaded to the host (ZeRO-Offload; :mod:`autopar.planner.offload`,
:class:`autopar.runtime.mixed.MasterWeights` on the host): the cluster's host, the plan's price of
it (host bytes and seconds, by hand), the planner choosing it only where nothing fits without it,
verify measuring the device and the host apart, and the runtime training like one process.

On CPU ranks the host is the ranks' own RAM: the masters are separate copies, each gradient is
moved into them and each updated master copied back, as on a GPU; the slow tests train that on 2
gloo ranks (data parallel at ZeRO 0, 1 and 2, SGD and AdamW; one run in bf16 mixed precision, one
with clipping) for 3 steps against one process.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, Plan, baselines, compile, zoo
from autopar.core.errors import ClusterError, InfeasibleError, PlanError
from autopar.core.options import Options, OptionsError
from autopar.cost_models.host import ADAM_HOST_BYTES, HOSTS, STREAM_EFFICIENCY, Host
from autopar.passes.capture.training import capture_for_training
from autopar.planner.intra import plan_intra
from autopar.runtime.verify.fake import fake_world
from autopar.runtime.verify.report import PEAK_RTOL
from autopar.testing import run_programs
from models import ResidualStack
from one_process import adamw, check_sgd_and_adamw
from resumed import straight_and_resumed

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)
LR = 0.01


def test_presets_describe_their_host_and_a_cluster_round_trips_with_it():
    a100 = Cluster.preset("dgx-a100", use_profile=False)
    assert a100.host == HOSTS["dgx-a100"] and a100.host_memory_per_device == 2e12 / 8
    assert a100.host_step_rate() == pytest.approx(409.6e9 * STREAM_EFFICIENCY / ADAM_HOST_BYTES / 8)
    assert a100.host_link_bandwidth == pytest.approx(0.8 * 31.5e9 / 2)
    gh = Cluster.preset("gh200", nodes=4, use_profile=False)
    assert gh.mesh_shape == (4,) and gh.device_spec.name == "GH200-96GB" and gh.host_link_bandwidth == 450e9
    assert Cluster.from_dict(gh.to_dict()) == gh
    assert "host: 447 GiB per node" in gh.describe()
    with pytest.raises(ClusterError, match="Host.memory must be a positive number"):
        Host(memory=0, link_bandwidth=1e9, memory_bandwidth=1e9)
    bare = Cluster(mesh_shape=(8,), device="A100-80GB")
    assert bare.host is None and bare.host_memory_per_device == 0.0
    with pytest.raises(ClusterError, match="no host described"):
        bare.host_step_rate()


@pytest.fixture(scope="module")
def llama():
    model, (args, kwargs) = zoo.llama(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=32000, seq=1024,
                                      batch=8, device="meta")
    return model, {"input_ids": args[0], **kwargs}


@pytest.fixture(scope="module")
def plans(llama):
    model, inputs = llama
    return {(z, off): baselines.data_parallel(model, A100, example_inputs=inputs, zero=z, options=Options(offload=off))
            for z in (0, 2) for off in (False, True)}


def test_an_offloaded_plan_prices_the_host_copies_and_the_step_by_hand(plans):
    kept, off = plans[(0, False)], plans[(0, True)]
    n = sum(p for p, _, _ in kept.parameter_memory.values()) / 4  # fp32 parameters, whole on every rank
    # the host holds master, gradient, two Adam moments and the step's scratch, fp32 each
    assert off.offload and off.host_memory == pytest.approx(n * 4 * 5)
    assert off.memory.optimizer == 0 and off.memory.parameters == kept.memory.parameters
    seconds = n * 2 * 4 / A100.host_link_bandwidth + n / A100.host_step_rate()
    assert off.time.offload == pytest.approx(seconds)
    assert off.predicted_step_time == pytest.approx(kept.predicted_step_time + seconds)
    assert off.collective_records == kept.collective_records  # the same gradient all-reduces
    z2 = plans[(2, True)]  # ZeRO-2: each rank steps a chunk of 1/8 and no gradient stays on the device
    assert z2.host_memory == pytest.approx(n / 8 * 4 * 5, rel=1e-4) and z2.memory.gradients == 0


@pytest.mark.parametrize("key", [(0, True), (2, True)])
def test_verify_measures_an_offloaded_plans_device_and_host_apart(llama, plans, key):
    model, inputs = llama
    (rank,) = compile(model, A100, example_inputs=inputs, plan=plans[key]).verify().ranks
    assert rank.measured.host_peak == pytest.approx(plans[key].host_memory, rel=0.01)
    # nothing of the optimizer on the device but AdamW's step counts (fp32 scalars, CPU tensors in torch)
    assert rank.measured.memory["optimizer"] <= 4 * len(plans[key].parameter_memory)
    assert abs(rank.peak_ratio - 1) <= PEAK_RTOL, rank.peak_ratio
    assert not rank.problems(), rank.problems()


def test_a_plan_round_trips_its_offload_and_refuses_one_it_cannot_hold(plans, tmp_path):
    plans[(2, True)].save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plans[(2, True)]
    with pytest.raises(PlanError, match="whose host is described"):
        dataclasses.replace(plans[(0, True)], cluster=dataclasses.replace(A100, host=None))


def test_the_planner_offloads_only_where_nothing_fits_on_the_devices(llama, plans):
    model, inputs = llama
    captured = capture_for_training(model, example_inputs=inputs)
    one = dataclasses.replace(A100, mesh_shape=(1,), devices_per_node=1)
    kept = plan_intra(captured, one, Options(memory_fraction=1.0))
    assert not kept.offload  # it fits: nothing moves
    moved = plan_intra(captured, one, Options(memory_fraction=1.0, offload=True))
    # room for the parameters, gradients and activations but not the optimizer's state
    limit = (moved.predicted_peak_memory + kept.predicted_peak_memory) / 2
    tight = dataclasses.replace(one, device_memory=limit)
    # both offloads fit; the parameters' fetches hide behind compute where the optimizer's moves at
    # the step do not, so fetching them is faster here, and the reason names the other
    plan = plan_intra(captured, tight, Options(memory_fraction=1.0, recompute=False))
    assert plan.offload_parameters and plan.predicted_peak_memory <= limit and plan.memory.parameters < 1024
    optimizer_only = plan_intra(captured, tight, Options(memory_fraction=1.0, recompute=False, offload=True))
    assert not optimizer_only.offload_parameters and optimizer_only.memory.optimizer == 0
    assert kept.predicted_step_time < plan.predicted_step_time < optimizer_only.predicted_step_time
    (why,) = [w for w in plan.why if w.startswith("parameters offloaded:")]
    assert re.search(fr"no plan fits the devices' {limit / 2**30:.2f} GiB without it "
                     r"\((the closest came to|none came under) [0-9.]+ GiB\)", why)
    assert why.endswith(f"; optimizer offloaded instead: {optimizer_only.predicted_step_time * 1e3:.1f} ms")
    assert why.split(": ", 1)[1] in " ".join(plan.summary().split())  # wrapped there
    # allowed to recompute, the search weighs both savers and keeps the faster, naming the other
    either = plan_intra(captured, tight, Options(memory_fraction=1.0))
    assert either.recompute and not either.offload and either.predicted_peak_memory <= limit
    assert either.predicted_step_time < plan.predicted_step_time
    (why,) = [w for w in either.why if "recompute:" in w]
    # the optimizer's offload is cut before its solve: its host and link seconds alone lose to the recompute
    assert "; optimizer offloaded instead: slower" in why
    assert optimizer_only.predicted_step_time > either.predicted_step_time
    assert f"; parameters offloaded instead: {plan.predicted_step_time * 1e3:.1f} ms" in why
    with pytest.raises(InfeasibleError, match="fit"):
        plan_intra(captured, tight, Options(memory_fraction=1.0, offload=False, recompute=False))
    with pytest.raises(OptionsError, match="pipelined plans do not offload"):
        Options(offload=True, pipeline=True)
    with pytest.raises(ClusterError, match="needs the cluster's host"):
        plan_intra(captured, dataclasses.replace(tight, host=None), Options(offload=True))
    small_host = dataclasses.replace(tight, host=dataclasses.replace(A100.host, memory=plan.host_memory / 2))
    with pytest.raises(InfeasibleError, match=r"devices would hold .* but the host would need .* GiB per device"):
        plan_intra(captured, small_host, Options(memory_fraction=1.0, recompute=False))


def _net():
    torch.manual_seed(0)
    return ResidualStack(3, 6, head=5), torch.randn(8, 6), torch.randn(8, 5)


def _offloaded(net, x, y, *, zero: int, mixed: bool = False):
    cluster, options = Cluster.local(world_size=2), Options(mixed_precision=mixed, offload=True)
    kw = {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss, "options": options}
    compiled = compile(net, cluster, plan=baselines.data_parallel(net, cluster, zero=zero, **kw), **kw)
    assert compiled.plan.offload and compiled.program.offload
    return compiled.program


def test_an_offloaded_program_steps_host_copies_never_its_own_parameters():
    net, x, y = _net()
    program = _offloaded(net, x, y, zero=0)
    with fake_world(0, 2):
        stepped, own = list(program.parameters()), list(program.module().parameters())
        assert len(stepped) == len(own) and all(s.device == program.host for s in stepped)
        assert not {id(s) for s in stepped} & {id(p) for p in own}
        assert all(torch.equal(s, p) for s, p in zip(stepped, own))
        program.reset()


def _check(results, net, x, y, **kw):
    check_sgd_and_adamw(results, net, inputs=(x,), target=y, loss_fn=F.mse_loss, lr=LR, **kw)


@pytest.mark.slow
def test_offloaded_zero_0_1_and_2_on_two_ranks_train_like_one_process():
    net, x, y = _net()
    programs = {f"offload-zero{z}": _offloaded(net, x, y, zero=z) for z in (0, 1, 2)}
    _check(run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True),
           net, x, y)


@pytest.mark.slow
def test_offloaded_mixed_precision_and_clipping_train_like_one_process():
    net, x, y = _net()
    mixed = {"offload-mixed": _offloaded(net, x, y, zero=1, mixed=True)}
    results = run_programs(mixed, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True)
    for losses, params in results["offload-mixed"]:
        assert {t.dtype for t in params.values()} == {torch.float32}  # the fp32 masters, gathered
    _check(results, net, x, y, precision="mixed")
    training = {"accumulate": 2, "max_norm": 0.05}
    clipped = {"offload-clip": _offloaded(net, x, y, zero=0)}
    _check(run_programs(clipped, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True,
                        **training), net, x, y, **training)


def test_the_summary_says_why_the_plan_offloads_and_what_it_costs(plans):
    text = plans[(2, True)].summary()
    assert "+ offload " in text and "optimizer offloaded to the host (ZeRO-Offload)" in text
    assert "no plan fits the devices without it" not in text  # this one was asked for
    assert "asked for (Options(offload=True))" in text and "ZeRO-2:" in text
    assert "offload" not in plans[(0, False)].summary()


def test_an_offloaded_checkpoint_holds_the_host_masters_and_their_state_and_resumes_exactly(one_rank, tmp_path):
    net, x, y = _net()
    cluster, options = Cluster.local(world_size=1), Options(offload=True)
    compiled = compile(net, cluster, example_inputs=(x,), example_target=y, loss_fn=F.mse_loss, options=options)
    assert compiled.plan.offload
    straight, resumed = straight_and_resumed(compiled, (x,), y, tmp_path / "ckpt", lr=LR)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
