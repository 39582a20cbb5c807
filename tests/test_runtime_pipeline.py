"""Pipelined plans (autopar.baselines.megatron with pp=2 or 4) run by autopar's pipeline schedule
(:mod:`autopar.runtime.schedule`) on gloo ranks and train like one process: GPT-2 (8 layers, tied
embedding and head in the first and last stage) and a tiny LLaMA (grouped-query attention, rotary
tables built in the first stage and read by every layer), GPipe and 1F1B, SGD and AdamW, 3 steps;
losses and final parameters equal the unmodified model's (:mod:`one_process`).

One spawn per world size trains every configuration in turn (autopar.testing.run_programs).
Both models take the same token batch (batch 4, sequence 8, vocabulary 128).

SGD (rate 1e-2) runs are compared with the one-process fp32 run at rtol 1e-5 / atol 1e-6.
AdamW (a tenth of SGD's rate) turns rounding differences in small gradients (micro-batch sums,
tensor-parallel partial sums) into differences in the step, so its losses and parameters are
compared with a float64 one-process run within fp32's own measured noise, as in the zoo plan
matrix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.core.errors import PipelineError
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.plan.split import loss_split
from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.schedule import in_flight, order
from autopar.testing import run_programs
from models import Residual, ResidualStack
from one_process import one_process

pytest.importorskip("transformers")

SIZES = {"gpt2": dict(layers=8, hidden=16, batch=4), "llama": dict(layers=2, hidden=16, ffn=32, batch=4)}
LR = 0.01


def adamw(params, lr):
    """AdamW at a tenth of SGD's rate (module docstring)."""
    return torch.optim.AdamW(params, lr=lr / 10)


OPTIMIZERS = ("sgd", adamw)


class TokenMLP(nn.Module):
    """Embedding, four identical residual blocks, head; its loss is cross entropy written as a
    mean of picked log-probabilities (``aten.mean``: a mean over the batch, not sum / count)."""

    def __init__(self, vocab: int = 128, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Residual(hidden) for _ in range(4))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        picked = self.head(h).log_softmax(-1).gather(-1, labels.unsqueeze(-1))
        return -picked.mean()


@pytest.fixture(scope="module")
def setup(memo_capture):
    """Models, their captures and the token batch; every planner and compile call of the module
    captures a model once (conftest's ``memo_capture``)."""
    models, captured = {}, {}
    for name, sizes in SIZES.items():
        models[name], (args, kwargs) = getattr(zoo, name)(**sizes)
        if name == "gpt2":
            inputs = {"input_ids": args[0], "labels": kwargs["labels"].clone()}
        captured[name] = capture_for_training(models[name], example_inputs=inputs)
    torch.manual_seed(0)
    models["mlp"] = TokenMLP()
    captured["mlp"] = capture_for_training(models["mlp"], example_inputs=inputs)
    return models, captured, inputs


def _plan(models, inputs, name, *, world, tp=1, pp=2, dp=1, micro_batches=2, schedule="gpipe"):
    return baselines.megatron(models[name], Cluster.local(world_size=world), example_inputs=inputs, tp=tp,
                              pp=pp, dp=dp, micro_batches=micro_batches,
                              options=Options(pipeline=True, schedule=schedule))


def _sharded_plan(captured, *, world=4, tp=2, pp=2, micro_batches=2):
    """``pp`` equal stages on ``(1, tp)`` meshes, each with the stage planner's least-memory tp
    plan: parameters and activations split over tp. (On this CPU cluster the Megatron-restricted
    plan of such a tiny model keeps almost everything replicated: the collectives cost more than
    the matmuls they would split.)"""
    from autopar.planner.inter import evaluate_uniform
    from autopar.planner.pipeline_model import build_model
    from autopar.planner.pipeline_plan import build_pipeline_plan

    options = Options(pipeline=True, recompute=False)
    model = build_model(captured, Cluster.local(world_size=world), options, units=len(captured.layers),
                        any_microbatch=True)
    choice = evaluate_uniform(model, tp=tp, pp=pp, batches=micro_batches, zero=0, recompute=False,
                              candidate="lean")
    return build_pipeline_plan(model, choice, name="lean tp", solve_time=0.0)


def _programs(setup, world, configs, schedules=("gpipe", "1f1b")):
    """{label: program}: each config under each schedule (one split, several schedules)."""
    models, captured, inputs = setup
    out = {}
    for label, name, kw in configs:
        plan = _sharded_plan(captured[name], **kw) if "tp" in kw else _plan(models, inputs, name, world=world, **kw)
        program = PipelineProgram(captured[name], plan, model=models[name])
        for schedule in schedules:
            out[f"{label} {schedule}"] = program.with_schedule(schedule)
    return out


def _check(results, models, cases):
    """Compare each result (labelled "<model> ...") with its model trained in one process on
    ``cases[model] = (inputs, target, loss_fn)`` (:mod:`one_process`)."""
    names = {label.split()[0] for label in results}
    refs = {(name, opt): one_process(models[name], inputs=cases[name][0], target=cases[name][1],
                                     loss_fn=cases[name][2], steps=3, optimizer=opt, lr=LR)
            for name in names for opt in OPTIMIZERS}
    for label, per_optimizer in results.items():
        name = label.split()[0]
        for opt, (losses, params) in zip(OPTIMIZERS, per_optimizer):
            ref = refs[(name, opt)]
            assert ref.losses[-1] < ref.losses[0]
            ref.check(losses, params, where=f"{label} {getattr(opt, '__name__', opt)}")


@pytest.mark.slow
def test_two_stages_on_two_ranks_train_like_one_process(setup):
    models, captured, inputs = setup
    programs = _programs(setup, 2, [("llama pp2", "llama", {}), ("mlp pp2", "mlp", {})])
    assert programs["mlp pp2 gpipe"].loss_split.kind == "mean"  # each micro-batch's loss counts 1/2
    # the compile(plan=...) path: compiled.program is a PipelineProgram
    compiled = compile(models["gpt2"], Cluster.local(world_size=2), example_inputs=inputs,
                       plan=_plan(models, inputs, "gpt2", world=2))
    assert isinstance(compiled.program, PipelineProgram)
    programs["gpt2 pp2 gpipe"] = compiled
    programs["gpt2 pp2 1f1b"] = compiled.program.with_schedule("1f1b")
    # the tied weight is held by both stages; the loss divides by the whole batch's count
    assert compiled.program.loss_split.kind == "count"
    assert "p_transformer_wte_weight" in compiled.program.code(0)
    assert "p_transformer_wte_weight" in compiled.program.code(1)
    # a model with a separate loss_fn and target: 4 micro-batches of 2 samples under 1F1B
    torch.manual_seed(0)
    net, x, y = ResidualStack(4, 8, head=5), torch.randn(8, 8), torch.randint(0, 5, (8,))
    ce = nn.functional.cross_entropy
    plan = baselines.megatron(net, Cluster.local(world_size=2), example_inputs=(x,), example_target=y, loss_fn=ce,
                              tp=1, pp=2, micro_batches=4, options=Options(pipeline=True, schedule="1f1b"))
    with_target = compile(net, Cluster.local(world_size=2), example_inputs=(x,), example_target=y, loss_fn=ce,
                          plan=plan)
    programs["net pp2 1f1b B4"] = (with_target, (x,), y)
    results = run_programs(programs, inputs=inputs, optimizer=list(OPTIMIZERS), lr=LR, return_parameters=True)
    cases = {name: (inputs, None, None) for name in models}
    _check(results, {**models, "net": net}, {**cases, "net": ((x,), y, ce)})


@pytest.mark.slow
def test_two_stages_with_tensor_or_data_parallelism_and_four_stages_on_four_ranks(setup):
    # each configuration under one schedule (both schedules run every configuration of the 2-rank test)
    programs = {**_programs(setup, 4, [("gpt2 pp2 tp2", "gpt2", dict(tp=2)), ("llama pp2 dp2", "llama", dict(dp=2))],
                            schedules=("gpipe",)),
                **_programs(setup, 4, [("gpt2 pp2 dp2", "gpt2", dict(dp=2)), ("llama pp2 tp2", "llama", dict(tp=2))],
                            schedules=("1f1b",))}
    # four stages: 1F1B would need 4 micro-batches of one sample, which trace differently
    programs.update(_programs(setup, 4, [("gpt2 pp4", "gpt2", dict(pp=4))], schedules=("gpipe",)))
    tp = programs["gpt2 pp2 tp2 gpipe"]
    assert tp.plan.stages[0].mesh_shape == (1, 2)
    # the head's copy of the tied weight stored whole while the embedding's is split over tp:
    # their gradients are added whole and each stage keeps its own piece
    first, last = tp.plan.stages
    wte = "transformer.wte.weight"
    assert first.parameter_placements[wte] == last.parameter_placements[wte] == ("R", "S(1)")
    mixed = dataclasses.replace(tp.plan, stages=(first, dataclasses.replace(
        last, parameter_placements={**last.parameter_placements, wte: ("R", "R")})))
    programs["gpt2 pp2 tp2 tied-R gpipe"] = PipelineProgram(setup[1]["gpt2"], mixed, model=setup[0]["gpt2"])
    assert "autopar_all_gather" in tp.code(0) and "autopar_all_gather" in tp.code(3)  # sharded weights
    dp = programs["gpt2 pp2 dp2 1f1b"]
    assert "autopar_grad_all_reduce" in dp.code(0)  # data-parallel gradient sums inside a stage
    deep = programs["gpt2 pp4 gpipe"]
    middle = deep.stage_of(1)[0]
    received = {b.name: b for b in middle.inputs}
    sent = {b.name for b in middle.outputs}
    # the labels (int) and the attention mask (bool) pass through the middle stages, without gradient
    labels = next(n for n in middle.graph_module.graph.nodes if n.name == "labels")
    assert "labels" in sent and [u.op for u in labels.users] == ["output"]
    assert received["labels"].dtype == torch.int64 and not received["labels"].requires_grad
    masks = [b for name, b in received.items() if b.dtype == torch.bool and name in sent]
    assert masks and not any(b.requires_grad for b in masks)
    assert any(b.dtype == torch.float32 and b.requires_grad for b in received.values())
    # autopar's own pipeline search (Alpa's space, the default) on two "nodes" of two ranks behind a
    # slow link: one stage per node, equal meshes, uneven layer ranges
    slow = dataclasses.replace(Cluster.local(world_size=4), mesh_shape=(2, 2), devices_per_node=2,
                               inter_node_bandwidth=1e7, inter_node_latency=1e-3, name="2 nodes x 2, slow link")
    searched = compile(setup[0]["gpt2"], slow, example_inputs=setup[2], options=Options(pipeline=True))
    shapes = {s.mesh_shape for s in searched.plan.stages}
    assert len(searched.plan.stages) == 2 and len(shapes) == 1, searched.plan.stages
    programs["gpt2 searched"] = searched
    results = run_programs(programs, inputs=setup[2], optimizer=list(OPTIMIZERS), lr=LR, return_parameters=True)
    _check(results, setup[0], {name: (setup[2], None, None) for name in setup[0]})


def test_stages_of_other_mesh_shapes_split_and_schedules_order_micro_batches(setup):
    models, captured, inputs = setup
    plan = _plan(models, inputs, "gpt2", world=4, tp=2)
    first, second = plan.stages
    odd = dataclasses.replace(plan, stages=(first, dataclasses.replace(
        second, mesh_shape=(2, 1), parameter_placements={k: ("R", "R") for k in second.parameter_placements},
        input_placements={k: ("R", "R") for k in second.input_placements})))
    program = PipelineProgram(captured["gpt2"], odd, model=models["gpt2"])  # (1, 2) then (2, 1)
    assert [sg.mesh_shape for sg in program._stages] == [(1, 2), (2, 1)]
    assert len(program.links[0]) == len(program._stages[0].outputs)
    # 1F1B: as many forwards as stages after this one, then a backward and a forward in turn
    assert list(order(4, in_flight("1f1b", 0, 2, 4))) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert list(order(2, in_flight("gpipe", 1, 2, 2))) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert in_flight("1f1b", 0, 4, 2) == 2  # fewer micro-batches than stages: the first holds them all


def test_loss_kinds_over_micro_batches():
    from torch import nn

    net = nn.Linear(4, 3)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    mean_ce = capture_for_training(net, example_inputs=(x,), example_target=y, loss_fn=nn.functional.cross_entropy)
    split = loss_split(mean_ce, micro_batches=2)
    assert split.kind == "count" and split.count is not None  # sum / count of the whole batch
    mse = capture_for_training(net, example_inputs=(x,), example_target=torch.randn(4, 3),
                               loss_fn=nn.functional.mse_loss)
    assert loss_split(mse, micro_batches=2).kind == "mean"
    peak = capture_for_training(net, example_inputs=(x,), example_target=y, loss_fn=lambda out, t: out.amax())
    with pytest.raises(PipelineError, match="neither a mean nor a sum over the batch"):
        loss_split(peak, micro_batches=2)
    assert loss_split(peak, micro_batches=1).kind == "sum"
