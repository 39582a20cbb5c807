"""The step-time floor (:mod:`autopar.planner.time_floor`): no plan is faster, and compile skips a
routed-experts dispatch whose floor is over the other dispatch's plan; the second searched is cut
at the first's plan."""

from __future__ import annotations

import importlib

import pytest
import torch

from autopar import Cluster, baselines, zoo
from autopar.compile import compile, dense_floor, search_plan
from autopar.core.options import Options
from autopar.passes.capture.moe import dense_work, routed_experts
from autopar.passes.capture.training import capture_for_training
from autopar.plan.records import parameter_counts
from autopar.planner.time_floor import step_time_floor

NODE = Cluster.preset("dgx-a100", nodes=1)


@pytest.fixture(scope="module")
def gpt():
    """GPT-2 of 2 layers of hidden 1024 on 16 x 1024 tokens, bf16, on meta: compute-bound on A100s."""
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=1024, heads=16, vocab=8192, seq=1024, batch=16,
                                     dtype=torch.bfloat16, device="meta")
    inputs = {"input_ids": args[0], **kwargs}
    return model, inputs, capture_for_training(model, example_inputs=inputs)


def test_no_plan_steps_faster_than_the_floor(gpt):
    model, inputs, captured = gpt
    floor = step_time_floor(captured, NODE, Options())
    plans = [search_plan(captured, NODE, Options()), search_plan(captured, NODE, Options(pipeline=True)),
             baselines.data_parallel(model, NODE, example_inputs=inputs),
             baselines.fsdp(model, NODE, example_inputs=inputs),
             baselines.megatron(model, NODE, example_inputs=inputs, tp=8),
             baselines.megatron(model, NODE, example_inputs=inputs, tp=2, pp=2, dp=2)]
    times = [p.predicted_step_time for p in plans]
    assert all(floor <= t for t in times), (floor, times)
    assert floor > 0.25 * min(times)  # at these sizes the matmuls are most of a step


def test_the_floor_spreads_over_the_devices(gpt):
    _, _, captured = gpt
    one, two = (step_time_floor(captured, Cluster.preset("dgx-a100", nodes=n), Options()) for n in (1, 2))
    assert two == pytest.approx(one / 2)


@pytest.fixture(scope="module")
def mixtral():
    """Mixtral of 2 layers of hidden 1024 (16 experts, top 2) on 16 x 1024 tokens, bf16, on meta."""
    return _mixtral(batch=16, seq=1024)


def _mixtral(*, batch: int, seq: int):
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build, config_of

    arch = next(a for a in architectures() if a.class_name == "MixtralForCausalLM")
    config = config_of(arch, "full")
    sizes = {"num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 3584, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 8192, "num_local_experts": 16}
    for key, value in sizes.items():
        setattr(config, key, value)
    model, inputs = build(arch, size="full", batch=batch, seq=seq, device="meta", config=config)
    return model.to(torch.bfloat16), inputs


@pytest.fixture(scope="module")
def dispatch_plans(mixtral):
    """compile's plan of ``mixtral`` with each expert dispatch on its own."""
    model, inputs = mixtral
    return {d: compile(model, NODE, example_inputs=inputs, options=Options(moe_dispatch=d)).plan
            for d in ("dense", "sorted")}


@pytest.mark.parametrize("capacity_factor", [None, 1.25, 0.25])
def test_the_dense_floor_from_the_sorted_capture_bounds_the_dense_capture_floor(mixtral, capacity_factor):
    """The floor compile takes for the dense dispatch before capturing it is no higher than the
    dense capture's own, and over the sorted capture's where the dense dispatch pads the experts
    (not where its capacity is under the routed rows)."""
    model, inputs = mixtral
    options = {d: Options(moe_dispatch=d, moe_capacity_factor=capacity_factor) for d in ("dense", "sorted")}
    captured = {d: capture_for_training(model, example_inputs=inputs, **options[d].moe_capture()) for d in options}
    bound = dense_floor(model, captured["sorted"], NODE, options["dense"])
    dense, sorted_ = (step_time_floor(captured[d], NODE, options[d]) for d in ("dense", "sorted"))
    assert bound <= dense
    if capacity_factor == 0.25:  # slots for a quarter of the routed rows: the dense dispatch may do less
        assert bound < sorted_
    else:
        assert bound > sorted_
    if capacity_factor is None:  # E/k = 8 on the experts' matmuls; the dense dispatch's einsums are the rest
        assert bound > 0.8 * dense


def test_dense_work_factors():
    """E/k for each routed experts module, capped by a capacity factor; 0 where the top-k is unknown."""
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build

    arch = next(a for a in architectures() if a.class_name == "MixtralForCausalLM")
    model, _ = build(arch, size="tiny", batch=1, seq=8, device="meta")
    experts = [p for p, m in model.named_modules() if m in routed_experts(model)]
    ratio = model.config.num_local_experts / model.config.num_experts_per_tok
    assert dense_work(model) == {p: ratio for p in experts} and len(experts) == model.config.num_hidden_layers
    assert dense_work(model, capacity_factor=0.5) == {p: min(ratio, 0.5) for p in experts}
    object.__setattr__(model.config, "num_experts_per_tok", None)  # past the config's type check
    assert dense_work(model) == {p: 0.0 for p in experts}


def test_compile_does_not_search_a_dispatch_that_cannot_win(mixtral, dispatch_plans, capfd, monkeypatch):
    """Mixtral's shapes on meta: the dense dispatch pads its experts 8x (E/k = 16/2), so its FLOPs
    alone take longer than the sorted experts' plan; compile keeps that plan without capturing or
    searching dense, and searching dense on its own finds a slower plan, as the floor said.
    Capture on meta logs no failing fake kernel (transformers' histc on int32 in the sorted experts)."""
    model, inputs = mixtral
    dispatches = []

    def counted(*args, moe_dispatch, **kwargs):
        dispatches.append(moe_dispatch)
        return capture_for_training(*args, moe_dispatch=moe_dispatch, **kwargs)

    monkeypatch.setattr(importlib.import_module("autopar.compile"), "capture_for_training", counted)  # not the function
    auto = compile(model, NODE, example_inputs=inputs)
    assert dispatches == ["sorted"]
    assert "sorted experts won; dense: not searched, its FLOPs alone take at least " in auto.plan.name
    floor_ms = float(auto.plan.name.rsplit("at least ", 1)[1].split(" ms")[0])
    assert auto.plan.predicted_step_time * 1e3 < floor_ms <= dispatch_plans["dense"].predicted_step_time * 1e3
    assert "failed while attempting to run meta" not in capfd.readouterr().err


def test_compile_captures_one_dispatch_where_the_parameters_alone_fit_no_plan(mixtral, monkeypatch):
    """Mixtral's shapes (374 M parameters, 8 bytes each with gradient and AdamW state in bf16: 357
    MiB a device) on 8 devices of 256 MiB and no host to offload to: no plan of either dispatch
    fits, since both hold the same parameters (their floors are equal, and so are their counts and
    the module's), so compile captures the sorted dispatch only and raises that search's "no plan
    fits" (its smallest peak: with no host, the error a capture tells)."""
    from autopar.core.errors import InfeasibleError
    from autopar.plan.records import module_parameter_counts
    from autopar.planner.misses import fits_no_saver, unfit_floor, unplannable

    model, inputs = mixtral
    small = Cluster(mesh_shape=(1, 8), device="A100-80GB", device_memory=256 * 2**20, devices_per_node=8)
    options = {d: Options(moe_dispatch=d) for d in ("dense", "sorted")}
    captured = {d: capture_for_training(model, example_inputs=inputs, **options[d].moe_capture()) for d in options}
    counts = {d: parameter_counts(captured[d]) for d in options}
    assert sorted(module_parameter_counts(model)) == sorted(counts["dense"]) == sorted(counts["sorted"])
    floors = {d: unfit_floor(counts[d], small, options[d], offload=False) for d in options}
    assert floors["dense"] == floors["sorted"] > small.memory_per_device
    assert fits_no_saver(counts["sorted"], small, options["sorted"])
    assert not unplannable(counts["sorted"], small, options["sorted"])  # no host: the search's peak is worth having
    assert not fits_no_saver(counts["sorted"], NODE, options["sorted"])
    dispatches = []

    def counted(*args, moe_dispatch, **kwargs):
        dispatches.append(moe_dispatch)
        return capture_for_training(*args, moe_dispatch=moe_dispatch, **kwargs)

    monkeypatch.setattr(importlib.import_module("autopar.compile"), "capture_for_training", counted)
    with pytest.raises(InfeasibleError, match="no plan fits") as refused:
        compile(model, small, example_inputs=inputs)
    assert dispatches == ["sorted"] and refused.value.smallest_peak > small.memory_per_device
    with pytest.raises(InfeasibleError, match="no plan fits"):  # the dense dispatch on its own: the same answer
        compile(model, small, example_inputs=inputs, options=Options(moe_dispatch="dense"))


def test_a_search_given_a_time_to_beat_returns_its_plan_only_where_faster(gpt, monkeypatch):
    """``search_plan(beat=...)``: the plan searched without it where that is faster than ``beat``
    (the same strategies), None where it is not; and where ``beat`` is under the FLOPs' floor,
    None without a single cost graph or solve."""
    import autopar.planner.intra as intra

    _, _, captured = gpt
    plan = search_plan(captured, NODE, Options())
    again = search_plan(captured, NODE, Options(), beat=plan.predicted_step_time * 1.001)
    assert again.predicted_step_time == plan.predicted_step_time
    assert [(n.inputs, n.outputs) for n in again.nodes] == [(n.inputs, n.outputs) for n in plan.nodes]
    assert search_plan(captured, NODE, Options(), beat=plan.predicted_step_time) is None
    floor = step_time_floor(captured, NODE, Options())
    monkeypatch.setattr(intra, "_costed", lambda *a, **k: pytest.fail("costed"))
    assert search_plan(captured, NODE, Options(pipeline=False), beat=floor * 0.99) is None


@pytest.mark.parametrize("first", ["dense", "sorted"])
def test_the_dispatch_searched_second_is_cut_at_the_first_ones_plan(mixtral, dispatch_plans, monkeypatch, first):
    """With the floors that skip a dispatch out of the way (0 for ``first``, 1e-9 s for the other),
    compile searches both, the second only for plans faster than the first's; its plan is the
    faster of the two dispatches searched on their own, and its name says what the other found."""
    compile_module = importlib.import_module("autopar.compile")  # not the function
    model, inputs = mixtral
    monkeypatch.setattr(compile_module, "step_time_floor",
                        lambda c, cl, o, **k: 0.0 if o.moe_dispatch == first else 1e-9)
    monkeypatch.setattr(compile_module, "dense_floor", lambda *a, **k: 0.0 if first == "dense" else 1e-9)
    beats = []
    searched = compile_module.search_plan
    monkeypatch.setattr(compile_module, "search_plan",
                        lambda *a, beat=None, **k: beats.append(beat) or searched(*a, beat=beat, **k))
    auto = compile(model, NODE, example_inputs=inputs)
    alone = dispatch_plans
    second = "sorted" if first == "dense" else "dense"
    assert beats[0] is None and beats[1] == pytest.approx(alone[first].predicted_step_time)
    assert auto.plan.predicted_step_time == min(p.predicted_step_time for p in alone.values())
    won = min(alone, key=lambda d: alone[d].predicted_step_time)
    assert f"{won} experts won" in auto.plan.name
    if won == first:  # the second search's tries were cut at the first's plan
        assert f"{second}: no plan under {alone[first].predicted_step_time * 1e3:.1f} ms" in auto.plan.name


def test_no_pipeline_search_where_the_parameters_with_their_states_fit_no_device(monkeypatch):
    """On devices a little too small for the parameters with their gradients and Adam's state (the
    floor before any cost graph, :func:`~autopar.planner.misses.unfit_floor`) but with a host to
    offload to, the one-stage search offloads and the pipeline search, whose stages hold their
    states, is not run; run on its own, it finds no plan either."""
    import dataclasses

    from autopar.core.errors import InfeasibleError
    from autopar.planner.inter import plan_inter
    from autopar.planner.misses import unfit_floor

    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=1024, heads=16, vocab=8192, seq=32, batch=8,
                                     dtype=torch.bfloat16, device="meta")  # few activations
    captured = capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})
    counts = parameter_counts(captured)
    states = unfit_floor(counts, dataclasses.replace(NODE, device_memory=1.0), Options(), offload=False)
    small = dataclasses.replace(NODE, device_memory=states)  # under the states at any memory fraction below 1
    assert unfit_floor(counts, small, Options(), offload=False) == states
    compile_module = importlib.import_module("autopar.compile")
    ran = []
    monkeypatch.setattr(compile_module, "plan_inter", lambda *a, **k: ran.append(a) or plan_inter(*a, **k))
    plan = search_plan(captured, small, Options())
    assert plan.offload and not ran and "pipeline search: no plan fits" in plan.name
    with pytest.raises(InfeasibleError, match="no pipeline"):
        plan_inter(captured, small, Options())


def test_where_every_plan_offloads_the_dispatch_floors_hold_the_hosts_step():
    """On devices too small for Mixtral's parameters with their states (8 x 128 tokens: few
    activations; the node's host), every plan of either dispatch offloads its optimizer, so the
    floors compile orders and skips the dispatches by hold the host's step as well: no plan of
    either, searched on its own, is under its floor; compile keeps the faster."""
    import dataclasses

    from autopar.planner.misses import unfit_floor
    from autopar.planner.offload import host_step_floor

    model, inputs = _mixtral(batch=8, seq=128)
    options = {d: Options(moe_dispatch=d) for d in ("dense", "sorted")}
    captured = capture_for_training(model, example_inputs=inputs, **options["sorted"].moe_capture())
    counts = parameter_counts(captured)
    states = unfit_floor(counts, dataclasses.replace(NODE, device_memory=1.0), options["sorted"], offload=False)
    small = dataclasses.replace(NODE, device_memory=states)
    host = host_step_floor(captured, small, options["sorted"].optimizer)
    assert host > 0
    floors = {"dense": dense_floor(model, captured, small, options["dense"]) + host,
              "sorted": step_time_floor(captured, small, options["sorted"]) + host}
    alone = {d: compile(model, small, example_inputs=inputs, options=options[d]).plan for d in options}
    assert all(alone[d].offload and floors[d] <= alone[d].predicted_step_time for d in options), (floors, alone)
    auto = compile(model, small, example_inputs=inputs)
    assert auto.plan.predicted_step_time == min(p.predicted_step_time for p in alone.values())
