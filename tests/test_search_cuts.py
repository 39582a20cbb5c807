"""Tries the one-program search does not solve: a graph whose cheapest entries or solves' floor
already cost more than the fastest plan so far (:func:`autopar.planner.solve.least_cost`,
:func:`~autopar.planner.solve.solve_floor`), and within a saver level
the savers tried after a faster one (recompute first): the same plan as searching every try."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar import Cluster, Options, zoo
from autopar.passes.capture.training import capture_for_training
from autopar.plan.records import parameter_counts
from autopar.planner import intra
from autopar.planner.costgraph import with_memory
from autopar.planner.costs import model_precision
from autopar.planner.offload import host_bytes_floor, host_step_floor
from autopar.planner.savers import Savers
from autopar.planner.solve import evaluate, least_cost, solve_floor, solve_graph

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)
ONE = dataclasses.replace(A100, mesh_shape=(1,), devices_per_node=1)


@pytest.fixture(scope="module")
def captured():
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=256, heads=8, vocab=1024, seq=512, batch=32, device="meta")
    return capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})


def test_least_cost_is_below_every_choices_cost(captured):
    graph, _ = intra._costed(captured, A100.with_mesh((2, 4)), Options(), "test")
    floor = least_cost(graph)
    solved = solve_graph(graph, Options(), None, method="test")
    assert 0 < floor <= evaluate(graph, solved.choice)
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = [int(rng.integers(n.size)) for n in graph.nodes]
        assert floor <= evaluate(graph, choice)
    cheapest = [int(np.argmin(n.cost())) for n in graph.nodes]
    assert evaluate(graph, cheapest) >= floor  # the edges between the cheapest strategies add to it


@pytest.mark.parametrize("mesh", [(2, 4), (8,)])
def test_the_solve_floor_is_below_every_solve_and_above_the_cheapest_entries(captured, mesh):
    """Under no bound and under tighter ones (a quarter and a half of the way from the least
    memory sum to the unbounded plan's), every solve costs at least the floor."""
    options = Options()
    graph, _ = intra._costed(captured, A100.with_mesh(mesh), options, "test")
    floor = solve_floor(graph, options)
    free = solve_graph(graph, options, None, method="test")
    assert least_cost(graph) <= floor <= evaluate(graph, free.choice) * (1 + 1e-12)
    used = sum(float(n.memory[c]) for n, c in zip(graph.nodes, free.choice))
    least = intra.least_memory_sum(graph, options)
    for share in (0.25, 0.5):
        bounded = solve_graph(graph, options, least + share * (used - least), method="test")
        assert floor <= evaluate(graph, bounded.choice) * (1 + 1e-12)


@pytest.fixture(scope="module")
def llama():
    model, (args, kwargs) = zoo.llama(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=32000, seq=1024,
                                      batch=8, device="meta")
    return capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})


def test_a_level_tried_fastest_saver_first_keeps_the_plan_of_trying_every_one(llama, monkeypatch):
    """One device with a slow host (a tenth of an A100 node's memory bandwidth per device): a limit
    between the optimizer-offloaded peak and the plain peak, so recompute and both offloads fit.
    Recompute, tried first, wins, and the offloads' tries are not solved: the host's step alone
    takes longer than the recomputing plan."""
    captured = llama
    one = dataclasses.replace(ONE, host=dataclasses.replace(ONE.host, memory_bandwidth=ONE.host.memory_bandwidth / 10))
    kept = intra.plan_intra(captured, one, Options(memory_fraction=1.0))
    moved = intra.plan_intra(captured, one, Options(memory_fraction=1.0, offload=True))
    tight = dataclasses.replace(one, device_memory=(moved.predicted_peak_memory + kept.predicted_peak_memory) / 2)
    solves, tried = [], []
    original_solve, original_try = intra.solve_graph, intra._fastest_try

    def counted(*args, **kwargs):
        solves.append(1)
        return original_solve(*args, **kwargs)

    def every_try(*args, beat=None, **kwargs):
        tried.append(args[6])
        return original_try(*args, **kwargs)  # no beat across savers

    monkeypatch.setattr(intra, "solve_graph", counted)
    plan = intra.plan_intra(captured, tight, Options(memory_fraction=1.0))
    cut = len(solves)
    with monkeypatch.context() as m:
        m.setattr(intra, "_fastest_try", every_try)
        m.setattr(intra, "least_cost", lambda graph: float("-inf"))
        solves.clear()
        full = intra.plan_intra(captured, tight, Options(memory_fraction=1.0))
    assert plan.recompute and not plan.offload, plan.why
    assert plan.predicted_step_time == full.predicted_step_time and plan.recompute == full.recompute
    assert plan.nodes == full.nodes and plan.parameter_placements == full.parameter_placements
    assert cut < len(solves) - 1, (cut, len(solves))  # neither offload solved
    level = [s for s in tried if s.recompute or s.offload]  # the first level that fits: one saver each
    first_offload = next(i for i, s in enumerate(level) if s.offload)
    assert first_offload >= 2 and not any(s.offload is False for s in level[first_offload:])  # recompute first
    offloaded = intra.plan_intra(captured, tight, Options(memory_fraction=1.0, recompute=False, offload=True))
    fetching = intra.plan_intra(captured, tight, Options(memory_fraction=1.0, recompute=False, offload="parameters"))
    precision = model_precision(captured, Options())
    for p in (offloaded, fetching):  # the floors are below what each offload's step pays
        linked = host_step_floor(captured, tight, "adam", precision=precision, parameters=p.offload_parameters)
        assert 0 < host_step_floor(captured, tight, "adam") < linked <= p.time.offload
    (why,) = [w for w in plan.why if "recompute:" in w]
    (fully,) = [w for w in full.why if "recompute:" in w]
    assert f"optimizer offloaded instead: {offloaded.predicted_step_time * 1e3:.1f} ms" in fully
    assert "optimizer offloaded instead: slower" in why and "parameters offloaded instead: slower" in why


def test_an_offload_whose_host_share_cannot_fit_is_not_solved_and_says_so(llama, monkeypatch):
    """The host-bytes floor is below each offloaded plan's host share; with a host smaller than
    the floor the try is not solved unless its error is reported, and then says the host is short."""
    captured = llama
    precision = intra.model_precision(captured, Options())
    for offload in (True, "parameters"):
        plan = intra.plan_intra(captured, ONE, Options(memory_fraction=1.0, recompute=False, offload=offload))
        floor = host_bytes_floor(parameter_counts(captured), ONE, precision, "adam", parameters=offload == "parameters")
        assert 0 < floor <= plan.host_memory
    small = dataclasses.replace(ONE, host=dataclasses.replace(ONE.host, memory=floor / 2 * ONE.devices_per_node))
    solves = []
    original = intra.solve_graph
    monkeypatch.setattr(intra, "solve_graph", lambda *a, **k: solves.append(1) or original(*a, **k))
    costed = {}
    (miss,) = intra._fastest_try(captured, small, Options(memory_fraction=1.0), {(1,): [(None, "test")]}, costed,
                                 None, Savers(False, "parameters"))
    assert isinstance(miss, intra.Unbuilt) and miss.floor == float("inf")
    assert not solves and not costed  # nothing costed nor solved until the error is reported
    with pytest.raises(intra.InfeasibleError, match="but the host would need"):
        raise intra.closest_miss([miss])  # made (through the try's own unbuilt miss) as a search reports it
    assert costed


def test_a_fetching_plan_on_several_devices_steps_no_faster_than_its_solve_and_the_tries_floor(llama):
    """Fetched parameters are tiled on one device only, so on several a fetching try is cut like
    any other (:func:`intra._cannot_beat`, :func:`intra._floor`): its plans take no less than
    their solve's cost, nor than the cheapest entries' sum with the host's step."""
    cluster = A100.with_mesh((2, 4))
    graph, cost_model = intra._costed(llama, cluster, Options(), "test")
    fetched = intra.fetched_graph(graph, cost_model, llama)
    floor = intra._floor(fetched, llama, cluster, cost_model, Options(), "parameters")
    for solved in (solve_graph(fetched, Options(), None, method="test"),
                   intra.solve_least_memory(fetched, Options(), method="test")):
        plan = intra._fitting(solved, llama, cluster, cost_model, Options(), "test", None, float("inf"),
                              offload="parameters")
        assert plan.offload_parameters and not plan.tiles
        assert evaluate(fetched, solved.choice) * (1 - intra.PRUNE_MARGIN) <= plan.predicted_step_time
        assert 0 < floor <= plan.predicted_step_time


def test_a_re_solve_whose_cost_cannot_beat_the_fastest_plan_ends_its_try(captured, monkeypatch):
    """A plan over the limit is solved again under a tighter bound; every later choice of the try
    (the tighter re-solves, the least-memory one) is within that bound, so a re-solve whose cost is
    not below the fastest plan so far ends the try: what it would have built is no faster."""
    options = Options(memory_fraction=1.0)
    graph, cost_model = intra._costed(captured, A100, options, "test")
    first = intra._fitting(solve_graph(graph, options, None, method="test"), captured, A100, cost_model, options,
                           "test", None, float("inf"))
    short = dataclasses.replace(A100, device_memory=first.predicted_peak_memory * 0.9)
    costs = []
    original = intra.solve_graph
    monkeypatch.setattr(intra, "solve_graph", lambda *a, **k: (
        lambda solved: costs.append(evaluate(graph, solved.choice)) or solved)(original(*a, **k)))
    plan, _ = intra._solved_plan(graph, captured, short, cost_model, options, "test")
    assert len(costs) >= 2 and costs[0] < costs[1]  # the case in point: re-solved, at a higher cost
    beat = (costs[0] + costs[1]) / 2
    assert plan.predicted_step_time > beat  # the plan the cut forgoes loses anyway
    costs.clear()
    assert intra._solved_plan(graph, captured, short, cost_model, options, "test", beat=beat) is None
    assert len(costs) == 2


def test_an_offloaded_try_whose_solve_with_the_hosts_and_the_links_seconds_cannot_beat_is_cut(captured, monkeypatch):
    """With the optimizer offloaded a plan's step is its solve's cost plus at least the host's step
    and the link's seconds (:func:`intra._host_floor`): a try whose first solve with them is not
    below ``beat`` is cut there, though the solve's cost alone is (the cut before any solve is off)."""
    options, cluster = Options(memory_fraction=1.0), A100.with_mesh((8,))  # one axis: ZeRO-2 sums as ZeRO-0 does
    graph, cost_model = intra._costed(captured, cluster, options, "test")
    plan, solved = intra._solved_plan(graph, captured, cluster, cost_model, options, "test", offload=True)
    cost = evaluate(solved.graph, solved.choice)
    host = intra._host_floor(captured, cluster, options, cost_model.precision, True)
    step_only = host_step_floor(captured, cluster, options.optimizer)
    assert 0 < step_only < host and cost + host <= plan.predicted_step_time * (1 + intra.PRUNE_MARGIN)
    beat = cost + (step_only + host) / 2  # over the solve's cost with the CPU step alone, under it with the link's
    assert _solves_of_a_cut_try(monkeypatch, graph, captured, cluster, cost_model, options, beat, offload=True) == 1


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_a_fetching_try_solves_for_its_pieces_host_step_and_gradients_and_is_cut_by_that_cost(captured, mesh,
                                                                                               monkeypatch):
    """With the parameters on the host every piece costs the ILP its elements' CPU step and its
    gradient down the link (:func:`~autopar.planner.fetched.fetched_graph`): the solve shards the
    parameters where replicating them would multiply the host's step (on (8,): 12.4 ms against the
    19.7 ms of solving for the device's seconds alone), its cost is within its plan's step (which
    adds the fetches the compute does not hide), above the host's mean floor, and a try whose
    first solve costs ``beat`` or more is cut there."""
    options, cluster = Options(memory_fraction=1.0), A100.with_mesh(mesh)
    graph, cost_model = intra._costed(captured, cluster, options, "test")
    view = intra.fetched_graph(graph, cost_model, captured)
    assert intra.fetched_graph(graph, cost_model, captured) is view and "costs of" not in view.memo
    blind = with_memory(graph, [n.with_memory(np.zeros_like(n.memory)) if n.kind == "parameter" else n
                                for n in graph.nodes])  # the parameters' memory out, their host seconds not in
    plans = {}
    for name, g in (("priced", view), ("blind", blind)):
        solved = solve_graph(g, options, None, method="test")
        plans[name] = intra._fitting(solved, captured, cluster, cost_model, options, "test", None, float("inf"),
                                     offload="parameters"), solved
    (priced, solved), (unpriced, _) = plans["priced"], plans["blind"]
    assert priced.predicted_step_time < 0.8 * unpriced.predicted_step_time
    cost = evaluate(view, solved.choice)
    host = host_step_floor(captured, cluster, options.optimizer, precision=cost_model.precision, parameters=True)
    assert evaluate(graph, solved.choice) + host <= cost <= priced.predicted_step_time * (1 + intra.PRUNE_MARGIN)
    assert _solves_of_a_cut_try(monkeypatch, graph, captured, cluster, cost_model, options, cost * (1 - 1e-4),
                                offload="parameters") == 1


def _solves_of_a_cut_try(monkeypatch, graph, captured, cluster, cost_model, options, beat, **savers) -> int:
    """The solves of a try with ``savers`` cut by ``beat`` (asserted), its cut before any solve off."""
    solves = []
    original = intra.solve_graph
    monkeypatch.setattr(intra, "solve_graph", lambda *a, **k: solves.append(1) or original(*a, **k))
    monkeypatch.setattr(intra, "_floor", lambda *a, **k: float("-inf"))
    assert intra._solved_plan(graph, captured, cluster, cost_model, options, "test", beat=beat, **savers) is None
    return len(solves)


@pytest.mark.parametrize("recompute", [True, "selective"])
def test_a_recomputing_plan_steps_its_solves_cost_and_at_least_the_forwards_floor(captured, recompute):
    """A recomputing plan's compute is its solve's and the forwards it runs again, which the ILP
    leaves out: :func:`intra._again_floor` is positive and no more than those forwards."""
    options, cluster = Options(memory_fraction=1.0), A100.with_mesh((8,))
    graph, cost_model = intra._costed(captured, cluster, options, "test")
    plan, solved = intra._solved_plan(graph, captured, cluster, cost_model, options, "test", recompute=recompute)
    cost = evaluate(solved.graph, solved.choice)
    again = intra._again_floor(solved.graph, captured, recompute)
    assert 0 < again and cost + again <= plan.predicted_step_time * (1 + intra.PRUNE_MARGIN)
    assert intra._again_floor(solved.graph, captured, False) == 0.0


@pytest.mark.parametrize("recompute", [True, "selective"])
def test_a_recomputing_try_whose_solve_with_the_forwards_run_again_cannot_beat_is_cut(captured, recompute,
                                                                                       monkeypatch):
    """A try whose first solve's cost is under ``beat`` but, with the forwards its plans run again,
    is not, is cut after that solve (the cut before any solve is off here)."""
    options, cluster = Options(memory_fraction=1.0), A100.with_mesh((8,))
    graph, cost_model = intra._costed(captured, cluster, options, "test")
    _, solved = intra._solved_plan(graph, captured, cluster, cost_model, options, "test", recompute=recompute)
    cost = evaluate(solved.graph, solved.choice)
    beat = cost + intra._again_floor(solved.graph, captured, recompute) / 2
    assert _solves_of_a_cut_try(monkeypatch, graph, captured, cluster, cost_model, options, beat,
                                recompute=recompute) == 1
