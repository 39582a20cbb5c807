"""fp16 mixed precision with dynamic loss scaling (:mod:`autopar.runtime.scaler`): a model in fp16
under ``Options(mixed_precision=True)``, or any under ``"fp16"``, plans ``"mixed-fp16"``; the program computes in fp16,
scales the loss, unscales into fp32 masters and skips a step whose gradients overflowed on any
rank. The reference is the same policy in one process: the model's fp16 copy with fp32 masters,
its loss scaled by ``torch.amp.GradScaler`` (``run_reference(precision="mixed-fp16")``).

The fast tests run a one-rank program in this process (offloaded, accumulating, resumed from a
checkpoint), equal to the reference (to 1e-6 where it clips: the norm's summation order); the
slow ones train data-parallel (ZeRO 0 and 2), tensor-parallel and pipelined plans on 2 gloo ranks
(SGD and AdamW, clipped) within the policy's measured noise (:mod:`one_process`), and overflow a
gradient on one rank only.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, LossScale, baselines, compile
from autopar.core.errors import AutoparError, CodegenError
from autopar.core.options import Options
from autopar.runtime import checkpoint
from autopar.testing import make_optimizer, run_on_ranks, run_programs, run_reference
from models import ResidualStack
from one_process import adamw, check_sgd_and_adamw, one_process
from resumed import straight_and_resumed

MIXED = Options(mixed_precision=True)
LR = 0.01
OVERFLOWING = LossScale(init=2.0 ** 17, growth_interval=2)  # an fp16 loss's gradient overflows above 65504


def _net():
    torch.manual_seed(0)
    net, x, y = ResidualStack(4, 8, head=8), torch.randn(8, 8), torch.randn(8, 8)
    return net.half(), x.half(), y.half()


def _kw(x, y, options=MIXED):
    return {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss, "options": options}


def test_one_rank_skips_overflowing_steps_and_trains_as_the_policy(one_rank):
    net, x, y = _net()
    compiled = compile(net, Cluster.local(world_size=1), **_kw(x, y))
    assert compiled.plan.precision == "mixed-fp16"
    for opt_name in ("sgd", "adamw"):
        program = compiled.runner(loss_scale=OVERFLOWING)
        assert {p.dtype for p in program.module().parameters()} == {torch.float16}
        opt = make_optimizer(opt_name, program.parameters(), LR)
        losses, stepped, scales = [], [], []
        for _ in range(4):
            opt.zero_grad()
            losses.append(float(program.step((x,), y)))
            program.clip_grad_norm_(0.5)
            stepped.append(program.optimizer_step(opt))
            scales.append(program.loss_scaler.scale)
        # 2**17 and 2**16 overflow (the loss's own gradient), 2**15 steps, twice in a row: it grows
        assert stepped == [False, False, True, True] and scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16]
        want_losses, want = run_reference(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=4, optimizer=opt_name,
                                          lr=LR, precision="mixed-fp16", loss_scale=OVERFLOWING, max_norm=0.5,
                                          return_parameters=True)
        got = program.full_state_dict()
        assert losses == want_losses and losses[0] == losses[1] == losses[2] != losses[3]
        assert {t.dtype for t in got.values()} == {torch.float32}  # the masters
        # equal but for the clipping norm's summation order (torch's foreach norms): 1.5e-8 seen
        assert max(float((got[k] - v).abs().max()) for k, v in want.items()) < 1e-6, opt_name


def test_an_fp32_model_asked_for_fp16_keeps_exact_fp32_masters_and_trains_as_the_policy(one_rank):
    net, x, y = _net()
    net, x, y = net.float(), x.float(), y.float()  # fp32 values (fp16-representable: the test's data)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1e-4 * torch.randn_like(p))  # and not fp16-representable any more
    compiled = compile(net, Cluster.local(world_size=1), **_kw(x, y, Options(mixed_precision="fp16")))
    assert compiled.plan.precision == "mixed-fp16"
    program = compiled.runner(loss_scale=OVERFLOWING)
    assert {p.dtype for p in program.module().parameters()} == {torch.float16}
    assert all(torch.equal(program.full_state_dict()[n], p) for n, p in net.named_parameters())  # not rounded
    opt = make_optimizer("adamw", program.parameters(), LR)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        losses.append(float(program.step((x,), y)))
        program.optimizer_step(opt)
    want_losses, want = run_reference(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=4, optimizer="adamw",
                                      lr=LR, precision="mixed-fp16", loss_scale=OVERFLOWING, return_parameters=True)
    got = program.full_state_dict()
    assert losses == want_losses and all(torch.equal(got[k], v) for k, v in want.items())


def test_scaled_gradients_accumulate_into_offloaded_masters_as_the_policy(one_rank):
    net, x, y = _net()
    kw = _kw(x, y, Options(mixed_precision=True, offload=True))
    cluster = Cluster.local(world_size=1)
    program = compile(net, cluster, plan=baselines.data_parallel(net, cluster, **kw), **kw).runner(
        loss_scale=OVERFLOWING)
    assert program.offload
    opt = make_optimizer("adamw", program.parameters(), LR)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        losses += [float(program.step((x,), y)) for _ in range(2)]  # two backwards per step
        program.optimizer_step(opt)
    want_losses, want = run_reference(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=4, optimizer="adamw",
                                      lr=LR, precision="mixed-fp16", loss_scale=OVERFLOWING, accumulate=2,
                                      return_parameters=True)
    got = program.full_state_dict()
    assert losses == want_losses and all(torch.equal(got[k], v) for k, v in want.items())


def test_gradients_are_unscaled_into_fp32_masters(one_rank):
    net, x, y = _net()
    program = compile(net, Cluster.local(world_size=1), **_kw(x, y)).runner(loss_scale=LossScale(init=1024.0))
    program.step((x,), y)
    assert {p.grad.dtype for p in program.parameters()} == {torch.float32}
    got = program.full_gradients()
    half = copy.deepcopy(net)
    (F.mse_loss(half(x), y) * 1024.0).backward()  # the fp16 copy's scaled backward, by hand
    assert all(torch.equal(got[n], p.grad.float() / 1024) for n, p in half.named_parameters())


def test_a_step_past_the_scaler_or_a_backward_after_unscaling_is_refused(one_rank):
    net, x, y = _net()
    program = compile(net, Cluster.local(world_size=1), **_kw(x, y)).runner()
    opt = make_optimizer("sgd", program.parameters(), LR)
    program.step((x,), y)
    opt.step()  # a bf16 script's bare step: scaled gradients, no overflow check
    with pytest.raises(CodegenError, match=r"instead of opt.step\(\)"):
        program.step((x,), y)
    program = compile(net, Cluster.local(world_size=1), **_kw(x, y)).runner()
    program.step((x,), y)
    program.clip_grad_norm_(1.0)  # unscales: a further backward would add scaled gradients to them
    with pytest.raises(CodegenError, match="already unscaled"):
        program.step((x,), y)


def test_a_checkpoint_keeps_the_loss_scale_and_resumes_exactly(one_rank, tmp_path):
    net, x, y = _net()
    compiled = compile(net, Cluster.local(world_size=1), **_kw(x, y))
    # the default scale 2**16 overflows the fp16 loss's gradient once: a run restarted at 2**16 would skip again
    straight, resumed = straight_and_resumed(compiled, (x,), y, tmp_path / "ckpt", lr=LR)
    assert checkpoint.read_meta(tmp_path / "ckpt")["loss_scale"] == {"scale": 2.0 ** 15, "growth_tracker": 1}
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_loss_scale_out_of_range_is_a_typed_error():
    with pytest.raises(AutoparError, match="backoff_factor"):
        LossScale(backoff_factor=2.0)


def test_verify_measures_an_fp16_step_as_predicted_like_bf16():
    torch.manual_seed(0)
    net, x, y = ResidualStack(2, 64, head=64), torch.randn(16, 64), torch.randn(16, 64)
    n = sum(p.numel() for p in net.parameters())
    ratios = {}
    for name, model, xs, ys in (("bf16", net, x, y), ("fp16", copy.deepcopy(net).half(), x.half(), y.half())):
        cluster = Cluster.local(world_size=2)
        plan = baselines.data_parallel(model, cluster, **_kw(xs, ys))
        assert plan.precision == {"bf16": "mixed", "fp16": "mixed-fp16"}[name]
        verification = compile(model, cluster, plan=plan, **_kw(xs, ys)).verify()
        assert verification.ok, verification.table()
        rank = verification.ranks[0]
        predicted, measured = rank.predicted.memory, rank.measured.memory
        assert predicted["parameters"] == measured["parameters"] == 2 * n  # fp16 / bf16 weights
        assert predicted["optimizer"] == 12 * n  # fp32 master + two fp32 moments
        assert predicted["gradients"] == measured["gradients"] == 4 * n  # the masters' fp32 gradients
        ratios[name] = rank.peak_ratio
    assert ratios["fp16"] == ratios["bf16"], ratios


@pytest.mark.slow
def test_fp16_plans_on_two_ranks_train_like_one_process_under_the_same_policy():
    net, x, y = _net()
    cluster = Cluster.local(world_size=2)
    kw = _kw(x, y)
    plans = {"dp": baselines.data_parallel(net, cluster, **kw),
             "dp-zero2": baselines.data_parallel(net, cluster, zero=2, **kw),
             "pp": baselines.megatron(net, cluster, tp=1, pp=2, micro_batches=2,
                                      **_kw(x, y, Options(mixed_precision=True, pipeline=True)))}
    # tensor parallel where memory forces it (on this cluster the tiny model's tp plan is replicated)
    fsdp = baselines.fsdp(net, cluster, **kw).predicted_peak_memory
    free_tp = baselines.megatron(net, cluster, tp=2, **kw).predicted_peak_memory
    tight = dataclasses.replace(cluster, device_memory=(free_tp + fsdp) / 2)
    plans["tp"] = baselines.megatron(net, tight, tp=2, **_kw(x, y, Options(mixed_precision=True, memory_fraction=1.0)))
    assert {p.precision for p in plans.values()} == {"mixed-fp16"} and plans["pp"].stages
    programs = {name: compile(net, cluster, plan=plan, **kw) for name, plan in plans.items()}
    assert "autopar_all_gather" in programs["tp"].code(0)  # sharded weights
    training = {"max_norm": 0.5, "loss_scale": LossScale(init=2.0 ** 12, growth_interval=1)}
    results = run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True,
                           **training)
    for per_optimizer in results.values():
        for losses, params in per_optimizer:
            assert torch.tensor(losses).half().float().tolist() == losses  # computed in fp16
            assert {t.dtype for t in params.values()} == {torch.float32}  # the masters
    check_sgd_and_adamw(results, net, inputs=(x,), target=y, loss_fn=F.mse_loss, lr=LR, precision="mixed-fp16",
                        **training)


def _overflow_on_rank_1(programs, x, y):
    """Each program trained 4 SGD steps from :data:`OVERFLOWING`, an inf put into a gradient on
    rank 1 only before the 4th step: per program this rank's (losses, stepped, scales, params)."""
    import torch.distributed as dist

    out = {}
    for name, program in programs.items():
        program.start(loss_scale=OVERFLOWING)
        opt = torch.optim.SGD(program.parameters(), lr=LR)
        record = ([], [], [])
        for i in range(4):
            opt.zero_grad()
            record[0].append(float(program.step((x,), y)))
            if i == 3 and dist.get_rank() == 1:
                next(p for p in program.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
            record[1].append(program.optimizer_step(opt))
            record[2].append(program.loss_scaler.scale)
        out[name] = (*record, program.full_state_dict())
        program.reset()
    return out


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_and_backs_off():
    net, x, y = _net()
    cluster = Cluster.local(world_size=2)
    programs = {"dp-zero2": compile(net, cluster, plan=baselines.data_parallel(net, cluster, zero=2, **_kw(x, y)),
                                    **_kw(x, y)).program,
                "fsdp": compile(net, cluster, plan=baselines.fsdp(net, cluster, **_kw(x, y)), **_kw(x, y)).program}
    pipelined = _kw(x, y, Options(mixed_precision=True, pipeline=True))
    programs["pp"] = compile(net, cluster, plan=baselines.megatron(net, cluster, tp=1, pp=2, micro_batches=2,
                                                                   **pipelined), **pipelined).program
    per_rank = run_on_ranks(_overflow_on_rank_1, world_size=2, args=(programs, x, y))
    ref = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer="sgd", lr=LR,
                      precision="mixed-fp16", loss_scale=OVERFLOWING)
    for name in programs:
        for rank in (0, 1):
            losses, stepped, scales, params = per_rank[rank][name]
            # 2**17, 2**16 overflow everywhere; 2**15 steps; then rank 1's inf (pp: stage 1's) skips it on both
            assert stepped == [False, False, True, False], (name, rank)
            assert scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 14], (name, rank)
            ref.check(losses[:3], params, where=f"{name} rank {rank}")  # the 4th step changed nothing
