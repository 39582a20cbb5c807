"""Stages the plan marks ``recompute`` run their layers under activation checkpointing.

GPT-2 (4 layers), pipelined in 2 stages of 2 micro-batches, with ``recompute=True``, trains 3
SGD steps like one process: on 2 ranks (tp 1), and on 4 ranks with tensor parallelism (tp 2: the
recomputed layers issue their all-reduces again in backward) and with FSDP inside the stages
(zero 3: parameters gathered again by the recomputation). With dropout, recomputing draws the
same masks again: the run equals the same plan without recompute (and runs at all: dropout's
two outputs once cut the gradient between stages). A stage that recomputes keeps less for
backward than the same plan without: measured as the bytes autograd saves outside the
checkpointed layers (what a saved-tensor hook around the stage's forward sees). One-program
plans that recompute, fully or selectively (data parallel with ZeRO-1, tensor parallel), train
like one process too, and selective recompute draws dropout's masks again.
"""

from __future__ import annotations

import pytest
import torch

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.core.options import Options
from autopar.runtime.recompute import layer_runs
from autopar.testing import run_on_ranks, run_programs
from one_process import one_process

pytestmark = pytest.mark.slow  # rank processes

pytest.importorskip("transformers")

STEPS, LR = 3, 0.1


def _gpt2(dropout: float):
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=32, heads=4, batch=4, seq=8, dropout=dropout)
    return model, {"input_ids": args[0], **kwargs}


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2(0.0)


_COMPILED: dict = {}


def _pipelined(model, inputs, world, *, tp=1, zero=0, recompute=True):
    """Megatron's 2 stages of 2 micro-batches, compiled once per model and configuration."""
    key = (id(model), world, tp, zero, recompute)
    if key not in _COMPILED:  # the model is kept, so its id stays its own
        _COMPILED[key] = model, _compile_pipelined(model, inputs, world, tp=tp, zero=zero, recompute=recompute)
    return _COMPILED[key][1]


def _compile_pipelined(model, inputs, world, *, tp, zero, recompute):
    local = Cluster.local(world_size=world)
    plan = baselines.megatron(model, local, tp=tp, pp=2, micro_batches=2, zero=zero, recompute=recompute,
                              options=Options(pipeline=True), example_inputs=inputs)
    assert [s.recompute for s in plan.stages] == [recompute] * 2
    return compile(model, local.with_mesh(plan.mesh_shape), plan=plan, example_inputs=inputs)


def test_every_layer_of_a_stage_program_is_one_run(gpt2):
    compiled = _pipelined(*gpt2, 2)
    for rank, layers in ((0, {"transformer.h.0", "transformer.h.1"}), (1, {"transformer.h.2", "transformer.h.3"})):
        runs = layer_runs(compiled.program.emit(rank))
        by_layer = {}
        for index, layer in runs.values():
            by_layer.setdefault(layer, set()).add(index)
        assert {k for k in by_layer if k is not None} == layers
        assert all(len(by_layer[k]) == 1 for k in layers), by_layer


def test_recomputing_stages_train_like_one_process(gpt2):
    model, inputs = gpt2
    runs2 = {"pp": (_pipelined(model, inputs, 2), inputs, None)}
    runs4 = {"tp2 pp": (_pipelined(model, inputs, 4, tp=2), inputs, None),
             "fsdp pp": (_pipelined(model, inputs, 4, zero=3), inputs, None)}
    results = {**run_programs(runs2, steps=STEPS, lr=LR, return_parameters=True, timeout=900),
               **run_programs(runs4, steps=STEPS, lr=LR, return_parameters=True, timeout=900)}
    ref = one_process(model, inputs=inputs, steps=STEPS, optimizer="sgd", lr=LR)
    assert ref.losses[-1] < ref.losses[0]
    bad = [f"{name}: {line}" for name, (losses, params) in results.items() for line in ref.mismatches(losses, params)]
    assert not bad, "\n".join(bad)


def test_recomputed_dropout_draws_the_masks_of_the_first_forward():
    """Recomputing pipelined stages (whole layers) and a one-program plan's selective recompute
    (the dropouts between a layer's matmuls) each equal the same plan without recompute, exactly."""
    model, inputs = _gpt2(0.1)
    local = Cluster.local(world_size=2)
    runs = {("pp", rc): (_pipelined(model, inputs, 2, recompute=rc), inputs, None) for rc in (True, False)}
    for mode in ("selective", False):
        plan = baselines.megatron(model, local, example_inputs=inputs, tp=2, options=Options(recompute=mode))
        assert plan.recompute == mode
        compiled = compile(model, local.with_mesh(plan.mesh_shape), plan=plan, example_inputs=inputs)
        runs["tp", mode] = compiled, inputs, None
    got = run_programs(runs, steps=STEPS, lr=LR, return_parameters=True, timeout=900)
    for kind, mode in (("pp", True), ("tp", "selective")):
        (losses, params), (plain_losses, plain_params) = got[kind, mode], got[kind, False]
        assert losses == plain_losses and plain_losses[-1] < plain_losses[0]
        for fqn, value in plain_params.items():
            torch.testing.assert_close(params[fqn], value, rtol=0, atol=0, msg=f"{kind} {fqn}")


def _saved_activation_bytes(programs, inputs):
    """Bytes of distinct storages other than parameters that autograd saves in the forward
    passes of one step of each program, as a hook around the stage's forward sees them (the
    checkpointed layers save through their own hooks)."""
    out = {}
    for name, program in programs.items():
        torch.manual_seed(0)
        stage = program.start().module()
        weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        forward = stage.forward

        def hooked(*args, forward=forward):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return forward(*args)

        stage.forward = hooked
        program.step(inputs)
        out[name] = sum(storages.values())
    return out


def test_a_recomputing_stage_keeps_less_for_backward(gpt2):
    model, inputs = gpt2
    programs = {rc: _pipelined(model, inputs, 2, recompute=rc).program for rc in (True, False)}
    kept = run_on_ranks(_saved_activation_bytes, world_size=2, args=(programs, inputs))
    for rank, saved in enumerate(kept):
        assert saved[True] < 0.5 * saved[False], f"rank {rank}: {saved}"


def test_recomputing_one_program_plans_train_like_one_process(gpt2):
    """``Options(recompute=True)`` and ``"selective"`` on one-program plans (``Plan.recompute``):
    data parallel with ZeRO-1, and tensor parallelism (its layers' collectives run again in
    backward; selective runs its matmuls and their collectives once)."""
    model, inputs = gpt2
    local = Cluster.local(world_size=2)
    plans = {}
    for mode in (True, "selective"):
        options = Options(recompute=mode)
        plans[f"dp zero1 {mode}"] = baselines.data_parallel(model, local, example_inputs=inputs, zero=1,
                                                            options=options)
        plans[f"tp2 {mode}"] = baselines.megatron(model, local, example_inputs=inputs, tp=2, options=options)
    assert [p.recompute for p in plans.values()] == [True, True, "selective", "selective"]
    assert not any(p.stages for p in plans.values())
    runs = {name: (compile(model, local.with_mesh(p.mesh_shape), plan=p, example_inputs=inputs), inputs, None)
            for name, p in plans.items()}
    results = run_programs(runs, steps=STEPS, lr=LR, return_parameters=True, timeout=900)
    ref = one_process(model, inputs=inputs, steps=STEPS, optimizer="sgd", lr=LR)
    bad = [f"{name}: {line}" for name, (losses, params) in results.items() for line in ref.mismatches(losses, params)]
    assert not bad, "\n".join(bad)
