"""A recomputing plan predicts what ``verify`` measures when its stages run recomputed: each
stage's FLOPs (the forward torch's checkpoint runs again, up to each layer's last saving op:
:mod:`autopar.core.recompute`) within 2 % and its peak memory within 10 %, on GPT-2 and LLaMA
shapes with tensor parallelism (meta device). Under tensor parallelism a layer's collectives sit
between its ops: each layer is still checkpointed as one region.

One-program plans recompute with ``Options(recompute=True)`` (``Plan.recompute``): a data-parallel
plan (ZeRO 0 and 1) predicts its FLOPs, its peak (each layer's inputs kept, its saved tensors made
again in backward) and its collectives as verify measures them, and saves and loads the choice;
so does issue 16's LLaMA-2-7B on 8 A100s in bf16 with recompute and ZeRO-1 (slow)."""

from collections import Counter

import pytest

from autopar import Cluster, Options, Plan, baselines, zoo
from autopar.compile import compile
from autopar.runtime.recompute import layer_runs
from autopar.runtime.verify.report import FLOPS_RTOL, PEAK_RTOL
from models import meta_gpt2, meta_llama

A100x2 = Cluster.preset("dgx-a100", nodes=2, use_profile=False)


CASES = {"gpt2 tp4 pp2 dp2": meta_gpt2, "llama tp4 pp2 dp2": meta_llama}


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def recomputing(request):
    model, inputs = request.param()
    plan = baselines.megatron(model, A100x2, example_inputs=inputs, options=Options(pipeline=True), tp=4, pp=2,
                              dp=2, micro_batches=4, recompute=True)
    assert [s.recompute for s in plan.stages] == [True, True]
    return plan, compile(model, A100x2, example_inputs=inputs, plan=plan)


@pytest.mark.parametrize("build", list(CASES.values()), ids=list(CASES))
def test_selectively_recomputing_stages_predict_the_flops_peak_and_collectives_verify_measures(build):
    model, inputs = build()
    plans = {rc: baselines.megatron(model, A100x2, example_inputs=inputs, options=Options(pipeline=True), tp=4, pp=2,
                                    dp=2, micro_batches=4, recompute=rc) for rc in (False, "selective")}
    plan = plans["selective"]
    assert [s.recompute for s in plan.stages] == ["selective", "selective"]
    for stage, plain in zip(plan.stages, plans[False].stages):  # the cheap runs again (no matmul FLOPs)
        assert plain.time < stage.time and stage.flops_per_device == plain.flops_per_device
    report = compile(model, A100x2, example_inputs=inputs, plan=plan).verify()
    for r in report.ranks:
        assert abs(r.flops_ratio - 1) <= FLOPS_RTOL and abs(r.peak_ratio - 1) <= PEAK_RTOL, r.to_dict()
        assert r.collective_diff() == (Counter(), Counter())


def test_each_layer_of_a_tensor_parallel_stage_is_one_recomputed_region(recomputing):
    plan, compiled = recomputing
    for stage in plan.stages:
        runs = layer_runs(compiled.program.emit(stage.ranks[0]))
        by_layer = {}
        for index, layer in runs.values():
            by_layer.setdefault(layer, set()).add(index)
        layers = {k for k in by_layer if k is not None}
        assert len(layers) == 2 and all(len(by_layer[k]) == 1 for k in layers), by_layer


def test_recomputing_stages_predict_the_flops_and_peak_verify_measures(recomputing):
    plan, compiled = recomputing
    report = compiled.verify()
    for r, stage in zip(report.ranks, plan.stages):
        print(f"\nstage {stage.index}: peak {r.predicted.peak / 2**20:.1f} / {r.measured.peak / 2**20:.1f} MiB"
              f" ({r.peak_ratio:.3f}), FLOPs ratio {r.flops_ratio:.4f}")
        assert abs(r.flops_ratio - 1) <= FLOPS_RTOL, r.to_dict()
        assert abs(r.peak_ratio - 1) <= PEAK_RTOL, r.to_dict()


def _gpt2_long():
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=256, heads=8, vocab=1024, seq=512, batch=32, device="meta")
    return model, {"input_ids": args[0], **kwargs}


ONE_PROGRAM = {  # name: (model, ZeRO stage); the first peaks in backward, the second at the optimizer step
    "gpt2 seq 512 data parallel": (_gpt2_long, 0),
    "llama data parallel zero 1": (meta_llama, 1),
}
A100x8 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)


def _verifies(compiled) -> None:
    """The one-program plan's peak, FLOPs and collectives are what verify measures."""
    r = compiled.verify().ranks[0]
    print(f"\npeak {r.predicted.peak / 2**30:.3f} / {r.measured.peak / 2**30:.3f} GiB ({r.peak_ratio:.3f}),"
          f" FLOPs {r.predicted.flops:.4g} / {r.measured.flops:.4g}")
    assert abs(r.flops_ratio - 1) <= FLOPS_RTOL, r.to_dict()
    assert abs(r.peak_ratio - 1) <= PEAK_RTOL, r.to_dict()
    assert r.collective_diff() == (Counter(), Counter())


@pytest.mark.parametrize("build, zero", list(ONE_PROGRAM.values()), ids=list(ONE_PROGRAM))
def test_a_recomputing_one_program_plan_predicts_what_verify_measures(build, zero, tmp_path):
    model, inputs = build()
    plan = baselines.data_parallel(model, A100x8, example_inputs=inputs, zero=zero, options=Options(recompute=True))
    plain = baselines.data_parallel(model, A100x8, example_inputs=inputs, zero=zero)
    assert plan.recompute and not plain.recompute and plan.predicted_peak_memory < plain.predicted_peak_memory
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").recompute
    _verifies(compile(model, A100x8, example_inputs=inputs, plan=plan))


@pytest.mark.slow  # about 30 s: LLaMA-2-7B's 32 layers captured, planned and run on fake tensors
def test_issue_16_llama2_7b_on_8_a100_bf16_recompute_zero1_verifies():
    """Issue 16's Done-when row (benchmarks/fidelity.py prints it): verify's peak, FLOPs and
    collectives of the plan a user asks for with ``data_parallel(zero=1)`` and
    ``Options(mixed_precision=True, recompute=True)``."""
    model, (args, kwargs) = zoo.llama(config=zoo.llama2_7b_config(), seq=4096, batch=32, device="meta")
    inputs = {"input_ids": args[0], **kwargs}
    plan = baselines.data_parallel(model, A100x8, example_inputs=inputs, zero=1,
                                   options=Options(mixed_precision=True, recompute=True))
    assert (plan.zero, plan.recompute, plan.precision) == (1, True, "mixed")
    _verifies(compile(model, A100x8, example_inputs=inputs, plan=plan))


def test_recomputing_with_sharded_parameters_holds_each_layers_gathered_weights_as_verify_measures():
    """ZeRO-3 under recomputation: a layer's forward run again in backward gathers all its
    weights, which its ops save until their backward (they were predicted gathered one op at a
    time: 0.87 of the measured peak); one program (FSDP) and 2 pipeline stages (tp 2, dp 4)."""
    model, inputs = meta_llama()
    fsdp = baselines.fsdp(model, A100x8, example_inputs=inputs, options=Options(recompute=True, pipeline=False))
    assert fsdp.recompute
    _verifies(compile(model, A100x8, example_inputs=inputs, plan=fsdp))
    staged = baselines.megatron(model, A100x2, example_inputs=inputs, options=Options(pipeline=True), tp=2, pp=2,
                                dp=4, micro_batches=4, zero=3, recompute=True)
    assert [(s.zero, s.recompute) for s in staged.stages] == [(3, True), (3, True)]
    for r in compile(model, A100x2, example_inputs=inputs, plan=staged).verify().ranks:
        assert abs(r.peak_ratio - 1) <= PEAK_RTOL and abs(r.flops_ratio - 1) <= FLOPS_RTOL, r.to_dict()


@pytest.mark.parametrize("build, make", [
    (_gpt2_long, lambda m, i, o: baselines.data_parallel(m, A100x8, example_inputs=i, options=o)),
    (meta_llama, lambda m, i, o: baselines.megatron(m, A100x8, example_inputs=i, options=o, tp=2)),
], ids=["gpt2 seq 512 data parallel", "llama tp2"])
def test_selective_recompute_keeps_less_than_none_more_than_full_as_verify_measures(build, make, tmp_path):
    """Selective recompute (:mod:`autopar.core.recompute`) keeps what matmuls and attention make
    and runs the cheap ops between them again: its peak lies between no and full recompute, so
    does its time, it runs no matmul FLOPs again (the FLOPs counted), and verify measures its
    peak, FLOPs and collectives as predicted."""
    model, inputs = build()
    plans = {mode: make(model, inputs, Options(recompute=mode, pipeline=False)) for mode in (False, "selective", True)}
    assert [p.recompute for p in plans.values()] == [False, "selective", True]
    peaks = [p.predicted_peak_memory for p in plans.values()]
    flops = [p.flops_per_device for p in plans.values()]
    times = [p.predicted_step_time for p in plans.values()]
    assert peaks[2] <= peaks[1] < peaks[0] and flops[0] == flops[1] < flops[2] and times[0] < times[1] < times[2]
    plans["selective"].save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").recompute == "selective"
    _verifies(compile(model, A100x8, example_inputs=inputs, plan=plans["selective"]))
