"""The precision a plan computes in is one fact, read from the model's dtypes and the options: it
sets the model-state bytes, the bytes of activations and collectives, and the peak MFU divides by."""

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, Options, zoo
from autopar.compile import compile
from autopar.core.errors import AutoparError
from autopar.core.precision import Precision, named, precision_of

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("dtypes, mixed, name, states", [
    ((F32, F32), False, "fp32", (4, 4, 8)),
    ((BF16, BF16), False, "bf16", (2, 2, 4)),   # AdamW keeps its moments in the parameters' dtype
    ((F16,), False, "fp16", (2, 2, 4)),
    ((F32,), True, "mixed", (2, 2, 12)),       # ZeRO's 2 + 2 + 12: fp32 master weights and moments
    ((BF16,), True, "mixed", (2, 2, 12)),
    ((F16,), True, "mixed-fp16", (2, 2, 12)),
    ((F32,), "fp16", "mixed-fp16", (2, 2, 12)),  # fp16 compute asked of an fp32 model
    ((F16,), "bf16", "mixed", (2, 2, 12)),
    ((), False, "fp32", (4, 4, 8)),
])
def test_the_precision_of_a_model_under_the_options(dtypes, mixed, name, states):
    p = precision_of(dtypes, mixed_precision=mixed)
    assert p.name == name and named(name) == p
    assert p.state_bytes("adam") == states
    assert p.state_bytes("sgd")[2] == (4 if p.master else 0)


def test_integer_tensors_keep_their_size_and_unknown_names_are_refused():
    p = Precision(BF16, master=True)
    assert p.itemsize(torch.int64) == 8 and p.itemsize(F32) == 2 and p.dtype(F32) == BF16
    with pytest.raises(AutoparError, match="unknown precision 'fp8'"):
        named("fp8")
    for wrong in ("fp8", 1):
        with pytest.raises(AutoparError, match="mixed_precision must be one of"):
            Options(mixed_precision=wrong)


@pytest.mark.parametrize("dtype, mixed, peak", [(F32, False, "fp32"), (BF16, False, "bf16"), (F32, True, "bf16")])
def test_a_plan_divides_its_flops_by_the_peak_of_its_precision(dtype, mixed, peak):
    model, (args, _) = zoo.mlp(inp=256, hidden=1024, out=256, batch=512, dtype=dtype, device="meta")
    cluster = Cluster.preset("dgx-a100", nodes=1, use_profile=False)
    target = torch.empty(512, 256, dtype=dtype, device="meta")
    plan = compile(model, cluster, example_inputs=args, loss_fn=F.mse_loss, example_target=target,
                   options=Options(mixed_precision=mixed)).plan
    assert plan.precision == precision_of([dtype], mixed_precision=mixed).name
    assert plan.peak_flops == 8 * cluster.device_spec.peak(peak)
    assert 0 < plan.mfu <= 1
    states = named(plan.precision).state_bytes("adam")
    for fqn, (p, g, o) in plan.parameter_memory.items():  # bytes per device, in the precision's ratio
        assert (p * states[1], p * states[2]) == (g * states[0], o * states[0]), fqn
