"""ZeRO-1 and ZeRO-2 in one-program plans (:mod:`autopar.plan.zero`): the collectives a ZeRO step
issues, hand-computed; a plan's ``zero`` in JSON (older files load as 0); the data-parallel
baseline's ZeRO plans priced (optimizer state / dp, ZeRO-2 gradients / dp, reduce-scatter +
all-gather for all-reduce) and ``verify`` finding exactly their collectives and their memory
within 10 %; the planner offering ZeRO where data parallelism does not fit otherwise.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import Cluster, Plan, baselines, compile, zoo
from autopar.core.errors import PlanError
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.plan.zero import zero_state_bytes, zero_step_collectives
from autopar.planner.intra import plan_intra
from autopar.planner.restrictions import data_rule
from autopar.runtime.verify.report import PEAK_RTOL

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)


def test_a_zero_step_reduce_scatters_outermost_first_and_gathers_innermost_first():
    # 10 elements of 4 bytes over a 2 x 2 mesh: padded to 12, chunks of 3
    assert zero_step_collectives("w", 10, 4, (0, 1), (2, 2), 2) == [
        ("backward", "reduce_scatter", 0, 48, "w"), ("backward", "reduce_scatter", 1, 24, "w"),
        ("optimizer", "all_gather", 1, 24, "w"), ("optimizer", "all_gather", 0, 48, "w")]
    assert zero_step_collectives("w", 10, 4, (0, 1), (2, 2), 1) == [
        ("backward", "all_reduce", 0, 40, "w"), ("backward", "all_reduce", 1, 40, "w"),
        ("optimizer", "all_gather", 1, 24, "w"), ("optimizer", "all_gather", 0, 48, "w")]
    assert zero_step_collectives("w", 10, 4, (0,), (8, 1), 0) == [("backward", "all_reduce", 0, 40, "w")]


def test_zero_shards_optimizer_state_and_zero_2_gradients_over_the_axes():
    assert zero_state_bytes((4.0, 4.0, 8.0), (0, 1), (2, 2), 1, copy=False) == (4.0, 4.0, 2.0)
    assert zero_state_bytes((4.0, 4.0, 8.0), (0, 1), (2, 2), 2, copy=False) == (4.0, 1.0, 2.0)
    assert zero_state_bytes((4.0, 4.0, 8.0), (0,), (2, 2), 2, copy=True) == (4.0, 2.0, 6.0)  # + the fp32 copy
    assert zero_state_bytes((4.0, 4.0, 8.0), (0,), (2, 2), 0, copy=True) == (4.0, 4.0, 8.0)


@pytest.fixture(scope="module")
def llama():
    model, (args, kwargs) = zoo.llama(layers=2, hidden=256, heads=8, kv_heads=2, ffn=704, vocab=1024, seq=128,
                                      batch=16, device="meta")
    return model, {"input_ids": args[0], **kwargs}


@pytest.fixture(scope="module")
def plans(llama):
    model, inputs = llama
    return {z: baselines.data_parallel(model, A100, example_inputs=inputs, zero=z) for z in (0, 1, 2)}


def test_a_plans_zero_round_trips_and_an_older_file_without_it_loads_as_zero_0(plans, tmp_path):
    plans[2].save(tmp_path / "z2.json")
    assert Plan.load(tmp_path / "z2.json") == plans[2] and plans[2].zero == 2
    data = json.loads((tmp_path / "z2.json").read_text())
    del data["zero"]
    assert Plan.from_dict(data).zero == 0
    with pytest.raises(PlanError, match="zero must be one of"):
        dataclasses.replace(plans[0], zero=3)


def test_zero_plans_are_priced_as_sharded_state_and_their_step_collectives(plans):
    zero0, zero1, zero2 = (plans[z] for z in (0, 1, 2))
    states = {z: [sum(m[k] for m in plans[z].parameter_memory.values()) for k in range(3)] for z in plans}
    p, g, o = states[0]
    assert states[1] == pytest.approx([p, g, (o + p) / 8])  # fp32: the shard the optimizer steps is a copy
    assert states[2] == pytest.approx([p, g / 8, (o + p) / 8])
    assert zero1.memory.optimizer == pytest.approx(states[1][2]) and zero2.memory.optimizer == pytest.approx(states[2][2])
    kinds = {z: {(c.kind, c.phase) for c in plans[z].collective_records} for z in plans}
    assert ("all_gather", "optimizer") in kinds[1] and ("all_gather", "optimizer") in kinds[2]
    assert ("reduce_scatter", "backward") in kinds[2] and ("reduce_scatter", "backward") not in kinds[1]
    assert zero1.predicted_step_time > zero0.predicted_step_time  # all-reduce, then all-gather
    assert zero2.predicted_step_time == pytest.approx(zero0.predicted_step_time, rel=0.05)  # the same ring bytes


@pytest.mark.parametrize("zero", [1, 2])
def test_verify_finds_a_zero_plans_collectives_and_its_memory(llama, plans, zero):
    model, inputs = llama
    compiled = compile(model, A100, example_inputs=inputs, plan=plans[zero])
    assert compiled.program.zero == zero
    (rank,) = compiled.verify().ranks
    missing, unexpected = rank.collective_diff()
    assert not missing and not unexpected, (dict(missing), dict(unexpected))
    assert sum(c.kind == "all_gather" and c.phase == "optimizer" for c in rank.measured.collectives) > 0
    assert abs(rank.peak_ratio - 1) <= PEAK_RTOL, rank.peak_ratio
    assert rank.measured.memory["optimizer"] == pytest.approx(plans[zero].memory.optimizer, rel=0.01)


def test_the_planner_offers_zero_where_data_parallelism_does_not_fit_without_it(llama, plans):
    model, inputs = llama
    captured = capture_for_training(model, example_inputs=inputs)
    limit = (plans[0].predicted_peak_memory + plans[2].predicted_peak_memory) / 2
    tight = dataclasses.replace(A100, device_memory=limit)
    options = Options(memory_fraction=1.0)
    plan = plan_intra(captured, tight, options, allow=data_rule(A100.mesh_shape), name="dp")
    assert plan.zero in (1, 2) and plan.predicted_peak_memory <= limit
    (why,) = plan.why  # what ZeRO-0 would have held, and the other level
    assert why.startswith(f"ZeRO-{plan.zero}: without it the step's peak is {plans[0].predicted_peak_memory / 2**30:.2f}"
                          f" GiB, over the {limit / 2**30:.2f} GiB limit; ZeRO-{3 - plan.zero}: ")
    assert why.split(": ", 1)[1] in " ".join(plan.summary().split())  # wrapped there
    with pytest.raises(Exception, match="fit"):  # without ZeRO (or the optimizer on the host) it does not fit
        plan_intra(captured, tight, dataclasses.replace(options, offload=False), allow=data_rule(A100.mesh_shape),
                   name="dp", zero=0)


def test_with_the_optimizer_on_the_host_the_planner_takes_zero_where_it_steps_faster_though_zero_0_fits(llama):
    """Offloaded, each rank's host steps and moves only its ZeRO chunk: data parallelism with
    ZeRO-1/2 steps 1/8 of what ZeRO-0 does on eight devices, so the planner builds those stages
    too, though ZeRO-0 fits, and keeps the fastest."""
    model, inputs = llama
    captured = capture_for_training(model, example_inputs=inputs)
    options = Options(offload=True)
    dp = data_rule(A100.mesh_shape)
    whole = plan_intra(captured, A100, options, allow=dp, name="dp", zero=0)
    plan = plan_intra(captured, A100, options, allow=dp, name="dp")
    assert whole.offload and plan.offload and whole.predicted_peak_memory <= A100.memory_per_device
    assert plan.zero in (1, 2) and plan.predicted_step_time < whole.predicted_step_time
    assert plan.time.offload < whole.time.offload / 4
    assert plan.why[0].startswith(f"ZeRO-{plan.zero}: the host steps each rank's chunk of the optimizer state:")
