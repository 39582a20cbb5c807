"""Sharded checkpoints: saved under one plan, loaded under another plan or world size, and a
training job that loses a rank resumes without losing a completed step.

- 4 ranks under Megatron (dp=2, tp=2) train and save; 2 ranks load the checkpoint under FSDP.
- 2 ranks under Megatron tp=2 train and save; the same ranks load it under data parallelism.
In both, the gathered parameters and AdamW states (step, exp_avg, exp_avg_sq) after loading are
bitwise equal to the ones saved, and one more training step from the loaded state gives the loss
and parameters of one more AdamW step in one process from the saved parameters and optimizer
states (against float64 within fp32's measured noise, :mod:`one_process`).
- A data-parallel model with BatchNorm buffers and tied weights saves and loads them exactly.
- torchrun (``--max-restarts 1``) runs tests/resume_worker.py; rank 1 is SIGKILLed in the middle
of step 3; the restarted job resumes from the step-2 checkpoint. Its per-step losses and final
parameters equal (bitwise) those of the same job run without a kill, and its losses the
one-process AdamW run's (float64 within fp32's measured noise).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.core.errors import CheckpointError
from autopar.runtime import checkpoint
from autopar.testing import run_on_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import resume_worker  # noqa: E402
from models import TiedBatchNorm, mlp  # noqa: E402
from one_process import band, cast, rows  # noqa: E402

LR = 1e-2
STEPS = 2


def _compiled(model, world, make_plan, kw):
    cluster = Cluster.local(world_size=world)
    plan = make_plan(model, cluster, **kw)
    return compile(model, cluster.with_mesh(plan.mesh_shape), plan=plan, **kw)


def _full(program) -> dict:
    """The gathered parameters, copied (on CPU a replicated one is the live parameter itself)."""
    return {k: v.clone() for k, v in program.full_state_dict().items()}


def _train_and_save(program, x, y, path):
    opt = torch.optim.AdamW(program.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        program.step((x,), y)
        opt.step()
    checkpoint.save(program, path, optimizer=opt, step=STEPS)
    return _full(program), checkpoint.full_optimizer_state(program, opt)


def _load_and_step(program, x, y, path):
    initial = _full(program)
    opt = torch.optim.AdamW(program.parameters(), lr=LR / 10)  # the checkpoint's lr comes back
    step = checkpoint.load(program, path, optimizer=opt)
    params, states = _full(program), checkpoint.full_optimizer_state(program, opt)
    lr = opt.param_groups[0]["lr"]
    opt.zero_grad()
    loss = program.step((x,), y)
    opt.step()
    return {"initial": initial, "step": step, "params": params, "states": states, "lr": lr,
            "next_loss": float(loss), "next_params": _full(program)}


def _four_ranks(program, x, y, path):
    return _train_and_save(program, x, y, path)


def _buffers_round_trip(trained, fresh, ids, labels, path):
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        trained.step((ids, labels))
        opt.step()
    checkpoint.save(trained, path, step=2)
    return _full(trained), _full(fresh), checkpoint.load(fresh, path), _full(fresh)


def _two_ranks(fsdp, tp, dp, other, x, y, directory, bn_pair, ids, labels):
    out = {"bn": _buffers_round_trip(*bn_pair, ids, labels, os.path.join(directory, "bn"))}
    out["from4"] = _load_and_step(fsdp, x, y, os.path.join(directory, "four"))
    out["tp_saved"] = _train_and_save(tp, x, y, os.path.join(directory, "tp"))
    out["from_tp"] = _load_and_step(dp, x, y, os.path.join(directory, "tp"))
    try:
        checkpoint.load(other, os.path.join(directory, "tp"))
    except CheckpointError as exc:
        out["other_model_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    torch.manual_seed(0)
    model = mlp(256, 1024)
    x, y = torch.randn(4, 256), torch.randn(4, 256)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    mega4 = _compiled(model, 4, lambda m, c, **k: baselines.megatron(m, c, tp=2, **k), kw)
    tp = _compiled(model, 2, lambda m, c, **k: baselines.megatron(m, c, tp=2, **k), kw)
    fsdp = _compiled(model, 2, baselines.fsdp, kw)
    dp = _compiled(model, 2, baselines.data_parallel, kw)
    small = mlp(256, 512)
    other = _compiled(small, 2, baselines.data_parallel, kw)
    saved4 = run_on_ranks(_four_ranks, world_size=4,
                          args=(mega4.program, x, y, os.path.join(directory, "four")))[0]
    bn_model = TiedBatchNorm().train()
    ids, labels = torch.randint(0, 16, (8,)), torch.randint(0, 16, (8,))
    bn = compile(bn_model, Cluster.local(world_size=2), example_inputs=(ids, labels),
                 plan=baselines.data_parallel(bn_model, Cluster.local(world_size=2), example_inputs=(ids, labels)))
    got = run_on_ranks(_two_ranks, world_size=2,
                       args=(fsdp.program, tp.program, dp.program, other.program, x, y, directory,
                             (bn.program, copy.deepcopy(bn.program)), ids, labels))[0]
    plans = {"mega4": mega4.plan, "tp": tp.plan, "fsdp": fsdp.plan, "dp": dp.plan}
    return dict(model=model, x=x, y=y, directory=directory, saved4=saved4, got=got, plans=plans)


def _reference_next_step(saved_params, saved_states, x, y):
    """One AdamW step in one process from the saved parameters and optimizer states: the loss
    (of the forward before the update) and the updated parameters, as a float64 band."""

    def train(dtype, order):
        ref = mlp(256, 1024).to(dtype)
        ref.load_state_dict(cast(saved_params, dtype))
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        for name, p in ref.named_parameters():
            opt.state[p] = {k: v.clone() if k == "step" else v.to(dtype) for k, v in saved_states[name].items()}
        loss = F.mse_loss(ref(cast(rows(x, order, len(x)), dtype)), cast(rows(y, order, len(y)), dtype))
        loss.backward()
        opt.step()
        return [float(loss.detach())], {k: v.detach() for k, v in ref.state_dict().items()}

    return band(train, len(x))


def _assert_same(got: dict, want: dict):
    assert set(got) == set(want)
    for name in want:
        if isinstance(want[name], dict):
            _assert_same(got[name], want[name])
        else:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_plans_really_shard_differently(runs):
    plans = runs["plans"]
    assert plans["mega4"].mesh_shape == (2, 2)
    assert plans["mega4"].parameter_placements["fc1.weight"] == ("R", "S(0)")
    assert plans["mega4"].parameter_placements["fc2.weight"] == ("R", "S(1)")
    assert plans["tp"].parameter_placements["fc1.weight"] == ("R", "S(0)")
    assert set(plans["fsdp"].parameter_placements.values()) == {("S(0)",)}
    assert set(plans["dp"].parameter_placements.values()) == {("R",)}


@pytest.mark.slow
def test_four_rank_megatron_checkpoint_loads_bitwise_under_two_rank_fsdp(runs):
    saved_params, saved_states = runs["saved4"]
    loaded = runs["got"]["from4"]
    assert loaded["step"] == STEPS
    assert not torch.equal(loaded["initial"]["fc1.weight"], saved_params["fc1.weight"])  # it trained
    _assert_same(loaded["params"], saved_params)
    _assert_same(loaded["states"], saved_states)
    assert set(saved_states["fc1.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(saved_states["fc1.weight"]["step"]) == STEPS
    assert loaded["lr"] == LR


@pytest.mark.slow
def test_tensor_parallel_checkpoint_loads_bitwise_under_data_parallel(runs):
    saved_params, saved_states = runs["got"]["tp_saved"]
    loaded = runs["got"]["from_tp"]
    assert loaded["step"] == STEPS
    _assert_same(loaded["params"], saved_params)
    _assert_same(loaded["states"], saved_states)
    assert loaded["lr"] == LR


@pytest.mark.slow
def test_training_continues_from_a_resharded_checkpoint(runs):
    for key, (params, states) in (("from4", runs["saved4"]), ("from_tp", runs["got"]["tp_saved"])):
        loaded = runs["got"][key]
        ref = _reference_next_step(params, states, runs["x"], runs["y"])
        for name, want in ref.params.items():
            assert not torch.equal(want.float(), params[name]), f"{key}: {name} did not move"
        ref.check([loaded["next_loss"]], loaded["next_params"], where=key)


@pytest.mark.slow
def test_buffers_and_tied_weights_round_trip(runs):
    trained, initial, step, loaded = runs["got"]["bn"]
    assert step == 2
    assert int(trained["bn.num_batches_tracked"]) == 2
    assert not torch.equal(trained["bn.running_mean"], initial["bn.running_mean"])
    _assert_same(loaded, trained)
    assert "head.weight" in loaded and torch.equal(loaded["head.weight"], loaded["emb.weight"])


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused_with_the_differing_tensor(runs):
    message = runs["got"]["other_model_error"]
    assert "different model" in message and "fc1.weight" in message
    assert "load it into the model it was saved from" in message


@pytest.mark.slow
def test_checkpoint_directory_is_json_plus_dcp_shards_and_latest_finds_it(runs):
    path = os.path.join(runs["directory"], "four")
    names = set(os.listdir(path))
    assert {"autopar.json", ".metadata"} <= names
    assert sum(n.endswith(".distcp") for n in names) == 4
    meta = json.load(open(os.path.join(path, "autopar.json")))
    assert meta["world_size"] == 4 and meta["mesh_shape"] == [2, 2] and meta["step"] == STEPS
    assert meta["tensors"]["fc1.weight"] == {"kind": "parameter", "shape": [1024, 256], "dtype": "float32"}
    assert meta["optimizer"]["class"] == "AdamW"
    assert checkpoint.latest(runs["directory"]) in [os.path.join(runs["directory"], n) for n in ("bn", "four", "tp")]


def test_latest_is_the_highest_complete_step_and_skips_half_written_saves(tmp_path):
    def fake(name, step):
        os.makedirs(tmp_path / name)
        meta = {"format": "autopar-checkpoint", "version": 1, "step": step, "world_size": 2, "tensors": {}}
        (tmp_path / name / "autopar.json").write_text(json.dumps(meta))

    fake("step-00003", 3)
    fake("step-00010", 10)
    fake("step-00011.partial", 11)  # a save killed before its rename
    os.makedirs(tmp_path / "step-00012")  # no autopar.json: not a checkpoint
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step-00010")


def test_read_meta_rejects_missing_corrupt_and_newer_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="no autopar checkpoint.*latest"):
        checkpoint.read_meta(tmp_path)
    (tmp_path / "autopar.json").write_text('{"format": "autopar-checkpoint", "vers')
    with pytest.raises(CheckpointError, match="corrupt.*earlier checkpoint"):
        checkpoint.read_meta(tmp_path)
    (tmp_path / "autopar.json").write_text('{"format": "autopar-checkpoint", "version": 99}')
    with pytest.raises(CheckpointError, match="version 99.*upgrade autopar"):
        checkpoint.read_meta(tmp_path)
    assert checkpoint.latest(tmp_path / "nowhere") is None


def _torchrun(tmp, name, kill_at, steps):
    log = str(tmp / f"{name}.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.2", os.path.join(HERE, "resume_worker.py"),
           str(tmp / "plan.json"), str(tmp / f"ckpt-{name}"), log, str(steps), str(kill_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env), log


def _losses(log):
    rows = [line.split() for line in open(log)]
    return [(int(a), int(s), float(v)) for a, s, v in rows]


@pytest.mark.slow
def test_torchrun_job_resumes_after_a_rank_is_killed_with_the_uninterrupted_loss_curve(tmp_path):
    steps, kill_at = 5, 3
    x, y = resume_worker.batch(0)
    model = resume_worker.build_model()
    plan = baselines.fsdp(model, Cluster.local(world_size=2), example_inputs=(x,), example_target=y,
                          loss_fn=F.mse_loss)
    assert set(plan.parameter_placements.values()) == {("S(0)",)}  # sharded state in the checkpoint
    plan.save(tmp_path / "plan.json")
    jobs = [_torchrun(tmp_path, "killed", kill_at, steps), _torchrun(tmp_path, "whole", 0, steps)]
    for (proc, _), killed_by_the_test in zip(jobs, (["-9"], [])):
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, "\n".join(ln for ln in out.splitlines() if "Warning" not in ln)[-6000:]
        # no other rank died (an abort at exit would be hidden by a restart that finds the work done)
        assert re.findall(r"failed \(exitcode: (-?\d+)\)", out) == killed_by_the_test, out[-6000:]
    killed, whole = (_losses(log) for _, log in jobs)
    # the first attempt completed steps 1-2; the restart redid step 3 (its checkpoint never
    # existed) and went on: every step exactly once, one restart (a restarted rank that aborted
    # at exit, tests/test_runtime_groups.py, would need a second)
    assert [s for _, s, _ in killed] == list(range(1, steps + 1))
    assert [a for a, _, _ in killed] == [0] * (kill_at - 1) + [1] * (steps - kill_at + 1)
    assert [(a, s) for a, s, _ in whole] == [(0, s) for s in range(1, steps + 1)]
    assert [v for *_, v in killed] == [v for *_, v in whole]
    final_killed = torch.load(jobs[0][1] + ".final.pt")
    final_whole = torch.load(jobs[1][1] + ".final.pt")
    _assert_same(final_killed, final_whole)
    _resume_reference(steps).check([v for *_, v in whole], where="uninterrupted job vs one process")


def _resume_reference(steps):
    """resume_worker's job in one process: a fresh batch each step, AdamW (a float64 band)."""

    def train(dtype, order):
        ref = resume_worker.build_model().to(dtype)
        opt = resume_worker.make_optimizer(ref.parameters())
        losses = []
        for step in range(1, steps + 1):
            bx, by = (cast(rows(t, order, resume_worker.BATCH), dtype) for t in resume_worker.batch(step))
            opt.zero_grad()
            loss = F.mse_loss(ref(bx), by)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses, {k: v.detach() for k, v in ref.named_parameters()}

    return band(train, resume_worker.BATCH)
