"""The pipeline-stage DP against exhaustive enumeration and against one DP per slowest-stage bound."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autopar.core.errors import InfeasibleError, SolverInputError
from autopar.solver import StagePlan, solve_stages, solve_stages_over_microbatches
from autopar.solver import stages as stages_mod
from autopar.solver.brute_force import brute_force_stages


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 7))
    num_meshes = int(rng.integers(2, 4))
    devices = sorted(rng.choice([1, 2, 3, 4, 6, 8], size=num_meshes, replace=False).tolist())
    total = int(rng.choice([2 * devices[0], devices[-1], devices[0] + devices[-1], 8]))
    cost = rng.random((num_layers, num_layers, num_meshes)) * rng.integers(1, 4)
    cost[rng.random(cost.shape) < 0.3] = np.inf
    boundary = rng.random(num_layers - 1) * 0.3 if seed % 2 else None
    return dict(
        stage_cost=cost,
        submesh_devices=devices,
        total_devices=total,
        num_microbatches=int(rng.integers(1, 17)),
        boundary_cost=boundary,
    )


@pytest.mark.parametrize("seed", range(120))
def test_stage_dp_latency_equals_brute_force(seed):
    case = random_case(seed)
    expected, _ = brute_force_stages(**case)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError, match="exactly"):
            solve_stages(**case)
        return
    plan = solve_stages(**case)
    assert plan.latency == pytest.approx(expected, rel=1e-9)
    # The plan is what it says: contiguous stages on exactly the devices, latency from its times.
    assert plan.stages[-1][1] == case["stage_cost"].shape[0] - 1
    assert sum(case["submesh_devices"][m] for _, _, m in plan.stages) == case["total_devices"]
    boundary = case["boundary_cost"]
    for (i, j, m), t in zip(plan.stages, plan.stage_times):
        extra = boundary[j] if boundary is not None and j < len(boundary) else 0.0
        assert t == pytest.approx(case["stage_cost"][i, j, m] + extra)
    batches = case["num_microbatches"]
    assert plan.latency == pytest.approx((batches - 1) * max(plan.stage_times) + sum(plan.stage_times))


def test_random_stage_cases_include_infeasible_and_multi_stage_answers():
    outcomes = set()
    for seed in range(120):
        latency, stages = brute_force_stages(**random_case(seed))
        outcomes.add("infeasible" if math.isinf(latency) else ("pipelined" if len(stages) > 1 else "one stage"))
    assert outcomes == {"infeasible", "pipelined", "one stage"}


def every_bound(table, batches):
    """Alpa's plain loop: one DP for every distinct stage time as the bound on the slowest stage."""
    best = math.inf
    for bound in np.unique(table.times[np.isfinite(table.times)]):
        total, stages = stages_mod._min_total(table, bound)
        if stages:
            best = min(best, (batches - 1) * bound + total)
    return best


@pytest.mark.parametrize("batches", [1, 3, 16, 200])
def test_bisection_matches_one_dp_per_bound_on_a_larger_table(batches):
    rng = np.random.default_rng(batches)
    num_layers, devices = 14, [1, 2, 4, 8]
    layer = rng.uniform(0.5, 1.5, size=num_layers)
    prefix = np.concatenate([[0.0], np.cumsum(layer)])
    span = prefix[None, 1:] - prefix[:-1, None]
    cost = np.stack([span / d * rng.uniform(1.0, 1.3, size=span.shape) for d in devices], axis=2)
    cost[(span[:, :, None] / np.array(devices)) > 3.0] = np.inf  # does not fit memory
    plan = solve_stages(stage_cost=cost, submesh_devices=devices, total_devices=8, num_microbatches=batches)
    table = stages_mod._prepare(cost, devices, 8, None)
    assert plan.latency == pytest.approx(every_bound(table, batches), rel=1e-12)


def test_two_layers_on_two_devices_by_hand():
    # Sub-mesh 0 has 1 device, sub-mesh 1 has 2. Layer times: 1 device 3 s each, 2 devices 2 s each.
    cost = np.full((2, 2, 2), np.inf)
    cost[0, 0] = cost[1, 1] = [3.0, 2.0]
    cost[0, 1] = [6.0, 4.0]
    common = dict(stage_cost=cost, submesh_devices=[1, 2], total_devices=2)
    # One micro-batch: one stage on both devices, 4 s, beats two 1-device stages (3 + 3 s).
    single = solve_stages(**common, num_microbatches=1)
    assert single.stages == ((0, 1, 1),) and single.latency == 4.0 and single.bubble_fraction == 0.0
    # Eight: one stage takes 8·4 = 32 s; two stages 7·3 + 6 = 27 s, plus 0.5 s per hand-off = 30.5.
    piped = solve_stages(**common, num_microbatches=8, boundary_cost=[0.5])
    assert piped.stages == ((0, 0, 0), (1, 1, 0))
    assert piped.stage_times == (3.5, 3.0)
    assert piped.latency == pytest.approx(7 * 3.5 + 6.5)
    # Busy device-time 8·(3.5 + 3) of 2·31 device-seconds.
    assert piped.bubble_fraction == pytest.approx(1 - 8 * 6.5 / (2 * 31.0))
    # A hand-off of 2 s makes the single stage better again (7·5 + 8 = 43 > 32).
    assert solve_stages(**common, num_microbatches=8, boundary_cost=[2.0]).stages == ((0, 1, 1),)


def test_submeshes_larger_than_the_cluster_are_never_used():
    cost = np.zeros((1, 1, 2))
    cost[0, 0] = [5.0, 1.0]
    plan = solve_stages(stage_cost=cost, submesh_devices=[4, 8], total_devices=4, num_microbatches=2)
    assert plan.stages == ((0, 0, 0),)


def test_over_microbatches_picks_the_best_count():
    rng = np.random.default_rng(0)
    devices = [1, 2, 4]
    tables = {}
    for batches in (1, 2, 4, 8):
        # Per-micro-batch time shrinks with the micro-batch, plus a fixed per-stage overhead.
        cost = rng.uniform(1.0, 2.0, size=(5, 5, 3)) / batches + 0.05
        tables[batches] = np.where(np.triu(np.ones((5, 5), bool))[:, :, None], cost, np.inf)
    best = solve_stages_over_microbatches(stage_costs=tables, submesh_devices=devices, total_devices=4)
    each = {
        b: solve_stages(stage_cost=t, submesh_devices=devices, total_devices=4, num_microbatches=b).latency
        for b, t in tables.items()
    }
    assert best.latency == min(each.values())
    assert best.num_microbatches == min(each, key=each.get)
    infeasible = {b: np.full((5, 5, 3), np.inf) for b in (1, 2)}
    with pytest.raises(InfeasibleError, match="micro-batch count"):
        solve_stages_over_microbatches(stage_costs=infeasible, submesh_devices=devices, total_devices=4)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(stage_cost=np.zeros((2, 3, 1))), "shape"),
        (dict(stage_cost=np.full((2, 2, 1), np.nan)), "NaN"),
        (dict(submesh_devices=[0]), "positive integers"),
        (dict(submesh_devices=[1.5]), "positive integers"),
        (dict(total_devices=0), "total_devices"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(boundary_cost=[1.0, 2.0]), "boundary_cost"),
        (dict(boundary_cost=[-1.0]), "boundary_cost"),
    ],
)
def test_malformed_stage_inputs_are_rejected(change, match):
    args = dict(stage_cost=np.ones((2, 2, 1)), submesh_devices=[1], total_devices=1, num_microbatches=1)
    with pytest.raises(SolverInputError, match=match):
        solve_stages(**{**args, **change})


def test_stage_plan_must_be_contiguous():
    with pytest.raises(SolverInputError, match="contiguous"):
        StagePlan(stages=((0, 1, 0), (3, 4, 0)), stage_times=(1.0, 1.0), latency=2.0, max_stage=1.0,
                  bubble_fraction=0.0, num_microbatches=1)
