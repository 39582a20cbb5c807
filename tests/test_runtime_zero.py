"""ZeRO-1 and ZeRO-2 as planned (:mod:`autopar.runtime.zero`): each data-parallel rank steps only
its flat chunk of every parameter the plan keeps whole on the dp axes, with the user's optimizer
class, and an all-gather brings the updated parameters back; ZeRO-2 reduce-scatters gradients.

The fast tests look at one rank of a 2-rank program in a fake process group (no process is
started): which parameters are sharded, and that each shard is the right chunk of the model's
tensor. The slow ones train ZeRO-1 and ZeRO-2 × {SGD, AdamW} on 2 ranks (data parallel; one run
in bf16 mixed precision) and on a 2 x 2 mesh (the batch split on both axes, every gradient summed
and every parameter sharded over both; with gradient accumulation and clipping) for 3 steps,
compared with one process through :mod:`one_process`.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines, compile
from autopar.core.errors import CodegenError
from autopar.core.options import Options
from autopar.core.placement import Shard
from autopar.passes.capture import capture
from autopar.passes.capture.loss import WithLoss
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram
from autopar.runtime.verify.fake import fake_world
from autopar.testing import run_on_ranks, run_programs
from models import ResidualStack
from one_process import adamw, check_sgd_and_adamw
from resumed import check_resumed, resume_programs

LR = 0.01


def _net():
    torch.manual_seed(0)  # width 6, head 5: pieces of 30, 36, 6 and 5 elements (some padded on 4 ranks)
    return ResidualStack(3, 6, head=5), torch.randn(8, 6), torch.randn(8, 5)


def _data_parallel(net, x, y, *, zero: int, world: int = 2, mixed: bool = False) -> DistributedProgram:
    """The program of the data-parallel baseline's plan at ZeRO stage ``zero``."""
    cluster, options = Cluster.local(world_size=world), Options(mixed_precision=mixed)
    kw = {"example_inputs": (x,), "example_target": y, "loss_fn": F.mse_loss, "options": options}
    compiled = compile(net, cluster, plan=baselines.data_parallel(net, cluster, zero=zero, **kw), **kw)
    assert compiled.program.zero == zero
    return compiled.program


def _grid(net, x, y, *, zero: int) -> DistributedProgram:
    """A 2 x 2 mesh with the batch split on both axes: every gradient is summed over both."""
    model = WithLoss(net, F.mse_loss)
    cap = capture(model, (x, y))
    split = (Shard(0), Shard(0))
    return DistributedProgram(cap, propagate(cap.graph_module, (2, 2), {"args_0": split, "args_1": split}),
                              model=model, zero=zero)


def test_zero_axes_are_the_axes_each_parameters_gradient_is_summed_over():
    net, x, y = _net()
    axes = _grid(net, x, y, zero=1).zero_axes(0)
    assert set(axes) == {n for n, _ in net.named_parameters()}
    assert set(axes.values()) == {(0, 1)}
    assert set(_data_parallel(net, x, y, zero=1).zero_axes(1).values()) == {(0,)}


def test_a_program_refuses_a_zero_stage_it_does_not_run():
    net, x, y = _net()
    with pytest.raises(CodegenError, match="ZeRO-3 is a plan whose parameters are stored sharded"):
        _grid(net, x, y, zero=3)


@pytest.mark.parametrize("zero", [1, 2])
def test_each_rank_steps_its_flat_chunk_of_every_parameter(zero):
    net, x, y = _net()
    program = _data_parallel(net, x, y, zero=zero, world=2)
    with fake_world(1, 2):
        stepped = list(program.parameters())
        want = [p.detach().reshape(-1) for p in net.parameters()]
        assert [s.shape for s in stepped] == [(math.ceil(w.numel() / 2),) for w in want]
        for s, w in zip(stepped, want):  # rank 1 holds the second half, zero-padded
            half = w[s.numel():]
            assert torch.equal(s.detach()[:half.numel()], half)
            assert not s.detach()[half.numel():].any()
        program.reset()


@pytest.mark.slow
def test_zero_programs_save_and_resume_their_sharded_optimizer_state_and_load_each_others(tmp_path):
    net, x, y = _net()
    programs = {f"zero{z}": _data_parallel(net, x, y, zero=z) for z in (0, 1, 2)}
    check_resumed(*run_on_ranks(resume_programs, world_size=2, args=(programs, (x,), y, str(tmp_path), LR, "zero1"))[0])


def _check(results, net, x, y, **kw):
    check_sgd_and_adamw(results, net, inputs=(x,), target=y, loss_fn=F.mse_loss, lr=LR, **kw)


@pytest.mark.slow
def test_zero_1_and_2_on_two_ranks_train_like_one_process():
    net, x, y = _net()
    programs = {f"zero{z}": _data_parallel(net, x, y, zero=z) for z in (1, 2)}
    _check(run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True),
           net, x, y)


@pytest.mark.slow
def test_zero_2_in_bf16_mixed_precision_trains_like_one_process_under_the_same_policy():
    net, x, y = _net()
    programs = {"zero2-mixed": _data_parallel(net, x, y, zero=2, mixed=True)}
    results = run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True)
    for losses, params in results["zero2-mixed"]:
        assert torch.tensor(losses).bfloat16().float().tolist() == losses  # computed in bf16
        assert {t.dtype for t in params.values()} == {torch.float32}  # the fp32 master shards, gathered
    _check(results, net, x, y, precision="mixed")


@pytest.mark.slow
def test_zero_1_and_2_on_a_two_by_two_mesh_accumulate_and_clip_like_one_process():
    net, x, y = _net()
    programs = {f"zero{z}": _grid(net, x, y, zero=z) for z in (1, 2)}
    training = {"accumulate": 2, "max_norm": 0.05}
    _check(run_programs(programs, inputs=(x,), target=y, optimizer=["sgd", adamw], lr=LR, return_parameters=True,
                        **training), net, x, y, **training)
