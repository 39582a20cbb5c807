"""The memory savers a one-program search weighs (:mod:`autopar.planner.savers`): activation
recompute taken where nothing fits without it, beside offloading the optimizer, and said why;
verify confirms the recomputing plan's peak."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest

from autopar import Cluster, Options, zoo
from autopar.compile import compile
from autopar.core.errors import ClusterError, InfeasibleError
from autopar.passes.capture.training import capture_for_training
from autopar.planner.intra import plan_intra
from autopar.planner.savers import Savers, saver_levels
from autopar.runtime.verify.report import FLOPS_RTOL, PEAK_RTOL

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)
ONE = dataclasses.replace(A100, mesh_shape=(1,), devices_per_node=1, host=None)


def test_savers_are_tried_level_by_level_as_the_options_allow():
    auto = Options()
    assert saver_levels(auto, A100) == [
        [Savers(False, False)],
        [Savers(False, True), Savers(False, "parameters"), Savers("selective", False), Savers(True, False)],
        [Savers("selective", True), Savers("selective", "parameters"), Savers(True, False, True), Savers(True, True),
         Savers(True, "parameters")],
        [Savers(True, True, True)]]  # the checkpoints on the host: one level after recompute without
    assert saver_levels(auto, ONE) == [[Savers(False, False)],
                                       [Savers("selective", False), Savers(True, False)]]  # no host: no offload
    assert saver_levels(Options(recompute=True), A100) == [
        [Savers(True, False)], [Savers(True, False, True), Savers(True, True), Savers(True, "parameters")],
        [Savers(True, True, True)]]
    assert saver_levels(Options(offload="parameters", recompute=False), A100) == [[Savers(False, "parameters")]]
    assert saver_levels(Options(recompute=False, offload=False), A100) == [[Savers(False, False)]]
    assert saver_levels(Options(offload=True, recompute=False), A100) == [[Savers(False, True)]]
    with pytest.raises(ClusterError, match="needs the cluster's host"):
        saver_levels(Options(offload=True), ONE)


@pytest.fixture(scope="module")
def gpt2():
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=256, heads=8, vocab=1024, seq=512, batch=32, device="meta")
    inputs = {"input_ids": args[0], **kwargs}
    return model, inputs, capture_for_training(model, example_inputs=inputs)


def test_a_one_program_plan_recomputes_where_nothing_fits_without_it_and_verify_confirms_it(gpt2):
    """Selective recompute where it is enough, full recompute where only that fits."""
    model, inputs, captured = gpt2
    plans = {mode: plan_intra(captured, ONE, Options(memory_fraction=1.0, recompute=mode))
             for mode in (False, "selective", True)}
    peaks = [p.predicted_peak_memory for p in plans.values()]
    times = [p.predicted_step_time for p in plans.values()]
    assert peaks[0] > peaks[1] > peaks[2] and times[0] < times[1] < times[2]  # recompute costs time
    assert not plan_intra(captured, ONE, Options(memory_fraction=1.0)).recompute  # not taken for nothing
    for mode, limit in (("selective", (peaks[0] + peaks[1]) / 2), (True, (peaks[1] + peaks[2]) / 2)):
        tight = dataclasses.replace(ONE, device_memory=limit)
        with pytest.raises(InfeasibleError, match="no plan fits"):
            plan_intra(captured, tight, Options(memory_fraction=1.0, recompute=False))
        plan = plan_intra(captured, tight, Options(memory_fraction=1.0))
        assert plan.recompute == mode and not plan.offload and plan.predicted_peak_memory <= limit
        assert plan.predicted_step_time == pytest.approx(plans[mode].predicted_step_time)
        (why,) = [w for w in plan.why if "recompute:" in w]
        assert re.search(fr"no plan fits the devices' {limit / 2**30:.2f} GiB without it "
                     r"\((the closest came to|none came under) [0-9.]+ GiB\)", why)
        assert why.split(": ", 1)[1] in " ".join(plan.summary().split())
        r = compile(model, tight, example_inputs=inputs, plan=plan).verify().ranks[0]
        assert abs(r.peak_ratio - 1) <= PEAK_RTOL and abs(r.flops_ratio - 1) <= FLOPS_RTOL, r.to_dict()
        assert r.collective_diff() == (Counter(), Counter())
        assert r.measured.peak <= limit * (1 + PEAK_RTOL)


def test_recompute_is_taken_where_it_lets_a_faster_sharding_fit(gpt2):
    """Four devices on 1 GB/s links: just above the smallest peak without recompute, the plan
    without it must shard further and is slower than recomputing with plain data parallelism."""
    model, inputs, captured = gpt2
    slow = Cluster(mesh_shape=(4,), device="A100-80GB", devices_per_node=1, inter_node_bandwidth=1e9,
                   inter_node_latency=30e-6)
    tiny = dataclasses.replace(slow, device_memory=2**20)
    with pytest.raises(InfeasibleError) as missed:
        plan_intra(captured, tiny, Options(memory_fraction=1.0, recompute=False))
    limit = missed.value.smallest_peak * 1.005
    tight = dataclasses.replace(slow, device_memory=limit)
    without = plan_intra(captured, tight, Options(memory_fraction=1.0, recompute=False))
    plan = plan_intra(captured, tight, Options(memory_fraction=1.0))
    assert plan.recompute and plan.predicted_step_time < without.predicted_step_time
    assert plan.predicted_peak_memory <= limit
    (why,) = [w for w in plan.why if "recompute:" in w]
    assert why.split(": ", 1)[1].startswith(f"{plan.predicted_step_time * 1e3:.1f} ms against"
                          f" {without.predicted_step_time * 1e3:.1f} ms without it")
    r = compile(model, tight, example_inputs=inputs, plan=plan).verify().ranks[0]
    assert abs(r.peak_ratio - 1) <= PEAK_RTOL and abs(r.flops_ratio - 1) <= FLOPS_RTOL, r.to_dict()


@pytest.mark.parametrize("selective,offloaded", [("selective", False), (True, False), (True, True)])
def test_a_recomputing_solve_bounds_what_the_checkpoints_keep(gpt2, selective, offloaded):
    """The sum the ILP bounds under recompute: the saved bytes outside the recomputed regions and
    the regions' checkpoints (those on the device), each at the chosen strategies' shardings."""
    import numpy as np

    from autopar.planner.intra import _costed
    from autopar.planner.peak import checkpoint_bytes, recomputed_regions, recomputing_graph

    _, _, captured = gpt2
    mesh = dataclasses.replace(A100, mesh_shape=(2, 4))
    graph, cost_model = _costed(captured, mesh, Options(), "test")
    recomputing = recomputing_graph(graph, captured, cost_model, selective=selective == "selective",
                                    offloaded=offloaded)
    regions, region_of, saving = recomputed_regions(graph, captured, selective=selective == "selective")
    assert regions and saving
    rng = np.random.default_rng(0)
    for choice in [np.zeros(len(graph.nodes), int)] + [
            np.array([rng.integers(len(n.strategies)) for n in graph.nodes]) for _ in range(3)]:
        def strategy(i, choice=choice):
            return graph.nodes[i].strategies[choice[i]]

        outside = sum(float(n.memory[c]) for i, (n, c) in enumerate(zip(graph.nodes, choice))
                      if not (i in region_of and n.kind == "op"))
        kept = checkpoint_bytes(graph, strategy, cost_model, regions, region_of, saving,
                                grad=False if offloaded else None)
        bounded = sum(float(n.memory[c]) for n, c in zip(recomputing.nodes, choice))
        assert bounded == pytest.approx(outside + sum(kept.values()), rel=1e-12)
        if not offloaded:
            assert sum(kept.values()) > 0
