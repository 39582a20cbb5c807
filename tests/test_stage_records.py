"""A pipelined plan's stages carry the collectives their programs issue per step
(:mod:`autopar.plan.stage_records`), and verify compares each stage's program with its own: on
small GPT-2 and LLaMA shapes on the meta device (2 A100 nodes) with tp and dp inside the stages,
ZeRO-1 and ZeRO-3 stages, recomputing stages, bf16 mixed precision and 2 or 4 stages, the records
equal what the stages issue (kind, mesh axis, bytes, count, phase; sends between stages on axis
-1). A stage whose records count a collective twice fails verification."""

import dataclasses
from collections import Counter

import pytest

from autopar import Cluster, Options, baselines, zoo
from autopar.compile import compile
from autopar.passes.capture.training import capture_for_training
from autopar.plan import Plan
from autopar.plan.stage_records import PP_AXIS
from autopar.planner.inter import plan_inter
from autopar.runtime.verify import verify

A100x2 = Cluster.preset("dgx-a100", nodes=2, use_profile=False)


def gpt2():
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=256, heads=8, vocab=1024, seq=128, batch=16, device="meta")
    return model, {"input_ids": args[0], **kwargs}


def llama():
    model, (args, kwargs) = zoo.llama(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=1024, seq=128,
                                      batch=16, device="meta")
    return model, {"input_ids": args[0], **kwargs}


def megatron(build, *, mixed=False, **kw):
    model, inputs = build()
    options = Options(pipeline=True, mixed_precision=mixed)
    plan = baselines.megatron(model, A100x2, example_inputs=inputs, options=options, **kw)
    return compile(model, A100x2, example_inputs=inputs, plan=plan)


def assert_records_issued(compiled):
    report = compiled.verify()
    assert len(report.ranks) == len(compiled.plan.stages)
    for r in report.ranks:
        missing, unexpected = r.collective_diff()
        assert r.measured.collectives and not missing and not unexpected, (r.measured.stage, dict(missing),
                                                                           dict(unexpected))
        assert not [p for p in r.problems() if p.startswith("collectives")]


@pytest.mark.parametrize("build, kw", [
    (gpt2, dict(tp=4, pp=2, dp=2, micro_batches=4, zero=1, mixed=True)),
    (gpt2, dict(tp=2, pp=2, dp=4, micro_batches=4, zero=3, recompute=True)),
], ids=["gpt2 tp4 pp2 dp2 zero1 bf16", "gpt2 tp2 pp2 dp4 zero3 recompute"])
def test_each_stage_issues_exactly_its_records(build, kw):
    assert_records_issued(megatron(build, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("build, kw", [
    (gpt2, dict(tp=4, pp=2, dp=2, micro_batches=4)),
    (gpt2, dict(tp=2, pp=4, dp=2, micro_batches=4, recompute=True)),
    (gpt2, dict(tp=1, pp=4, dp=4, micro_batches=2, zero=3, recompute=True, mixed=True)),
    (llama, dict(tp=2, pp=2, dp=4, micro_batches=2, zero=1)),
    (llama, dict(tp=4, pp=4, dp=1, micro_batches=8, mixed=True)),
], ids=["gpt2 tp4 pp2 dp2", "gpt2 tp2 pp4 recompute", "gpt2 pp4 dp4 zero3 recompute bf16", "llama tp2 pp2 dp4 zero1",
        "llama tp4 pp4 bf16"])
def test_each_stage_issues_exactly_its_records_in_more_configurations(build, kw):
    assert_records_issued(megatron(build, **kw))


def test_records_count_per_micro_batch_once_per_micro_batch_and_gradient_sums_once_per_step():
    compiled = megatron(gpt2, tp=4, pp=2, dp=2, micro_batches=4, zero=1)
    first, last = compiled.plan.stages
    sends = Counter((c.phase, c.node) for c in first.collective_records if c.axes == (PP_AXIS,))
    assert set(sends.values()) == {4} and {phase for phase, _ in sends} == {"forward"}  # once per micro-batch
    # among them the hidden state of a micro-batch's dp piece: 4 / 2 samples x 128 tokens x 256 x fp32
    assert 2 * 128 * 256 * 4 in {c.nbytes for c in first.collective_records if c.axes == (PP_AXIS,)}
    grads = Counter((c.phase, c.kind) for c in last.collective_records if c.axes == (PP_AXIS,))
    assert grads == {("backward", "send_recv"): 4}
    for stage in (first, last):  # ZeRO-1: one reduce-scatter and one all-gather per parameter per step
        kinds = Counter((c.kind, c.phase) for c in stage.collective_records if c.axes == (0,))
        assert kinds[("reduce_scatter", "backward")] == kinds[("all_gather", "optimizer")] > 0


def test_a_stage_whose_records_count_a_collective_twice_fails_verification():
    compiled = megatron(gpt2, tp=4, pp=2, dp=2, micro_batches=4)
    plan = compiled.plan
    stage = plan.stages[1]
    doubled = next(c for c in stage.collective_records if c.kind == "all_reduce")
    wrong = dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(
        stage, collective_records=stage.collective_records + (doubled,))))
    report = verify(wrong, compiled.captured, compiled.model)
    ok, bad = report.ranks
    assert not ok.problems() and not report.ok
    missing, unexpected = bad.collective_diff()
    assert missing == {(doubled.kind, doubled.axes[0], round(doubled.nbytes), doubled.phase): 1} and not unexpected
    assert "MISMATCH collectives" in report.table()


def test_stage_records_survive_a_json_round_trip(tmp_path):
    plan = megatron(gpt2, tp=4, pp=2, dp=2, micro_batches=2).plan
    assert all(st.collective_records for st in plan.stages)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    unrecorded = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, collective_records=None)
                                                        for s in plan.stages))
    assert Plan.from_dict(unrecorded.to_dict()).stages[0].collective_records is None


def test_compile_records_a_given_pipelined_plan_made_without_records():
    """A plan straight from the pipeline search (``plan_inter``), or a file from before stages
    carried records: ``compile`` counts them, and they equal what the stages issue."""
    model, inputs = llama()
    options = Options(pipeline=True)
    plan = plan_inter(capture_for_training(model, example_inputs=inputs), A100x2, options)
    assert len(plan.stages) > 1 and all(st.collective_records is None for st in plan.stages)
    compiled = compile(model, A100x2, example_inputs=inputs, plan=plan, options=options)
    assert all(st.collective_records for st in compiled.plan.stages)
    assert_records_issued(compiled)
