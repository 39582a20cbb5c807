"""Dropout with p > 0 trains exactly like one device under data-parallel, tensor-parallel and FSDP
plans: each rank keeps its piece of the mask one device would draw for the whole tensor
(``dropout_from_global_mask``), with every rank and the one-process run seeded alike
(``autopar.testing``'s ``seed``). GPT-2's residual and embedding dropout are on (attention
dropout is off: it draws inside the fused attention kernel, which no slice can reproduce).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autopar
from autopar import Cluster, baselines, zoo
from autopar.core.layout import LocalContext, piece_of
from autopar.core.placement import R, Shard
from autopar.passes.rules.pointwise import dropout_from_global_mask
from autopar.testing import run_programs, run_reference

pytest.importorskip("transformers")
LR = 0.05


def test_each_piece_of_the_mask_is_one_devices_mask():
    x = torch.randn(4, 6)
    torch.manual_seed(3)
    want = F.dropout(x, 0.4, training=True)  # eager, as one device runs it
    for sharding in ((Shard(0),), (Shard(1),), (R,)):
        for coord in ((0,), (1,)):
            piece = piece_of((4, 6), sharding, (2,), coord)
            ctx = LocalContext((piece,), (piece,))
            local = x[piece.starts[0]:piece.stops[0], piece.starts[1]:piece.stops[1]]
            torch.manual_seed(3)
            out, mask = dropout_from_global_mask(torch.ops.aten.native_dropout.default, (local, 0.4, True), {}, ctx)
            assert torch.equal(out, want[piece.starts[0]:piece.stops[0], piece.starts[1]:piece.stops[1]])
            assert torch.equal(mask, out != 0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _gpt2():
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=16, batch=4, dropout=0.1)
    for name, module in model.named_modules():
        if name.endswith("attn_dropout"):
            module.p = 0.0
    return model, {"input_ids": args[0], **kwargs}


def _plans(model, cluster, **kw):
    return {"dp": baselines.data_parallel(model, cluster, **kw), "tp": baselines.megatron(model, cluster, tp=2, **kw),
            "fsdp": baselines.fsdp(model, cluster, **kw)}


@pytest.mark.slow
def test_dropout_trains_like_one_device_under_every_plan():
    torch.manual_seed(0)
    cluster = Cluster.local(2)
    net, x, y = Net(), torch.randn(8, 8), torch.randn(8, 8)
    gpt2, batch = _gpt2()
    cases = {"net": (net, dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss), (x,), y),
             "gpt2": (gpt2, dict(example_inputs=batch), batch, None)}
    programs, refs = {}, {}
    for name, (model, kw, inputs, target) in cases.items():
        for plan_name, plan in _plans(model, cluster, **kw).items():
            compiled = autopar.compile(model, cluster, plan=plan, **kw)
            programs[f"{name} {plan_name}"] = (compiled, inputs, target)
        refs[name] = run_reference(model, inputs=inputs, target=target, loss_fn=kw.get("loss_fn"), lr=LR,
                                   return_parameters=True)
        unseeded = run_reference(model, inputs=inputs, target=target, loss_fn=kw.get("loss_fn"), lr=LR, seed=1)
        assert unseeded != refs[name][0], f"{name}: dropout did not change the losses"
    dp_code = programs["net dp"][0].program.code(0)
    assert "'global_mask'" in dp_code  # the batch-sharded dropout keeps its slice of the whole mask
    results = run_programs(programs, lr=LR, return_parameters=True)
    for label, (losses, params) in results.items():
        ref_losses, ref_params = refs[label.split()[0]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=f"{label}: losses")
        for fqn, ref in ref_params.items():
            torch.testing.assert_close(params[fqn], ref, rtol=1e-5, atol=1e-6, msg=f"{label}: {fqn}")
