"""A pipelined stage's ZeRO-1 as planned (:class:`~autopar.runtime.pipeline.PipelineProgram` with
:mod:`autopar.runtime.zero`): each data-parallel rank of a stage steps only its flat chunk of the
stage's parameters, the gradient it added up over the micro-batches is reduce-scattered once per
step, and an all-gather brings the updated parameters back before the next forward.

The fast tests look at one rank of a 4-rank plan in a fake process group (no process is started),
and verify a GPT-2-shaped ZeRO-1 plan's stages on fake tensors (memory, and ZeRO's collectives
once per step). The slow ones train a Megatron plan of 2 stages x dp 2 at ZeRO-1 on 4 gloo ranks
with SGD and AdamW for 3 steps (plain, with gradient accumulation and clipping, and in bf16 mixed
precision), compared with one process through :mod:`one_process`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines, compile, zoo
from autopar.core.errors import PipelineError
from autopar.core.options import Options
from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.verify.fake import fake_world
from autopar.runtime.verify.report import PEAK_RTOL
from autopar.testing import run_on_ranks, run_programs
from models import ResidualStack
from one_process import one_process
from resumed import check_resumed, resume_programs

LR = 0.01
A100x2 = Cluster.preset("dgx-a100", nodes=2, use_profile=False)


def _net():
    torch.manual_seed(0)  # width 6, head 5: pieces of 36, 6, 30 and 5 elements (some padded over dp 2)
    return ResidualStack(4, 6, head=5), torch.randn(8, 6), torch.randn(8, 5)


def _compiled(net, x, y, *, mixed: bool = False):
    """Megatron's 2 stages x dp 2 (tp 1) on 4 ranks, 2 micro-batches, both stages at ZeRO-1."""
    cluster = Cluster.local(world_size=4)
    kw = {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss,
          "options": Options(pipeline=True, schedule="1f1b", mixed_precision=mixed)}
    plan = baselines.megatron(net, cluster, tp=1, pp=2, dp=2, micro_batches=2, zero=1, **kw)
    assert [st.zero for st in plan.stages] == [1, 1]
    return compile(net, cluster, plan=plan, **kw)


def test_each_rank_of_a_zero_1_stage_steps_its_flat_chunk_of_the_stages_parameters():
    net, x, y = _net()
    program = _compiled(net, x, y).program
    assert isinstance(program, PipelineProgram)
    for rank in range(4):
        with fake_world(rank, 4):
            program.start()
            assert program.shards_optimizer
            stage, position = program.stage_of(rank)
            names = {s.fqn for s in stage.stored if s.kind == "parameter"}
            want = [p.detach().reshape(-1) for n, p in net.named_parameters() if n in names]
            stepped = list(program.parameters())
            assert [s.shape for s in stepped] == [(math.ceil(w.numel() / 2),) for w in want]
            for s, w in zip(stepped, want):  # dp coordinate c holds the c-th half, zero-padded
                part = w[position * s.numel():(position + 1) * s.numel()]
                assert torch.equal(s.detach()[:part.numel()], part)
                assert not s.detach()[part.numel():].any()
            program.reset()


def test_a_pipeline_refuses_a_zero_2_stage():
    net, x, y = _net()
    compiled = _compiled(net, x, y)
    plan = dataclasses.replace(compiled.plan, stages=[dataclasses.replace(st, zero=2) for st in compiled.plan.stages])
    with pytest.raises(PipelineError, match="ZeRO-2 would hold and move what ZeRO-1 does"):
        PipelineProgram(compiled.captured, plan, model=compiled.model)


def test_verify_measures_a_zero_1_stage_as_planned():
    """GPT-2 shapes on meta, tp 4 x pp 2 x dp 2 on two A100 nodes: each stage's peak within verify's
    10 %, its optimizer state within 1 % (dp shards plus, in fp32, the shard copies; the tied
    embedding both stages hold keeps whole state), each parameter's gradient reduce-scattered once
    per step over its ZeRO axes, not once per micro-batch, and gathered once after the step."""
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=256, heads=8, vocab=1024, seq=128, batch=16, device="meta")
    inputs = {"input_ids": args[0], **kwargs}
    plan = baselines.megatron(model, A100x2, example_inputs=inputs, options=Options(pipeline=True), tp=4, pp=2,
                              dp=2, micro_batches=4, zero=1)
    compiled = compile(model, A100x2, example_inputs=inputs, plan=plan)
    report = compiled.verify()
    assert len(report.ranks) == 2
    held = Counter(s.fqn for st in plan.stages for s in compiled.program.stage_of(st.ranks[0])[0].stored if s.trainable)
    for r, stage in zip(report.ranks, plan.stages):
        assert abs(r.peak_ratio - 1) <= PEAK_RTOL, r.to_dict()
        assert r.predicted.memory["optimizer"] == pytest.approx(r.measured.memory["optimizer"], rel=0.01)
        own = {s.fqn for s in compiled.program.stage_of(stage.ranks[0])[0].stored if s.trainable}
        sharded = {fqn for fqn in own if held[fqn] == 1}
        assert len(sharded) >= 10 and len(own - sharded) == 1  # the tied embedding
        issued = Counter((c.kind, c.phase) for c in r.measured.collectives if c.axis == 0)
        assert issued[("reduce_scatter", "backward")] == issued[("all_gather", "optimizer")] == len(sharded)
        assert issued[("all_reduce", "backward")] == len(own - sharded)


def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr)


@pytest.mark.slow
@pytest.mark.parametrize("training", [{}, {"accumulate": 2, "max_norm": 0.05}], ids=["plain", "accumulate-clip"])
def test_two_zero_1_stages_over_dp_2_train_like_one_process(training):
    net, x, y = _net()
    results = run_programs({"zero1": _compiled(net, x, y).program}, inputs=(x,), target=y, optimizer=["sgd", adamw],
                           lr=LR, return_parameters=True, **training)
    for opt, (losses, params) in zip(("sgd", "adamw"), results["zero1"]):
        ref = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer=opt, lr=LR, **training)
        assert ref.losses[-1] < ref.losses[0]
        ref.check(losses, params, where=f"zero1 {opt} {training}")


@pytest.mark.slow
def test_zero_1_stages_in_bf16_mixed_precision_train_like_one_process_under_the_same_policy():
    net, x, y = _net()
    results = run_programs({"mixed": _compiled(net, x, y, mixed=True).program}, inputs=(x,), target=y,
                           optimizer=["sgd", adamw], lr=LR, return_parameters=True)
    for opt, (losses, params) in zip(("sgd", "adamw"), results["mixed"]):
        assert torch.tensor(losses).bfloat16().float().tolist() == losses  # computed in bf16
        assert {t.dtype for t in params.values()} == {torch.float32}  # the fp32 master shards, gathered
        ref = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer=opt, lr=LR,
                          precision="mixed")
        ref.check(losses, params, where=f"mixed {opt}")


@pytest.mark.slow
def test_a_pipelined_zero_1_program_saves_and_resumes_its_sharded_optimizer_state(tmp_path):
    net, x, y = _net()
    compiled = _compiled(net, x, y)
    plain = compile(net, Cluster.local(world_size=4), plan=dataclasses.replace(
        compiled.plan, stages=[dataclasses.replace(st, zero=0) for st in compiled.plan.stages]),
        example_inputs=(x,), example_target=y, loss_fn=F.mse_loss, options=compiled.plan.options)
    programs = {"zero1": compiled.program, "zero0": plain.program}
    check_resumed(*run_on_ranks(resume_programs, world_size=4, args=(programs, (x,), y, str(tmp_path), LR, "zero1"))[0])
