"""The step-time floor (:mod:`autopar.planner.time_floor`): no plan is faster, and compile skips a
routed-experts dispatch whose floor is over the other dispatch's plan."""

from __future__ import annotations

import pytest
import torch

from autopar import Cluster, baselines, zoo
from autopar.compile import compile, search_plan
from autopar.core.options import Options
from autopar.passes.capture.training import capture_for_training
from autopar.planner.time_floor import step_time_floor

NODE = Cluster.preset("dgx-a100", nodes=1)


@pytest.fixture(scope="module")
def gpt():
    """GPT-2 of 2 layers of hidden 1024 on 16 x 1024 tokens, bf16, on meta: compute-bound on A100s."""
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=1024, heads=16, vocab=8192, seq=1024, batch=16,
                                     dtype=torch.bfloat16, device="meta")
    inputs = {"input_ids": args[0], **kwargs}
    return model, inputs, capture_for_training(model, example_inputs=inputs)


def test_no_plan_steps_faster_than_the_floor(gpt):
    model, inputs, captured = gpt
    floor = step_time_floor(captured, NODE, Options())
    plans = [search_plan(captured, NODE, Options()), search_plan(captured, NODE, Options(pipeline=True)),
             baselines.data_parallel(model, NODE, example_inputs=inputs),
             baselines.fsdp(model, NODE, example_inputs=inputs),
             baselines.megatron(model, NODE, example_inputs=inputs, tp=8),
             baselines.megatron(model, NODE, example_inputs=inputs, tp=2, pp=2, dp=2)]
    times = [p.predicted_step_time for p in plans]
    assert all(floor <= t for t in times), (floor, times)
    assert floor > 0.25 * min(times)  # at these sizes the matmuls are most of a step


def test_the_floor_spreads_over_the_devices(gpt):
    _, _, captured = gpt
    one, two = (step_time_floor(captured, Cluster.preset("dgx-a100", nodes=n), Options()) for n in (1, 2))
    assert two == pytest.approx(one / 2)


def test_compile_does_not_search_a_dispatch_that_cannot_win(capfd):
    """Mixtral's shapes on meta: the dense dispatch pads its experts 4x (E/k = 8/2), so its FLOPs
    alone take longer than the sorted experts' plan; compile keeps that plan without searching
    dense, and searching dense on its own finds a slower plan, as the floor said. Capture on meta
    logs no failing fake kernel (transformers' histc on int32 in the sorted experts)."""
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build, config_of

    arch = next(a for a in architectures() if a.class_name == "MixtralForCausalLM")
    config = config_of(arch, "full")
    sizes = {"num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 3584, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 8192}
    for key, value in sizes.items():
        setattr(config, key, value)
    model, inputs = build(arch, size="full", batch=16, seq=1024, device="meta", config=config)
    model = model.to(torch.bfloat16)
    auto = compile(model, NODE, example_inputs=inputs)
    assert "sorted experts won; dense: not searched, its FLOPs alone take " in auto.plan.name
    floor_ms = float(auto.plan.name.rsplit("take ", 1)[1].split(" ms")[0])
    dense = compile(model, NODE, example_inputs=inputs, options=Options(moe_dispatch="dense"))
    assert auto.plan.predicted_step_time * 1e3 < floor_ms <= dense.plan.predicted_step_time * 1e3
    assert "failed while attempting to run meta" not in capfd.readouterr().err
