"""Programs trained straight through and resumed from a checkpoint: what the checkpoint tests
compare (call inside a process group)."""

from __future__ import annotations

import os

import torch

from autopar.runtime import checkpoint


def straight_and_resumed(compiled, inputs, target, path, *, lr: float) -> tuple[dict, dict]:
    """``compiled``'s whole state after 3 AdamW steps straight through, and after 2 steps saved to
    ``path`` (with the optimizer's state), a fresh runner loading it, and a third step."""
    program = compiled.runner()
    opt = torch.optim.AdamW(program.parameters(), lr=lr)
    _train(program, opt, inputs, target, 2)
    checkpoint.save(program, path, optimizer=opt, step=2)
    _train(program, opt, inputs, target, 1)
    straight = program.full_state_dict()
    program = compiled.runner()  # from the model again, then the checkpoint
    opt = torch.optim.AdamW(program.parameters(), lr=lr)
    assert checkpoint.load(program, path, optimizer=opt) == 2
    _train(program, opt, inputs, target, 1)
    return straight, program.full_state_dict()


def _train(program, opt, inputs, target, steps):
    for _ in range(steps):
        opt.zero_grad()
        program.step(inputs, target)
        program.optimizer_step(opt)


def resume_programs(programs: dict, inputs, target, directory: str, lr: float, source: str):
    """Run on every rank. Per program (name -> program of one model and world): its optimizer
    state when saved after 2 AdamW steps, its whole state after a third, and after a fresh start
    loading that checkpoint and a third step; then ``source``'s checkpoint loaded into every
    program, with the optimizer state each holds. :func:`check_resumed` checks what this returns."""
    out = {}
    for name, program in programs.items():
        path = os.path.join(directory, name)
        opt = torch.optim.AdamW(program.start().parameters(), lr=lr)
        _train(program, opt, inputs, target, 2)
        checkpoint.save(program, path, optimizer=opt, step=2)
        saved = checkpoint.full_optimizer_state(program, opt)
        _train(program, opt, inputs, target, 1)
        straight = program.full_state_dict()
        opt = torch.optim.AdamW(program.start().parameters(), lr=lr)
        assert checkpoint.load(program, path, optimizer=opt) == 2
        _train(program, opt, inputs, target, 1)
        out[name] = saved, straight, program.full_state_dict()
    across = {}
    for name, program in programs.items():
        opt = torch.optim.AdamW(program.start().parameters(), lr=lr)
        checkpoint.load(program, os.path.join(directory, source), optimizer=opt)
        across[name] = checkpoint.full_optimizer_state(program, opt)
    return out, across, source


def check_resumed(resumed: dict, across: dict, source: str) -> None:
    """Every resumed program equals its straight run exactly, and every program that loaded
    ``source``'s checkpoint holds the optimizer state ``source`` saved (:func:`resume_programs`)."""
    for name, (saved, straight, again) in resumed.items():
        assert set(straight) == set(again) and all(torch.equal(straight[k], again[k]) for k in straight), name
        assert {k for state in saved.values() for k in state} == {"step", "exp_avg", "exp_avg_sq"}
    want = resumed[source][0]
    assert all(v.abs().sum() > 0 for state in want.values() for k, v in state.items() if k != "step")
    for name, state in across.items():
        assert set(state) == set(want), name
        for fqn in want:
            assert all(torch.equal(state[fqn][k], want[fqn][k]) for k in want[fqn]), (name, fqn)
