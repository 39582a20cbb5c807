"""The mixed-precision band of :mod:`one_process` tells a correct bf16 AdamW run from a wrong one,
though AdamW's sign flips make its widest element's noise larger than what 3 steps move a
parameter: a run on pieces of the batch passes, a learning rate 10 % off or a skipped step does
not (they move most of a tensor's elements past their own noise)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from autopar.testing import run_reference
from models import mlp
from one_process import Pieces, mixed_band

STEPS, LR = 3, 0.01


def _setup():
    torch.manual_seed(0)
    return mlp(width=8, hidden=32), torch.randn(16, 8), torch.randn(16, 8)


def _run(model, x, y, **kw):
    training = dict(steps=STEPS, optimizer="adamw", lr=LR, return_parameters=True, precision="mixed")
    return run_reference(model, inputs=(x,), target=y, loss_fn=F.mse_loss, **{**training, **kw})


def test_bf16_adamw_band_passes_pieces_and_fails_wrong_steps():
    model, x, y = _setup()
    ref = mixed_band(model, inputs=(x,), target=y, loss_fn=F.mse_loss, precision="mixed", steps=STEPS,
                     optimizer="adamw", lr=LR, return_parameters=True)
    losses, params = run_reference(Pieces(model, F.mse_loss, 2, 16), inputs=((x,), y), steps=STEPS, optimizer="adamw",
                                   lr=LR, return_parameters=True, precision="mixed")
    assert not ref.mismatches(losses, {n.removeprefix("model."): p for n, p in params.items()})
    for wrong in (dict(lr=LR * 1.1), dict(steps=STEPS - 1)):
        _, params = _run(model, x, y, **wrong)
        assert ref.mismatches(None, params), wrong
