"""Mixed precision as planned (:mod:`autopar.runtime.mixed`): under ``Options(mixed_precision=True)``
the program is the model's bf16 copy (parameters, activations and what collectives move are
bf16), the user's optimizer steps fp32 masters, checkpoints hold the masters, and ``verify``
measures the step in that precision. Runs are compared with one process running the same policy
(``run_reference(precision="mixed")``) within that policy's measured noise (:mod:`one_process`).

The fast tests run a one-rank program in this process (gloo on an in-memory store); the slow
one trains data-parallel, FSDP, tensor-parallel and pipelined plans on 2 gloo ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines, compile, zoo
from autopar.core.errors import CodegenError
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.plan.assignment import assignment_of
from autopar.runtime import DistributedProgram, checkpoint
from autopar.testing import make_optimizer, run_programs, run_reference
from models import ResidualStack, TiedBatchNorm, TinyTransformer
from one_process import one_process
from resumed import straight_and_resumed

MIXED = Options(mixed_precision=True)
LR = 0.01


def _net():
    torch.manual_seed(0)
    return ResidualStack(4, 8, head=8), torch.randn(8, 8), torch.randn(8, 8)


def test_mixed_capture_is_the_bf16_copys_graph_and_leaves_the_model_fp32():
    pytest.importorskip("transformers")
    model, (args, kwargs) = zoo.llama(layers=2, hidden=16, ffn=32, batch=2)
    inputs = {"input_ids": args[0], **kwargs}
    captured = capture_for_training(model, example_inputs=inputs, mixed_precision=True)
    assert {m.dtype for m in captured.parameters.values()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the stand-ins are gone
    # LlamaRMSNorm upcasts to float32 and casts back to its input's dtype: as the bf16 model does
    casts = [n.meta["val"].dtype for n in captured.graph_module.graph.nodes
             if n.target is torch.ops.aten._to_copy.default]
    assert torch.float32 in casts and torch.bfloat16 in casts
    plan = compile(model, Cluster.local(world_size=2), example_inputs=inputs, options=MIXED).plan
    assert plan.precision == "mixed"


def test_a_mixed_llama_program_computes_what_its_bf16_copy_computes(one_rank):
    pytest.importorskip("transformers")
    model, (args, kwargs) = zoo.llama(layers=2, hidden=16, ffn=32, batch=2)
    inputs = {"input_ids": args[0], **kwargs}
    program = compile(model, Cluster.local(world_size=1), example_inputs=inputs, options=MIXED).runner()
    loss = program.step(inputs)
    assert loss.dtype == torch.float32  # HF upcasts the logits for the loss, as the bf16 copy does
    assert float(loss) == run_reference(model, inputs=inputs, steps=1, precision="mixed")[0]
    assert float(loss) != run_reference(model, inputs=inputs, steps=1)[0]


def test_a_mixed_program_runs_in_bf16_and_steps_fp32_masters_like_one_process(one_rank):
    net, x, y = _net()
    compiled = compile(net, Cluster.local(world_size=1), example_inputs=(x,), example_target=y, loss_fn=F.mse_loss,
                       options=MIXED)
    program = compiled.runner()
    module = program.module()
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    masters = list(program.parameters())
    assert {p.dtype for p in masters} == {torch.float32}
    assert torch.equal(program.full_state_dict()["blocks.0.fc.weight"], net.blocks[0].fc.weight)  # not rounded
    for opt_name in ("sgd", "adamw"):
        program.start()
        opt = make_optimizer(opt_name, program.parameters(), LR)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = program.step((x,), y)
            assert loss.dtype == torch.bfloat16
            assert all(p.grad is None for p in program.module().parameters())  # moved to the masters
            assert all(p.grad.dtype == torch.float32 for p in program.parameters())
            losses.append(float(loss))
            opt.step()
        ref = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer=opt_name, lr=LR,
                          precision="mixed")
        assert ref.losses[-1] < ref.losses[0]
        ref.check(losses, program.full_state_dict(), where=opt_name)
        # the fp32 run differs by far more than the band: the check sees the precision
        fp32 = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer="sgd", lr=LR)
        assert fp32.mismatches(losses)


@pytest.mark.parametrize("make", [TiedBatchNorm, lambda: TinyTransformer(tie=True, rms=True)],
                         ids=["tied-batchnorm", "tied-rms-transformer"])
def test_one_rank_trains_tied_weights_and_buffers_exactly_as_the_policy(one_rank, make):
    torch.manual_seed(0)
    model = make()
    batch = (8,) if isinstance(model, TiedBatchNorm) else (2, 6)
    inputs = (torch.randint(0, 16, batch), torch.randint(0, 16, batch))
    program = compile(model, Cluster.local(world_size=1), example_inputs=inputs, options=MIXED).runner()
    opt = make_optimizer("sgd", program.parameters(), 0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(float(program.step(inputs)))
        opt.step()
    want_losses, want = run_reference(model, inputs=inputs, steps=3, lr=0.1, precision="mixed", return_parameters=True)
    got = program.full_state_dict()
    assert losses == want_losses
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())  # buffers stay bf16


def test_a_checkpoint_holds_the_fp32_masters_and_resumes_exactly(one_rank, tmp_path):
    net, x, y = _net()
    compiled = compile(net, Cluster.local(world_size=1), example_inputs=(x,), example_target=y, loss_fn=F.mse_loss,
                       options=MIXED)
    straight, resumed = straight_and_resumed(compiled, (x,), y, tmp_path / "ckpt", lr=LR)
    dtypes = {d["dtype"] for fqn, d in checkpoint.read_meta(tmp_path / "ckpt")["tensors"].items()}
    assert dtypes == {"float32"}
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_verify_measures_a_mixed_step_in_bf16_with_fp32_masters():
    torch.manual_seed(0)
    net, x, y = ResidualStack(2, 64, head=64), torch.randn(16, 64), torch.randn(16, 64)
    n = sum(p.numel() for p in net.parameters())
    compiled = compile(net, Cluster.local(world_size=2), example_inputs=(x,), example_target=y, loss_fn=F.mse_loss,
                       plan=baselines.data_parallel(net, Cluster.local(world_size=2), example_inputs=(x,),
                                                    example_target=y, loss_fn=F.mse_loss, options=MIXED))
    rank = compiled.verify().ranks[0]
    predicted, measured = rank.predicted.memory, rank.measured.memory
    assert predicted["parameters"] == measured["parameters"] == 2 * n  # bf16 weights
    steps = 4 * len(list(net.parameters()))  # AdamW's fp32 step count per parameter
    assert predicted["optimizer"] == 12 * n and measured["optimizer"] == 12 * n + steps  # master + 2 moments
    # gradients move in bf16 (2 bytes, as priced) but the optimizer steps with fp32 master
    # gradients: 4 bytes at the step (ZeRO's 2 + 2 + 12 leaves them out), and the plan counts them
    assert predicted["gradients"] == measured["gradients"] == 4 * n
    # the gradient all-reduces carry bf16, as the plan prices them
    sums = sorted(c.nbytes for c in rank.measured.collectives if c.phase == "backward")
    assert sums == sorted(r[2] for r in rank.predicted.collectives if r[3] == "backward")
    assert sum(sums) == 2 * n


def test_a_mixed_program_of_an_fp32_capture_is_refused():
    net, x, y = _net()
    kw = {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss}
    plan = baselines.data_parallel(net, Cluster.local(world_size=2), options=MIXED, **kw)
    captured = capture_for_training(net, **kw)  # fp32: its explicit dtypes are not the bf16 copy's
    with pytest.raises(CodegenError, match="mixed_precision=True"):
        DistributedProgram(captured, assignment_of(plan, captured), model=net, precision="mixed")


def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr)


@pytest.mark.slow
def test_mixed_plans_on_two_ranks_train_like_one_process_under_the_same_policy():
    net, x, y = _net()
    cluster = Cluster.local(world_size=2)
    kw = {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss}
    plans = {"dp": baselines.data_parallel(net, cluster, options=MIXED, **kw),
             "fsdp": baselines.fsdp(net, cluster, options=MIXED, **kw),
             "pp": baselines.megatron(net, cluster, tp=1, pp=2, micro_batches=2,
                                      options=Options(mixed_precision=True, pipeline=True), **kw)}
    # tensor parallel where memory forces it (on this cluster the tiny model's tp plan is replicated)
    free_tp = baselines.megatron(net, cluster, tp=2, options=MIXED, **kw).predicted_peak_memory
    tight = dataclasses.replace(cluster, device_memory=(free_tp + plans["fsdp"].predicted_peak_memory) / 2)
    plans["tp"] = baselines.megatron(net, tight, tp=2, options=Options(mixed_precision=True, memory_fraction=1.0),
                                     **kw)
    assert {p.precision for p in plans.values()} == {"mixed"}
    assert plans["pp"].stages
    programs = {name: compile(net, cluster, plan=plan, **kw) for name, plan in plans.items()}
    assert all("autopar_all_gather" in programs[name].code(0) for name in ("fsdp", "tp"))  # sharded weights
    results = run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True)
    for opt, i in (("sgd", 0), ("adamw", 1)):
        ref = one_process(net, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer=opt, lr=LR,
                          precision="mixed")
        assert ref.losses[-1] < ref.losses[0]
        for name, per_optimizer in results.items():
            losses, params = per_optimizer[i]
            assert {t.dtype for t in params.values()} == {torch.float32}  # the masters
            assert torch.tensor(losses).bfloat16().float().tolist() == losses  # computed in bf16
            ref.check(losses, params, where=f"{name} {opt}")
