"""Layers too large for one device, run tile by tile from the host (:mod:`autopar.planner.tiling`,
:mod:`autopar.runtime.tiles`): the tiled ops equal the untiled ones, the planner tiles only where
the untiled plan does not fit or is slower, verify confirms the tiled plan's peak, and it trains
like one process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopar import Cluster, compile
from autopar.core.options import Options
from autopar.runtime.fetch import Fetcher
from autopar.runtime.verify.report import PEAK_RTOL
from autopar.testing import run_programs
from one_process import adamw, check_sgd_and_adamw

LR = 0.1  # the loss over 4096 classes moves visibly in 3 steps of SGD


class Vocab(nn.Module):
    """A large vocabulary around a small body: the embedding and the head hold most parameters."""

    def __init__(self, vocab: int = 4096, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.emb(ids))))


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data():
    torch.manual_seed(0)
    return Vocab(), torch.randint(0, 4096, (4, 3)), torch.randint(0, 4096, (4, 3))


@pytest.mark.parametrize("tiles", [1, 3, 7])
def test_the_tiled_ops_give_the_untiled_values_and_gradients(tiles):
    from autopar.runtime.tiles import autopar_tiled_embedding, autopar_tiled_linear

    torch.manual_seed(0)
    w, b, x = torch.randn(10, 4, requires_grad=True), torch.randn(10, requires_grad=True), torch.randn(2, 3, 4)
    ids = torch.tensor([[0, 9, 3], [3, 5, 9]])
    fetcher = Fetcher(torch.device("cpu"))
    pairs = ((lambda w: autopar_tiled_linear(fetcher, x, w, b, tiles=tiles), lambda w: F.linear(x, w, b)),
             (lambda w: autopar_tiled_embedding(fetcher, w, ids, tiles=tiles), lambda w: F.embedding(ids, w)))
    for tiled, plain in pairs:
        got = tiled(w)
        (g,) = torch.autograd.grad((got * got.detach().cos()).sum(), w)
        want = plain(w)
        (h,) = torch.autograd.grad((want * want.detach().cos()).sum(), w)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g, h)
        assert not fetcher._ahead  # every prefetched tile was used


def _tiled(net, ids, labels, memory, **options):
    cluster = dataclasses.replace(Cluster.local(world_size=1, use_profile=False), device_memory=memory)
    return compile(net, cluster, example_inputs=(ids,), example_target=labels, loss_fn=_loss,
                   options=Options(offload="parameters", memory_fraction=1.0, **options))


def test_the_planner_tiles_the_layers_that_do_not_fit_and_verify_confirms_the_peak():
    net, ids, labels = _data()
    compiled = _tiled(net, ids, labels, 600 * 2**10)
    plan = compiled.plan
    weight = 4096 * 16 * 4
    # embedding and head: the fewest tiles of at most 1/16 of the limit each
    assert plan.tiles == {"embedding": 7, "linear_1": 7} and weight / 7 <= 600 * 2**10 / 16
    (why,) = [w for w in plan.why if w.startswith("tiled:")]
    assert "untiled, the step's peak would be" in why and "over the" in why
    assert "embedding runs as 7 tiles of its weight's rows" in " ".join(plan.summary().split())
    assert plan.predicted_peak_memory <= 600 * 2**10
    (rank,) = compiled.verify().ranks
    assert abs(rank.peak_ratio - 1) <= PEAK_RTOL and not rank.problems(), rank.problems()
    assert rank.measured.peak <= 600 * 2**10
    # the same program untiled holds a whole weight and its gradient: measured, it does not fit
    untiled = compile(net, compiled.cluster, example_inputs=(ids,), example_target=labels, loss_fn=_loss,
                      plan=dataclasses.replace(plan, tiles={}))
    assert untiled.verify().ranks[0].measured.peak > 600 * 2**10
    roomy = _tiled(net, ids, labels, 8 * 2**20).plan  # each weight within 1/16 of the limit: nothing tiled
    assert roomy.offload_parameters and not roomy.tiles


@pytest.mark.slow
def test_a_tiled_plan_trains_like_one_process():
    net, ids, labels = _data()
    programs = {"tiled": _tiled(net, ids, labels, 600 * 2**10).program,
                "tiled-mixed": _tiled(net, ids, labels, 600 * 2**10, mixed_precision=True).program}
    assert all(p.tiles for p in programs.values())
    results = run_programs(programs, inputs=(ids,), target=labels, optimizer=["sgd", adamw], lr=LR,
                           return_parameters=True)
    kw = {"inputs": (ids,), "target": labels, "loss_fn": _loss, "lr": LR}
    check_sgd_and_adamw({"tiled": results["tiled"]}, net, **kw)
    check_sgd_and_adamw({"tiled-mixed": results["tiled-mixed"]}, net, precision="mixed", **kw)
