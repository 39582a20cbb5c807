"""The pipeline-stage DP against exhaustive enumeration, against one DP per slowest-stage bound,
and by hand; malformed inputs are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autopar.core.errors import InfeasibleError, SolverInputError
from autopar.solver import StagePlan, solve_stages
from autopar.solver import stages as stages_mod
from autopar.solver.brute_force import brute_force_stages


def random_case(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    units, meshes = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    positions = int(rng.integers(1, units + 2))
    devices = sorted(rng.choice([1, 2, 3, 4, 6, 8], size=meshes, replace=False).tolist())
    total = int(rng.choice([2 * devices[0], devices[-1], devices[0] + devices[-1], 8]))
    base = rng.random((units, units, meshes)) * rng.integers(1, 4)
    # later positions (more micro-batches in flight) are slower or do not fit at all
    times = np.stack([base + 0.1 * s * rng.random(base.shape) for s in range(positions)])
    times[rng.random(times.shape) < 0.25] = np.inf
    return dict(stage_times=times, submesh_devices=devices, total_devices=total,
                num_microbatches=int(rng.choice([1, 2, 4, 8, 32, 128])))


@pytest.mark.parametrize("seed", range(150))
def test_stage_dp_latency_equals_brute_force(seed):
    case = random_case(seed)
    expected, _ = brute_force_stages(**case)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError, match="exactly"):
            solve_stages(**case)
        return
    plan = solve_stages(**case)
    assert plan.latency == pytest.approx(expected, rel=1e-12)
    # The plan is what it says: contiguous stages on exactly the devices, times by position.
    times, devices, batches = case["stage_times"], case["submesh_devices"], case["num_microbatches"]
    count = len(plan.stages)
    t = [times[count - k - 1, i, j, m] for k, (i, j, m) in enumerate(plan.stages)]
    assert list(plan.stage_times) == t
    assert plan.latency == pytest.approx((batches - 1) * max(t) + sum(t))
    assert sum(devices[m] for _, _, m in plan.stages) == case["total_devices"]
    assert [i for i, _, _ in plan.stages] == [0] + [j + 1 for _, j, _ in plan.stages[:-1]]
    assert plan.stages[-1][1] == times.shape[1] - 1
    # a cutoff at the optimum finds nothing better; above it, the same latency
    assert solve_stages(**case, cutoff=expected) is None
    assert solve_stages(**case, cutoff=expected * 1.5 + 1).latency == pytest.approx(expected, rel=1e-12)


def test_random_stage_cases_include_infeasible_and_multi_stage_answers():
    outcomes = set()
    for seed in range(150):
        latency, stages = brute_force_stages(**random_case(seed))
        outcomes.add("infeasible" if math.isinf(latency) else ("pipelined" if len(stages) > 1 else "one stage"))
    assert outcomes == {"infeasible", "pipelined", "one stage"}


def every_bound(dp, batches: int) -> float:
    """Alpa's plain loop: one DP for every distinct stage time as the bound on the slowest stage."""
    best = math.inf
    for bound in np.unique(dp.times[np.isfinite(dp.times)]):
        total, stages = dp.min_total(bound)
        if stages:
            best = min(best, (batches - 1) * bound + total)
    return best


def structured_case(seed: int) -> dict:
    """6..12 units on 8 devices: larger sub-meshes are less efficient (communication) and a
    stage further from the end holds more micro-batches (memory), so the best plan depends on B."""
    rng = np.random.default_rng(seed)
    units, devices, positions = int(rng.integers(6, 13)), [1, 2, 4, 8], 8
    prefix = np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 1.5, size=units))])
    span = prefix[None, 1:] - prefix[:-1, None]
    loss = rng.uniform(0, 0.5)
    cost = np.stack([span / d * (1 + loss * np.log2(d)) * rng.uniform(1.0, 1.3, size=span.shape)
                     for d in devices], axis=2)
    cost[np.tril_indices(units, -1)] = np.inf  # j < i: no such stage
    times = np.stack([cost * (1 + 0.02 * s) for s in range(positions)])
    held = np.arange(1, positions + 1)[:, None, None, None] * (span[:, :, None] / np.array(devices))[None]
    times[held > rng.uniform(4, 14)] = np.inf
    return dict(stage_times=times, submesh_devices=devices, total_devices=8,
                num_microbatches=int(rng.choice([2, 4, 8, 16, 64, 256])))


def least_total_latency(case) -> float:
    """The latency of the least-total plan, the search's starting point."""
    dp = stages_mod._DP(*stages_mod._check(**case), case["total_devices"])
    total, stages = dp.min_total(math.inf)
    return (case["num_microbatches"] - 1) * max(dp.stage_times(stages)) + total if stages else math.inf


@pytest.mark.parametrize("seed", range(60))
def test_bisection_matches_one_dp_per_bound_on_larger_tables(seed):
    case = structured_case(seed)
    dp = stages_mod._DP(*stages_mod._check(**case), case["total_devices"])
    optimum = every_bound(dp, case["num_microbatches"])
    if math.isinf(optimum):
        with pytest.raises(InfeasibleError):
            solve_stages(**case)
        return
    assert solve_stages(**case).latency == pytest.approx(optimum, rel=1e-12)


def test_larger_tables_need_the_bisection():
    """In many of the cases above the least-total plan is far from the answer."""
    far = 0
    for seed in range(60):
        case = structured_case(seed)
        try:
            far += solve_stages(**case).latency * 1.05 < least_total_latency(case)
        except InfeasibleError:
            continue
    assert far >= 10


def test_two_stage_latency_and_bubble_by_hand():
    # two units, one 2-device sub-mesh; a stage of both units takes 5 s, unit 0 alone 2 s and
    # unit 1 alone 3 s as the last stage but 2.5 s as the first (positions matter)
    inf = math.inf
    times = np.full((2, 2, 2, 1), inf)
    times[0, 0, 1, 0] = 5.0   # last stage (position 1): units 0..1
    times[0, 1, 1, 0] = 3.0   # last stage: unit 1
    times[1, 0, 0, 0] = 2.5   # first of two stages: unit 0
    plan = solve_stages(stage_times=times, submesh_devices=[2], total_devices=4, num_microbatches=4)
    # (B − 1)·max + Σ = 3·3 + (2.5 + 3) = 14.5 ; busy device-time 4·(2.5·2 + 3·2) = 44 of 14.5·4
    assert plan.stages == ((0, 0, 0), (1, 1, 0))
    assert plan.latency == pytest.approx(14.5)
    assert plan.bubble_fraction == pytest.approx(1 - 44 / (14.5 * 4))
    # on 2 devices only the single stage is left: B · 5 s
    alone = solve_stages(stage_times=times, submesh_devices=[2], total_devices=2, num_microbatches=4)
    assert alone.stages == ((0, 1, 0),) and alone.latency == pytest.approx(20.0)
    # unit 0 does not fit as the first of two stages (too much in flight): single stage again...
    times[1, 0, 0, 0] = inf
    with pytest.raises(InfeasibleError):  # ...which cannot use 4 devices
        solve_stages(stage_times=times, submesh_devices=[2], total_devices=4, num_microbatches=4)


def test_two_units_on_two_devices_with_a_hand_off_by_hand():
    # Sub-mesh 0 has 1 device, sub-mesh 1 has 2. Unit times: 1 device 3 s each, 2 devices 2 s
    # each; a stage that is not last also sends its output (``hand_off`` s).
    def table(hand_off: float) -> np.ndarray:
        last = np.full((2, 2, 2), np.inf)
        last[0, 0] = last[1, 1] = [3.0, 2.0]
        last[0, 1] = [6.0, 4.0]
        return np.stack([last, last + hand_off])

    common = dict(submesh_devices=[1, 2], total_devices=2)
    # One micro-batch: one stage on both devices, 4 s, beats two 1-device stages (3 + 3 s).
    single = solve_stages(stage_times=table(0.5), **common, num_microbatches=1)
    assert single.stages == ((0, 1, 1),) and single.latency == 4.0 and single.bubble_fraction == 0.0
    # Eight: one stage takes 8·4 = 32 s; two stages 7·3 + 6 = 27 s, plus 0.5 s per hand-off = 30.5.
    piped = solve_stages(stage_times=table(0.5), **common, num_microbatches=8)
    assert piped.stages == ((0, 0, 0), (1, 1, 0))
    assert piped.stage_times == (3.5, 3.0)
    assert piped.latency == pytest.approx(7 * 3.5 + 6.5)
    # Busy device-time 8·(3.5 + 3) of 2·31 device-seconds.
    assert piped.bubble_fraction == pytest.approx(1 - 8 * 6.5 / (2 * 31.0))
    # A hand-off of 2 s makes the single stage better again (7·5 + 8 = 43 > 32).
    assert solve_stages(stage_times=table(2.0), **common, num_microbatches=8).stages == ((0, 1, 1),)


def test_submeshes_larger_than_the_cluster_are_never_used():
    times = np.zeros((1, 1, 1, 2))
    times[0, 0, 0] = [5.0, 1.0]
    plan = solve_stages(stage_times=times, submesh_devices=[4, 8], total_devices=4, num_microbatches=2)
    assert plan.stages == ((0, 0, 0),)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(stage_times=np.zeros((1, 2, 3, 1))), "shape"),
        (dict(stage_times=np.zeros((2, 2, 1))), "shape"),
        (dict(stage_times=np.full((1, 2, 2, 1), np.nan)), "NaN"),
        (dict(stage_times=-np.ones((1, 2, 2, 1))), "≥ 0"),
        (dict(submesh_devices=[0]), "positive integers"),
        (dict(submesh_devices=[1.5]), "positive integers"),
        (dict(submesh_devices=[1, 2]), "positive integers"),
        (dict(total_devices=0), "total_devices"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(num_microbatches=True), "num_microbatches"),
    ],
)
def test_malformed_stage_inputs_are_rejected(change, match):
    args = dict(stage_times=np.ones((1, 2, 2, 1)), submesh_devices=[1], total_devices=1, num_microbatches=1)
    with pytest.raises(SolverInputError, match=match):
        solve_stages(**{**args, **change})


def test_stage_plan_must_be_contiguous():
    with pytest.raises(SolverInputError, match="contiguous"):
        StagePlan(stages=((0, 1, 0), (3, 4, 0)), stage_times=(1.0, 1.0), latency=2.0, max_stage=1.0,
                  bubble_fraction=0.0, num_microbatches=1)
