"""A search's misses (:mod:`autopar.planner.misses`): a try whose peak floor is over the limit
builds its least-memory plan only when its error is reported, and the search reports what it
would have reported building every one."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re

import pytest

from autopar import Cluster, Options, zoo
from autopar.core.errors import InfeasibleError
from autopar.passes.capture.training import capture_for_training
from autopar.plan.records import parameter_counts
from autopar.planner import intra
from autopar.planner.misses import (Unbuilt, choices_floor, closest_miss, host_floor, least_known_peak, peak_floor,
                                    unfit_floor, unplannable)

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)


@pytest.fixture(scope="module")
def captured():
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=128, heads=4, vocab=512, seq=256, batch=16, device="meta")
    return capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})


def _search(captured, cluster, monkeypatch, *, floors: bool):
    """plan_intra_best_mesh's plan or error, with the floors on, or off (every miss built)."""
    with monkeypatch.context() as m:
        if not floors:
            m.setattr(intra, "peak_floor", lambda *a, **k: float("-inf"))
            m.setattr(intra, "choices_floor", lambda *a, **k: float("-inf"))
            m.setattr(intra, "unfit_floor", lambda *a, **k: None)
        try:
            return intra.plan_intra_best_mesh(captured, cluster, Options(memory_fraction=1.0))
        except InfeasibleError as exc:
            return exc


def test_a_search_that_fits_nothing_reports_the_miss_that_building_every_one_reports(captured, monkeypatch):
    built = []
    original = intra._least_memory_plan
    monkeypatch.setattr(intra, "_least_memory_plan", lambda *a: built.append(a) or original(*a))
    cluster = dataclasses.replace(A100, device_memory=2**20)  # 1 MiB: no plan fits
    eager = _search(captured, cluster, monkeypatch, floors=False)
    every = len(built)
    lazy = _search(captured, cluster, monkeypatch, floors=True)
    assert isinstance(eager, InfeasibleError) and not isinstance(eager, Unbuilt)
    assert type(lazy) is type(eager) and str(lazy) == str(eager) and lazy.smallest_peak == eager.smallest_peak
    assert 0 < len(built) - every < every  # the lazy search built some least-memory plans, not all


def test_a_saver_taken_says_how_close_the_misses_came_without_building_one(captured, monkeypatch):
    limit = _search(captured, dataclasses.replace(A100, device_memory=2**20), monkeypatch, floors=True).smallest_peak
    cluster = dataclasses.replace(A100, device_memory=limit * 1.001)  # fits only with a saver or ZeRO
    eager = _search(captured, cluster, monkeypatch, floors=False)
    made = []
    original = Unbuilt.made
    monkeypatch.setattr(Unbuilt, "made", lambda self: made.append(self) or original(self))
    lazy = _search(captured, cluster, monkeypatch, floors=True)
    assert made == []  # a plan fits: no miss is built to say how close it came
    assert lazy.name == eager.name and lazy.predicted_step_time == eager.predicted_step_time
    (said,), (built,) = ([re.fullmatch(r"(.*) \((the closest came to|none came under) ([0-9.]+) GiB\)", w)
                          for w in p.why] for p in (lazy, eager))
    assert said[1] == built[1] and built[2] == "the closest came to"
    assert float(said[3]) <= float(built[3])  # a floor under the closest peak, or that peak


def test_the_least_known_peak_is_the_closest_made_miss_or_a_floor_under_every_miss():
    def never():
        raise AssertionError("made")

    plain = InfeasibleError("plain", smallest_peak=7.0)
    assert least_known_peak([plain, Unbuilt(7.5, never)]) == (7.0, True)
    assert least_known_peak([plain, Unbuilt(6.0, never)]) == (6.0, False)
    assert least_known_peak([Unbuilt(math.inf, never), InfeasibleError("no peak")]) == (math.inf, False)


@pytest.mark.parametrize("offload", [False, True])
def test_the_floor_is_below_the_peak_of_every_plan_built_from_the_solve(captured, offload):
    cost_graph, cost_model = intra._costed(captured, A100, Options(), "autopar")
    if offload:
        cost_graph = intra.offloaded_graph(cost_graph, cost_model)
    solved = intra.solve_least_memory(cost_graph, Options(), method="autopar")
    floor = peak_floor(solved, captured, cost_model, offload=offload, recompute=False, checkpoints=False)
    peaks = [intra.build_plan(solved, captured, A100, cost_model, Options(), name="autopar", zero=z,
                              offload=offload, alternatives=False).predicted_peak_memory for z in (0, 1, 2)]
    assert 0 < floor <= min(peaks)
    assert floor > 0.9 * min(peaks)  # a floor worth having: close to the least peak
    every = choices_floor(cost_graph, captured, cost_model, offload=offload)
    fastest = intra.solve_graph(cost_graph, Options(), None, method="autopar")
    for choice in (solved, fastest):
        assert every <= min(intra.build_plan(choice, captured, A100, cost_model, Options(), name="autopar", zero=z,
                                             offload=offload, alternatives=False).predicted_peak_memory
                            for z in (0, 1, 2))
    assert 0.8 * floor < every <= floor  # below the least-memory choice's own floor, not far


def test_the_floor_holds_where_the_optimizer_step_is_the_peak_and_activations_outweigh_its_scratch():
    """A tiny Funnel on 2 local ranks: the forward saves more than Adam's scratch, the peak is the
    optimizer step's. Counting gradients beside the saved activations (no moment holds both
    whole) put the floor at 74.1 MB over the least-memory plan's 67.5 MB, and a search asserted."""
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build

    model, inputs = build(next(a for a in architectures() if a.class_name == "FunnelForMaskedLM"))
    captured = capture_for_training(model, example_inputs=inputs)
    local = Cluster.local(world_size=2)
    cost_graph, cost_model = intra._costed(captured, local, Options(), "autopar")
    every = choices_floor(cost_graph, captured, cost_model, offload=False)
    least = intra.solve_least_memory(cost_graph, Options(), method="autopar")
    plan = intra.build_plan(least, captured, local, cost_model, Options(), name="autopar", zero=0, alternatives=False)
    assert plan.memory.activations < plan.memory.temporaries  # the step's moment is the peak
    assert 0.8 * plan.predicted_peak_memory < every <= plan.predicted_peak_memory


@pytest.mark.parametrize("recompute", [True, "selective"])
def test_the_floor_of_recomputing_plans_is_below_their_peaks(captured, recompute):
    """Recomputation frees what ops save, so its floor counts the inputs, buffers and parameters
    only: below every recomputing plan's peak, and cut tries are those that could not fit."""
    cost_graph, cost_model = intra._costed(captured, A100, Options(), "autopar")
    floor = choices_floor(cost_graph, captured, cost_model, offload=False, recompute=recompute)
    graph = intra.recomputing_graph(cost_graph, captured, cost_model, selective=recompute == "selective")
    for choice in (intra.solve_least_memory(graph, Options(), method="autopar"),
                   intra.solve_graph(graph, Options(), None, method="autopar")):
        peaks = [intra.build_plan(choice, captured, A100, cost_model, Options(), name="autopar", zero=z,
                                  recompute=recompute, alternatives=False).predicted_peak_memory for z in (0, 1, 2)]
        assert 0 < floor <= min(peaks)


@pytest.mark.parametrize("offload", [False, True])
def test_the_floor_before_any_cost_graph_is_below_every_meshs_floor(captured, offload):
    """With too little device memory for the parameters' share, :func:`unfit_floor` is below
    :func:`choices_floor` of every mesh's graph; with enough, it is None."""
    cluster = dataclasses.replace(A100, device_memory=2**16)
    floor = unfit_floor(parameter_counts(captured), cluster, Options(memory_fraction=1.0), offload=offload)
    assert floor is not None and floor > 2**16
    for shape in intra.candidate_meshes(cluster):
        graph, cost_model = intra._costed(captured, cluster.with_mesh(shape), Options(), "autopar")
        assert floor <= choices_floor(graph if not offload else intra.offloaded_graph(graph, cost_model), captured,
                                      cost_model, offload=offload)
    counts = parameter_counts(captured)
    assert unfit_floor(counts, A100, Options(), offload=offload) is None  # 80 GB holds a small GPT-2's share


def test_a_search_whose_devices_and_host_are_too_small_costs_only_the_graph_its_error_needs(captured, monkeypatch):
    """Devices too small for the parameters' share and a host too small for the offloaded state:
    no level's try is costed but the one whose error is reported (every offload's says the host is
    short), and the error is the one building every miss reports."""
    cluster = dataclasses.replace(A100, device_memory=2**16, host=dataclasses.replace(A100.host, memory=2**20))
    options = Options(memory_fraction=1.0, offload="auto", recompute=False)
    costed = []
    original = intra._costed
    monkeypatch.setattr(intra, "_costed", lambda *a, **k: costed.append(a[1].mesh_shape) or original(*a, **k))
    with pytest.raises(InfeasibleError, match="but the host would need") as lazy:
        intra.plan_intra_best_mesh(captured, cluster, options)
    assert costed == [tuple(cluster.mesh_shape)]
    monkeypatch.setattr(intra, "unfit_floor", lambda *a, **k: None)
    with pytest.raises(InfeasibleError) as eager:
        intra.plan_intra_best_mesh(captured, cluster, options)
    assert len(costed) > 2  # building every try costs every mesh
    assert str(lazy.value) == str(eager.value) and lazy.value.smallest_peak == eager.value.smallest_peak


def test_closest_miss_builds_only_the_misses_whose_floor_is_below_the_best_made():
    made = []

    def miss(floor, peak):
        def make():
            made.append(peak)
            raise InfeasibleError(f"peak {peak}", smallest_peak=peak)
        return Unbuilt(floor, make)

    plain = InfeasibleError("plain", smallest_peak=7.0)
    refined = Unbuilt(4.0, lambda: (_ for _ in ()).throw(miss(6.2, 6.4)))  # made: a tighter floor, then a plan
    assert str(closest_miss([miss(5.0, 8.0), refined, plain])) == "peak 6.4" and made == [8.0, 6.4]
    made.clear()
    best = closest_miss([miss(9.0, 12.0), miss(5.0, 8.0), plain, miss(6.0, 6.5), miss(7.5, 7.6)])
    assert str(best) == "peak 6.5" and made == [8.0, 6.5]  # 7.0 (built) and 7.5 (floor) cannot be below 6.5
    assert str(closest_miss([plain, miss(7.0, 7.0)])) == "plain"  # a tie keeps the one found first


def test_the_least_memory_sum_is_what_the_least_memory_solve_reaches_and_below_it_nothing_fits(captured):
    graph, _ = intra._costed(captured, A100, Options(), "autopar")
    least = intra.least_memory_sum(graph, Options())
    solved = intra.solve_least_memory(graph, Options(), method="autopar")
    assert sum(float(n.memory[c]) for n, c in zip(graph.nodes, solved.choice)) == pytest.approx(least, rel=1e-9)
    with pytest.raises(InfeasibleError):
        intra.solve_graph(graph, Options(), least * (1 - 1e-6), method="autopar")
    assert intra.solve_graph(graph, Options(), least * (1 + 1e-6), method="autopar").choice is not None


def test_the_floor_before_any_cost_graph_counts_adams_scratch_and_no_plan_under_it_fits(captured, monkeypatch):
    """At the optimizer step every trainable element's parameter, gradient, two moments and the
    foreach step's scratch (one tensor of each parameter's size) are on some device: 20 bytes an
    element in fp32, so the fullest device holds at least their mean. On devices just short of
    it, every try built (the floors off) misses, by at least that much."""
    tiny = dataclasses.replace(A100, device_memory=2**16)
    floor = unfit_floor(parameter_counts(captured), tiny, Options(memory_fraction=1.0), offload=False)
    elements = sum(math.prod(m.shape) for m in captured.parameters.values())
    assert floor == pytest.approx(elements * 20 / tiny.num_devices)
    short = dataclasses.replace(A100, device_memory=int(floor * 0.999))
    options = Options(memory_fraction=1.0, offload=False, recompute=True)
    assert unfit_floor(parameter_counts(captured), short, options, offload=False) == floor
    for name in ("peak_floor", "choices_floor"):
        monkeypatch.setattr(intra, name, lambda *a, **k: float("-inf"))
    monkeypatch.setattr(intra, "unfit_floor", lambda *a, **k: None)
    with pytest.raises(InfeasibleError) as eager:
        intra.plan_intra_best_mesh(captured, short, options)
    assert eager.value.smallest_peak >= floor


@pytest.fixture(scope="module")
def weighty():
    """A GPT-2 whose parameters outweigh its activations (8 tokens of a 1024-wide model)."""
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=1024, heads=8, vocab=512, seq=8, batch=8, device="meta")
    return capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})


def test_the_offloaded_floors_hold_the_gradients_no_axis_is_left_to_move(weighty):
    """With the optimizer on the host, ZeRO-2 moves a gradient there as made only where its
    parameter is replicated on some axis; the least-memory plans shard every weight over the whole
    mesh, so their gradients wait on the device until the step. Floors that counted no gradient
    were 0.66x the peak."""
    for shape in ((1, 8), (2, 4)):
        cluster = A100.with_mesh(shape)
        graph, cost_model = intra._costed(weighty, cluster, Options(), "autopar")
        graph = intra.offloaded_graph(graph, cost_model)
        solved = intra.solve_least_memory(graph, Options(), method="autopar")
        plans = [intra.build_plan(solved, weighty, cluster, cost_model, Options(), name="autopar", zero=z,
                                  offload=True, alternatives=False) for z in (0, 1, 2)]
        least = min(p.predicted_peak_memory for p in plans)
        assert min(p.memory.gradients for p in plans) > 0.3 * least  # the gradients stay: the case in point
        floor = peak_floor(solved, weighty, cost_model, offload=True, recompute=False, checkpoints=False)
        every = choices_floor(graph, weighty, cost_model, offload=True)
        assert 0.9 * least < floor <= least and 0.9 * least < every <= least


def test_a_try_whose_parameters_no_host_holds_is_cut_before_its_solve_and_reports_the_host(weighty, monkeypatch):
    """With the parameters on the host, each rank's piece of every parameter (its least over the
    placements) is a floor on the host's share: below every plan's, and a try over the host's
    limit raises its miss unsolved, whose error, made, is the one solving it gives."""
    graph, cost_model = intra._costed(weighty, A100, Options(), "autopar")
    fetched = intra.fetched_graph(graph, cost_model, weighty)
    floor = host_floor(fetched, weighty, cost_model)
    plans = [intra.build_plan(solved, weighty, A100, cost_model, Options(), name="autopar", offload="parameters",
                              alternatives=False)
             for solved in (intra.solve_least_memory(fetched, Options(), method="autopar"),
                            intra.solve_graph(fetched, Options(), None, method="autopar"))]
    assert 0.5 * min(p.host_memory for p in plans) < floor <= min(p.host_memory for p in plans)
    options = Options(memory_fraction=1.0)
    short = dataclasses.replace(A100, host=dataclasses.replace(A100.host, memory=floor * A100.devices_per_node * 0.99))
    solves = []
    original = intra.solve_graph
    monkeypatch.setattr(intra, "solve_graph", lambda *a, **k: solves.append(a) or original(*a, **k))
    with pytest.raises(Unbuilt) as lazy:
        intra._solved_plan(graph, weighty, short, cost_model, options, "autopar", offload="parameters")
    assert lazy.value.floor == math.inf and not solves
    monkeypatch.setattr(intra, "host_floor", lambda *a, **k: 0.0)
    with pytest.raises(InfeasibleError, match="but the host would need") as eager:
        intra._solved_plan(graph, weighty, short, cost_model, options, "autopar", offload="parameters")
    assert solves and str(lazy.value.made()) == str(eager.value)


def test_compile_refuses_before_any_capture_a_model_no_device_nor_host_holds(weighty, monkeypatch):
    """Devices and a host too small for the parameters' states under every offload: the search
    over the captured graph ends on the host being short, and compile says so, with each offload's
    need, without capturing; with no host the search's smallest peak is worth the capture."""
    cluster = dataclasses.replace(A100, device_memory=2**23, host=dataclasses.replace(A100.host, memory=2**26))
    with pytest.raises(InfeasibleError, match="but the host would need") as searched:
        intra.plan_intra_best_mesh(weighty, cluster, Options())
    assert searched.value.smallest_peak is None  # the search's error reports no peak either
    assert unplannable(parameter_counts(weighty), cluster, Options())
    assert not unplannable(parameter_counts(weighty), dataclasses.replace(cluster, host=None), Options())
    compile_module = importlib.import_module("autopar.compile")
    monkeypatch.setattr(compile_module, "capture_for_training", lambda *a, **k: pytest.fail("captured"))
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=1024, heads=8, vocab=512, seq=8, batch=8, device="meta")
    with pytest.raises(InfeasibleError) as refused:
        compile_module.compile(model, cluster, example_inputs={"input_ids": args[0], **kwargs})
    text = str(refused.value)
    for need in ("with their gradients and optimizer state they hold at least", "with the optimizer offloaded the host",
                 "with the parameters offloaded the host", "the devices' limit: 7.2 MiB"):
        assert need in text
    assert refused.value.smallest_peak is None


def test_a_try_near_the_limit_whose_least_memory_floor_is_over_it_is_cut_before_its_fastest_solve(captured,
                                                                                                 monkeypatch):
    """Where the least memory sum is within FLOOR_FIRST of the limit, the (cheap) least-memory solve
    and its peak floor come first: a try they show cannot fit raises its miss without the fastest
    solve, and that miss, made, reports a peak no lower than the one solving it first reports."""
    options = Options(memory_fraction=1.0)
    graph, cost_model = intra._costed(captured, A100, options, "autopar")
    least_sum = intra.least_memory_sum(graph, options)
    floor = peak_floor(intra.solve_least_memory(graph, options, method="autopar"), captured, cost_model,
                       offload=False, recompute=False, checkpoints=False)
    limit = min(floor, least_sum / intra.FLOOR_FIRST) * 0.999
    assert least_sum > intra.FLOOR_FIRST * limit and floor > limit  # the case in point
    cluster = dataclasses.replace(A100, device_memory=limit)
    solves = []
    original = intra.solve_graph
    monkeypatch.setattr(intra, "solve_graph", lambda *a, **k: solves.append(a) or original(*a, **k))
    with pytest.raises(Unbuilt) as lazy:
        intra._solved_plan(graph, captured, cluster, cost_model, options, "autopar")
    assert lazy.value.floor == floor and not solves
    monkeypatch.setattr(intra, "FLOOR_FIRST", math.inf)
    with pytest.raises(InfeasibleError) as eager:
        intra._solved_plan(graph, captured, cluster, cost_model, options, "autopar")
    eager = eager.value.made() if isinstance(eager.value, Unbuilt) else eager.value
    assert solves and lazy.value.made().smallest_peak >= eager.smallest_peak >= floor
