"""Expert parallelism for transformers' routed experts (passes/capture/moe.py): the dense dispatch
equals the model's experts, drops GShard-style under a capacity factor, and autopar's plan shards
the experts on E with all-to-all dispatch and combine, training like one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopar import Cluster
from autopar.compile import compile
from autopar.core.errors import InputError
from autopar.core.options import Options, OptionsError
from autopar.cost_models.compute import flop_formulas
from autopar.passes.capture import capture
from autopar.passes.capture.moe import KEY, capacity, dense_experts, routing
from autopar.passes.rules.check import check_op
from autopar.plan.experts import expert_parallel_axes
from autopar.testing import run_programs
from one_process import one_process

pytest.importorskip("transformers")

from autopar.zoo_hf import EP_BATCH, EP_SEQ, architectures, build  # noqa: E402

FAMILIES = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"]
LOCAL = Cluster.local(world_size=2)
ONE_PROGRAM = Options(pipeline=False, search_meshes=False, moe_dispatch="dense")


def _moe(name, *, expert_parallel=False, batch=4, seq=16):
    """A tiny ``name``; ``expert_parallel``: at zoo_hf's sizes where 2 ranks plan expert parallelism."""
    arch = next(a for a in architectures() if a.class_name == name)
    if expert_parallel:
        return build(arch, experts=True, batch=EP_BATCH, seq=EP_SEQ)
    return build(arch, batch=batch, seq=seq)


def _experts_of(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("Experts"))


@pytest.mark.parametrize("name,twice", [(name, False) for name in FAMILIES] + [("MixtralForCausalLM", True)])
def test_the_dense_dispatch_gives_the_models_experts_output_and_gradients(name, twice):
    """Top-k routing (distinct experts) and, ``twice``, hash-style routing that picks one expert
    twice for some tokens (DeepSeek-V4's hash layers): every token keeps all its choices."""
    model, _ = _moe(name)
    experts = _experts_of(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, model.config.hidden_size, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(24)])
    if twice:  # the first group's 6 tokens all take expert 0 twice: 12 choices, 6 tokens
        index[:6] = 0
    weights = torch.rand(24, 2, generator=g, requires_grad=True)
    want = experts(x, index, weights)
    want_grads = torch.autograd.grad(want.square().sum(), [x, weights, *experts.parameters()])
    with dense_experts(model, groups=4):
        assert model.config._experts_implementation == KEY
        got = experts(x, index, weights)
        got_grads = torch.autograd.grad(got.square().sum(), [x, weights, *experts.parameters()])
    assert model.config._experts_implementation == "grouped_mm"  # the model's own, restored
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_capacity_factor_drops_the_pairs_past_an_experts_capacity_first_choices_first():
    """One group of 4 tokens, top-2 of 2 experts, capacity ceil(0.5 * 4 * 2 / 2) = 2 slots: expert 0
    takes tokens 0 and 2 as first choices and has no slot left for token 1's second choice."""
    slots = capacity(4, top_k=2, experts=2, capacity_factor=0.5)
    index = torch.tensor([[[0, 1], [1, 0], [0, 1], [1, 0]]])
    weights = torch.tensor([[[0.6, 0.4], [0.7, 0.3], [0.8, 0.2], [0.9, 0.1]]])
    dispatch, combine = routing(index, weights, experts=2, slots=slots)
    # (token, expert) -> slot: first choices fill both experts, every second choice is dropped
    kept = {(t, e): int(dispatch[0, t, e].argmax()) for t in range(4) for e in range(2) if dispatch[0, t, e].any()}
    assert slots == 2 and kept == {(0, 0): 0, (2, 0): 1, (1, 1): 0, (3, 1): 1}
    assert combine[0].sum(dim=(1, 2)).tolist() == pytest.approx([0.6, 0.7, 0.8, 0.9])
    assert capacity(4, top_k=2, experts=2, capacity_factor=None) == 4  # exact: n slots, nothing dropped


def _slots_one_at_a_time(index, weights, experts, slots):
    """GShard order, one (choice, token) at a time: ``{(g, t, e): (slot, weight)}`` of the kept."""
    kept = {}
    for g in range(index.shape[0]):
        used, first = [0] * experts, {}
        for j in range(index.shape[2]):
            for t in range(index.shape[1]):
                e = int(index[g, t, j])
                if (t, e) not in first:
                    first[t, e], used[e] = used[e], used[e] + 1
                if first[t, e] < slots:
                    slot, weight = kept.get((g, t, e), (first[t, e], 0.0))
                    kept[g, t, e] = slot, weight + float(weights[g, t, j])
    return kept


@pytest.mark.parametrize("seed", range(4))
def test_the_routing_gives_the_slots_of_gshards_order_with_repeated_choices_and_drops(seed):
    g = torch.Generator().manual_seed(seed)
    groups, tokens, k, experts = 2, 9, 3, 4
    index = torch.randint(0, experts, (groups, tokens, k), generator=g)  # repeats within a token too
    weights = torch.rand(groups, tokens, k, generator=g, dtype=torch.float64)
    for slots in (2, 5, tokens):
        dispatch, combine = routing(index, weights, experts=experts, slots=slots)
        want = _slots_one_at_a_time(index, weights, experts, slots)
        got = {(gi, t, e): (int(dispatch[gi, t, e].argmax()), float(combine[gi, t, e].sum()))
               for gi in range(groups) for t in range(tokens) for e in range(experts) if dispatch[gi, t, e].any()}
        assert got.keys() == want.keys() and dispatch.sum(-1).max() == 1
        assert all(got[key][0] == want[key][0] and got[key][1] == pytest.approx(want[key][1]) for key in want)


def test_a_capacity_factor_changes_the_captured_slots_and_bad_factors_are_refused():
    model, inputs = _moe("MixtralForCausalLM", batch=2, seq=8)
    shapes = {}
    for factor in (None, 1.0):
        cap = capture(model, (), kwargs=inputs, moe_capacity_factor=factor)
        einsums = [n for n in cap.graph_module.graph.nodes if "einsum" in str(n.target)]
        shapes[factor] = tuple(einsums[0].meta["val"].shape)  # dispatched tokens (E, G, C, M)
    assert shapes == {None: (4, 2, 8, 64), 1.0: (4, 2, 4, 64)}  # C = 8 tokens, ceil(1 * 8 * 2 / 4)
    with pytest.raises(OptionsError, match="moe_capacity_factor"):
        Options(moe_capacity_factor=0)
    with pytest.raises(OptionsError, match="moe_dispatch"):
        Options(moe_dispatch="grouped")
    with pytest.raises(InputError, match="moe_dispatch"):
        capture(model, (), kwargs=inputs, moe_dispatch="grouped")


def _expert_parallel_plan(name):
    """8 experts of 512 features on 2 CPU ranks, batch 8 x 64 tokens: autopar's plan."""
    model, inputs = _moe(name, expert_parallel=True)
    return model, inputs, compile(model, LOCAL, example_inputs=inputs, options=ONE_PROGRAM)


def _assert_expert_parallel(plan):
    """The experts' weights and batched matmuls sharded on E, tokens moved by all-to-all."""
    assert expert_parallel_axes(plan) == {0}
    weights = {k: v for k, v in plan.parameter_placements.items() if k.endswith(("gate_up_proj", "down_proj"))}
    assert weights and set(weights.values()) == {("S(0)",)}
    matmuls = [n for n in plan.nodes if n.op == "aten.einsum.default" and "experts" in (n.module or "")]
    assert sum(n.inputs[1] == "S(0)" and n.outputs == ("S(0)",) for n in matmuls) == len(matmuls) // 2
    issued = {(r.kind, r.phase) for r in plan.collective_records}
    assert {("all_to_all", "forward"), ("all_to_all", "backward")} <= issued


def test_autopar_plans_expert_parallelism_and_predicts_the_collectives_the_program_issues():
    """All-to-alls in every MoE layer (3 per layer at these sizes: dispatch forward, combine both
    ways; the dispatch's backward reduces the gathered tokens' gradient instead), each priced by
    the cluster's all-to-all model, and exactly the collectives verify sees the program issue."""
    _, _, compiled = _expert_parallel_plan("MixtralForCausalLM")
    _assert_expert_parallel(compiled.plan)
    a2a = [r for r in compiled.plan.collective_records if r.kind == "all_to_all"]
    assert len(a2a) >= 2 * compiled.model.config.num_hidden_layers
    for r in a2a:
        assert r.time == pytest.approx(LOCAL.collective_time("all_to_all", r.nbytes, r.axes))
    for rank in compiled.verify().ranks:
        assert rank.collective_diff() == ({}, {})


def test_the_auto_dispatch_plans_both_captures_and_keeps_the_faster():
    """At these tiny sizes the dense dispatch's 4x padding (E/k = 8/2) costs more than expert
    parallelism saves, so the model's own sorted experts win, and the plan says so."""
    model, inputs = _moe("MixtralForCausalLM", expert_parallel=True)
    compiled = compile(model, LOCAL, example_inputs=inputs, options=Options(pipeline=False, search_meshes=False))
    dense = compile(model, LOCAL, example_inputs=inputs, options=ONE_PROGRAM)
    assert "sorted experts won; dense: " in compiled.plan.name and compiled.plan.options.moe_dispatch == "sorted"
    assert compiled.plan.predicted_step_time < dense.plan.predicted_step_time
    assert "grouped_mm_fallback" in compiled.code(rank=0) and not expert_parallel_axes(compiled.plan)
    again = compile(model, LOCAL, example_inputs=inputs, plan=compiled.plan)  # captured as the plan was
    assert again.captured.moe_dispatch == "sorted"


@pytest.mark.slow
def test_expert_parallel_plans_of_two_moe_families_train_like_one_process():
    """Exact capacity against the unmodified models; capacity factor 1 (16 slots for an expert's
    average load of 16 tokens a row: some dropped) against Mixtral in one process with its experts
    on the same capacity (dense_experts), which differs from the exact run."""
    runs, refs = {}, {}
    for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM"):
        model, inputs, compiled = _expert_parallel_plan(name)
        _assert_expert_parallel(compiled.plan)
        runs[name] = (compiled, inputs, None)
        refs[name] = one_process(model, inputs=inputs, steps=2, optimizer="sgd", lr=0.01)
    model, inputs = _moe("MixtralForCausalLM", expert_parallel=True)
    dropping = compile(model, LOCAL, example_inputs=inputs,
                       options=dataclasses.replace(ONE_PROGRAM, moe_capacity_factor=1.0))
    _assert_expert_parallel(dropping.plan)
    runs["Mixtral f=1"] = (dropping, inputs, None)
    with dense_experts(model, groups=EP_BATCH, capacity_factor=1.0):
        refs["Mixtral f=1"] = one_process(model, inputs=inputs, steps=2, optimizer="sgd", lr=0.01)
    assert refs["Mixtral f=1"].mismatches(refs["MixtralForCausalLM"].losses, refs["MixtralForCausalLM"].params)
    results = run_programs(runs, steps=2, lr=0.01, return_parameters=True, timeout=1200)
    assert {name: refs[name].mismatches(*results[name]) for name in runs} == {name: [] for name in runs}


def test_grouped_matmuls_count_their_flops():
    """torch's FlopCounterMode leaves grouped matmuls out (the sorted experts' compute was free in
    costs and in verify): rows x inner x columns over the groups, twice for the backward."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    rows, inner, out = 16, 8, 32
    x = torch.randn(rows, inner, device="meta", requires_grad=True)
    w = torch.randn(4, inner, out, device="meta", requires_grad=True)
    offs = torch.tensor([3, 3, 10, 16], device="meta", dtype=torch.int32)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as forward:
        y = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as backward:
        torch.autograd.grad(y, [x, w], torch.empty_like(y))
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as aten_forward:
        torch.ops.aten._grouped_mm(x.detach().bfloat16(), w.detach().bfloat16(), offs=offs)
    gemm = 2 * rows * inner * out
    assert (forward.get_total_flops(), backward.get_total_flops(), aten_forward.get_total_flops()) == (
        gemm, 2 * gemm, gemm)


def test_torchs_grouped_matmul_has_the_strategies_of_transformers_fallback_and_they_match_the_op():
    """transformers calls aten._grouped_mm on bf16 weights, GPUs and meta (full-size plans)."""
    report = check_op(torch.ops.aten._grouped_mm.default)
    assert report.failures == [] and report.sharded_strategies > 0
