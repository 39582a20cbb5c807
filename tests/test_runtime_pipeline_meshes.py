"""Pipelined plans whose stages have different sub-meshes (Alpa's space, ``stage_meshes="any"``)
train like one process: GPT-2 (8 layers; its embedding, tied to the head, held by the first and
the last stage) cut into two stages of four layers, built by hand from the planner's stage table
(:func:`unequal_plan`):

- 3 ranks: stage 0 on one device, stage 1 on ``(dp=2, tp=1)`` (ranks go largest stage first:
  stage 1 on ranks 0 and 1, stage 0 on rank 2), so one sender feeds two receivers their halves
  of the micro-batch;
- 4 ranks: stage 0 on ``(2, 1)``, stage 1 on ``(1, 2)`` with the least-memory tp plan (weights
  split over tp), so each receiver gathers the micro-batch from two senders; and three stages of
  3, 3 and 2 layers on one device, ``(2, 1)`` and one device, the middle one passing the labels
  and the attention mask on.

GPipe and 1F1B, SGD, 3 steps, gradients clipped to half the first step's norm: losses and final
parameters equal the one-process run (:mod:`one_process`). Under bf16 mixed precision a residual
MLP on 3 ranks (one device, then a ZeRO-1 stage on ``(2, 1)``) equals one process under the same
policy. A checkpoint of the 4-rank pipeline (the tied embedding saved once, by its first stage)
resumes it exactly and loads into a data-parallel program.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.core.crossmesh import pieces, transfers
from autopar.core.options import Options
from autopar.core.placement import Replicate, Shard
from autopar.passes.capture.training import capture_for_training
from autopar.runtime import checkpoint
from autopar.runtime.pipeline import PipelineProgram
from autopar.testing import run_on_ranks, run_programs
from models import ResidualStack
from one_process import one_process

pytest.importorskip("transformers")

R = Replicate()
LR = 0.01


def unequal_choice(captured, *, world: int, stages, batches: int = 2, candidate: str = "megatron", **options):
    """The pipeline model of ``captured`` on ``world`` local ranks and a choice of stages on it:
    ``stages`` lists per stage ``(units, dp, tp, zero, recompute)``, ``candidate`` the stage
    planner's tp plan."""
    from autopar.planner.inter import Choice
    from autopar.planner.pipeline_model import build_model
    from autopar.planner.stage_table import Config

    model = build_model(captured, Cluster.local(world_size=world), Options(pipeline=True, recompute=False, **options),
                        units=len(captured.layers), any_microbatch=True)
    chosen, times, start = [], [], 0
    for units, dp, tp, zero, recompute in stages:
        model.ensure_candidates(tp)
        cfg = Config(dp, tp, model.candidate_names[tp][candidate], zero, recompute)
        arrays = model.arrays(cfg, model.microbatch(dp, batches), batches)
        chosen.append((start, start + units - 1, dp * tp, cfg))
        times.append(float(arrays.time[start, start + units - 1]))
        start += units
    latency = (batches - 1) * max(times) + sum(times)
    return model, Choice(chosen, batches, latency, times, 0.0, "by hand")


def unequal_plan(captured, **kw):
    """The Plan of :func:`unequal_choice`."""
    from autopar.planner.pipeline_plan import build_pipeline_plan

    return build_pipeline_plan(*unequal_choice(captured, **kw), name="unequal", solve_time=0.0)


@pytest.fixture(scope="module")
def gpt2():
    model, (args, kwargs) = zoo.gpt2(layers=8, hidden=16, batch=4)
    inputs = {"input_ids": args[0], "labels": kwargs["labels"].clone()}
    return model, capture_for_training(model, example_inputs=inputs), inputs


def _half_first_norm(model, inputs) -> float:
    model.zero_grad()
    model(**inputs).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    model.zero_grad()
    return norm / 2


def _train_and_check(gpt2, programs):
    model, _, inputs = gpt2
    max_norm = _half_first_norm(model, inputs)
    results = run_programs(programs, inputs=inputs, optimizer="sgd", lr=LR, return_parameters=True,
                           max_norm=max_norm)
    ref = one_process(model, inputs=inputs, steps=3, optimizer="sgd", lr=LR, max_norm=max_norm)
    assert ref.losses[-1] < ref.losses[0]
    for label, (losses, params) in results.items():
        ref.check(losses, params, where=label)


def test_blocks_cover_each_receiver_once_and_spread_over_replicas():
    # (2, 1) on ranks 0, 1 -> (1, 2) on ranks 2, 3: each receiver takes a half from each sender
    fwd = transfers((4, 3), (Shard(0), R), (2, 1), (0, 1), (R, R), (1, 2), (2, 3))
    assert [(t.src, t.dst, t.starts, t.stops) for t in fwd] == [
        (0, 2, (0, 0), (2, 3)), (1, 2, (2, 0), (4, 3)), (0, 3, (0, 0), (2, 3)), (1, 3, (2, 0), (4, 3))]
    # gradients back: both receivers hold the whole gradient, the senders' halves come one from each
    back = transfers((4, 3), (R, R), (1, 2), (2, 3), (Shard(0), R), (2, 1), (0, 1))
    assert [(t.src, t.dst, t.starts, t.stops) for t in back] == [(2, 0, (0, 0), (2, 3)), (3, 1, (2, 0), (4, 3))]
    # equal meshes: the rank at the same coordinate, its whole piece
    same = transfers((4, 3), (Shard(0), R), (2, 2), (0, 1, 2, 3), (Shard(0), R), (2, 2), (4, 5, 6, 7))
    assert [(t.src, t.dst) for t in same] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    held = pieces((4, 3), (Shard(0), R), (2, 2), (0, 1, 2, 3))
    assert all(t.cuts(held[t.src]) == () for t in same)


def test_boundaries_are_split_on_each_stage_own_data_parallel_axis(gpt2):
    model, captured, _ = gpt2
    plan = unequal_plan(captured, world=3, stages=[(4, 1, 1, 0, False), (4, 2, 1, 0, False)])
    assert [(st.ranks, st.mesh_shape) for st in plan.stages] == [((2,), (1, 1)), ((0, 1), (2, 1))]
    program = PipelineProgram(captured, plan, model=model)
    first, second = program._stages
    hidden = next(b for b in first.outputs if b.requires_grad)
    got = {b.name: b for b in second.inputs}[hidden.name]
    assert hidden.sharding == (R, R) and got.sharding == (Shard(0), R)  # the batch split on stage 1's dp
    blocks = program.links[0][first.outputs.index(hidden)]
    assert [(t.src, t.dst) for t in blocks.forward] == [(2, 0), (2, 1)]  # halves of the micro-batch
    assert [(t.src, t.dst) for t in blocks.backward] == [(0, 2), (1, 2)]


def test_the_plan_prices_a_send_to_another_mesh_as_the_runtime_moves_it(gpt2):
    from autopar.planner.pipeline_plan import build_pipeline_plan, cross_mesh_excess

    _, captured, _ = gpt2
    # one sender feeding two receivers their halves sends its piece once: what the search priced
    model, choice = unequal_choice(captured, world=3, stages=[(4, 1, 1, 0, False), (4, 2, 1, 0, False)])
    assert cross_mesh_excess(model, choice) == [0.0, 0.0]
    # each (2, 1) sender sends its half to both tp ranks, each of which takes the whole micro-batch:
    # twice the sender's piece, one more message, forward and backward
    model, choice = unequal_choice(captured, world=4, stages=[(4, 2, 1, 0, False), (4, 1, 2, 0, False)],
                                   candidate="lean")
    piece = model.range_costs(1, model.microbatch(2, 2), choice.stages[0][3].candidate).boundary
    extra = 2 * (piece / model.link.bandwidth + model.link.latency)
    assert cross_mesh_excess(model, choice) == [pytest.approx(extra), 0.0]
    plan = build_pipeline_plan(model, choice, name="unequal", solve_time=0.0)
    times = [choice.stage_times[0] + extra, choice.stage_times[1]]
    assert [st.time for st in plan.stages] == pytest.approx(times)
    assert plan.predicted_step_time == pytest.approx(max(times) + sum(times))  # 2 micro-batches


def test_records_and_verify_count_the_blocks_each_rank_sends_between_unequal_meshes(gpt2):
    model, captured, inputs = gpt2
    # (2, 1) -> (1, 2), tp weights split: each sender sends its half of the micro-batch to both tp
    # ranks, so its hidden state leaves it twice per micro-batch; the gradient goes back as one
    # half from each tp rank (rank 2 to rank 0, rank 3 to rank 1)
    plan = unequal_plan(captured, world=4, stages=[(4, 2, 1, 0, False), (4, 1, 2, 0, False)], candidate="lean")
    compiled = compile(model, Cluster.local(world_size=4), example_inputs=inputs, plan=plan)
    program = compiled.program
    hidden = next(b for b in program._stages[0].outputs if b.requires_grad)
    piece = math.prod(hidden.local_shape((2, 1))) * 4
    for stage, phase in ((0, "forward"), (1, "backward")):
        sends = [r for r in compiled.plan.stages[stage].collective_records
                 if r.kind == "send_recv" and r.node == hidden.name and r.phase == phase]
        assert [r.nbytes for r in sends] == [piece] * (2 if phase == "forward" else 1) * plan.micro_batches, phase
    report = compiled.verify()
    for r in report.ranks:
        assert r.collective_diff() == (Counter(), Counter()), r.measured.stage


@pytest.mark.slow
def test_one_device_then_two_data_parallel_ranks_train_like_one_process(gpt2):
    model, captured, _ = gpt2
    plain = PipelineProgram(captured, unequal_plan(captured, world=3, stages=[(4, 1, 1, 0, False),
                                                                             (4, 2, 1, 0, False)]), model=model)
    zero = PipelineProgram(captured, unequal_plan(captured, world=3, stages=[(4, 1, 1, 0, True),
                                                                            (4, 2, 1, 1, False)]), model=model)
    _train_and_check(gpt2, {"1+dp2 gpipe": plain.with_schedule("gpipe"), "1+dp2 1f1b": plain.with_schedule("1f1b"),
                            "1 recompute + dp2 zero1 1f1b": zero.with_schedule("1f1b")})


@pytest.mark.slow
def test_four_ranks_data_then_tensor_parallel_and_three_stages_train_like_one_process(gpt2):
    model, captured, _ = gpt2
    plan = unequal_plan(captured, world=4, stages=[(4, 2, 1, 0, False), (4, 1, 2, 0, False)], candidate="lean")
    assert [(st.ranks, st.mesh_shape) for st in plan.stages] == [((0, 1), (2, 1)), ((2, 3), (1, 2))]
    wte = "transformer.wte.weight"
    assert plan.stages[1].parameter_placements[wte] != plan.stages[0].parameter_placements[wte]
    zero3 = unequal_plan(captured, world=4, stages=[(4, 2, 1, 3, False), (4, 1, 2, 0, False)], candidate="lean")
    three = unequal_plan(captured, world=4, stages=[(3, 1, 1, 0, False), (3, 2, 1, 0, False), (2, 1, 1, 0, False)])
    assert [st.mesh_shape for st in three.stages] == [(1, 1), (2, 1), (1, 1)]
    program = PipelineProgram(captured, plan, model=model)
    _train_and_check(gpt2, {"dp2+tp2 gpipe": program.with_schedule("gpipe"),
                            "dp2+tp2 1f1b": program.with_schedule("1f1b"),
                            "dp2 zero3+tp2 1f1b": PipelineProgram(captured, zero3, model=model).with_schedule("1f1b"),
                            "1+dp2+1 1f1b": PipelineProgram(captured, three, model=model).with_schedule("1f1b")})


@pytest.mark.slow
def test_a_mixed_precision_pipeline_of_unequal_stages_trains_like_one_process_under_the_policy():
    torch.manual_seed(0)
    net, x, y = ResidualStack(4, 8, head=8), torch.randn(8, 8), torch.randn(8, 8)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    captured = capture_for_training(net, mixed_precision=True, **kw)
    plan = unequal_plan(captured, world=3, stages=[(2, 1, 1, 0, False), (2, 2, 1, 1, False)], mixed_precision=True,
                        schedule="1f1b")
    assert plan.precision == "mixed" and [st.mesh_shape for st in plan.stages] == [(1, 1), (2, 1)]
    run = dict(optimizer="sgd", lr=0.5, max_norm=1.0)
    losses, params = run_programs({"bf16": compile(net, Cluster.local(world_size=3), plan=plan, **kw)}, inputs=(x,),
                                  target=y, return_parameters=True, **run)["bf16"]
    ref = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, precision="mixed", **run)
    assert ref.losses[-1] < ref.losses[0]
    assert {t.dtype for t in params.values()} == {torch.float32}  # the masters
    assert torch.tensor(losses).bfloat16().float().tolist() == losses  # computed in bf16
    ref.check(losses, params, where="bf16 1+dp2 zero1 1f1b")


def _save_resume_and_load(pipe, other, inputs, path):
    """Train ``pipe`` a step, save, train another; resume a copy from the checkpoint and train the
    same step; load the checkpoint into ``other``. Returns the largest differences."""
    torch.manual_seed(0)
    pipe.start()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.step(inputs)
    opt.step()
    opt.zero_grad()
    saved = pipe.full_state_dict()
    checkpoint.save(pipe, path, optimizer=opt, step=1)
    pipe.step(inputs)
    opt.step()
    uninterrupted = pipe.full_state_dict()
    resumed = pipe.with_schedule("gpipe").start(checkpoint=path)
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    checkpoint.load(resumed, path, optimizer=opt)
    resumed.step(inputs)
    opt.step()
    again = resumed.full_state_dict()
    loaded = other.start(checkpoint=path).full_state_dict()
    return (max(float((again[k] - uninterrupted[k]).abs().max()) for k in again),
            max(float((loaded[k] - saved[k]).abs().max()) for k in loaded))


@pytest.mark.slow
def test_a_checkpoint_of_unequal_stages_resumes_exactly_and_loads_into_another_plan(gpt2, tmp_path):
    model, captured, inputs = gpt2
    plan = unequal_plan(captured, world=4, stages=[(4, 2, 1, 0, False), (4, 1, 2, 0, False)], candidate="lean")
    four = Cluster.local(world_size=4)
    dp = compile(model, four, example_inputs=inputs, plan=baselines.data_parallel(model, four, example_inputs=inputs))
    got = run_on_ranks(_save_resume_and_load, world_size=4,
                       args=(PipelineProgram(captured, plan, model=model), dp.program, inputs, str(tmp_path / "ck")))
    assert got == [(0.0, 0.0)] * 4
