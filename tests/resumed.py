"""A one-rank program trained straight through and resumed from a checkpoint: what the
checkpoint tests compare (call inside a process group)."""

from __future__ import annotations

import torch

from autopar.runtime import checkpoint


def straight_and_resumed(compiled, inputs, target, path, *, lr: float) -> tuple[dict, dict]:
    """``compiled``'s whole state after 3 AdamW steps straight through, and after 2 steps saved to
    ``path`` (with the optimizer's state), a fresh runner loading it, and a third step."""

    def train(program, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            program.step(inputs, target)
            opt.step()

    program = compiled.runner()
    opt = torch.optim.AdamW(program.parameters(), lr=lr)
    train(program, opt, 2)
    checkpoint.save(program, path, optimizer=opt, step=2)
    train(program, opt, 1)
    straight = program.full_state_dict()
    program = compiled.runner()  # from the model again, then the checkpoint
    opt = torch.optim.AdamW(program.parameters(), lr=lr)
    assert checkpoint.load(program, path, optimizer=opt) == 2
    train(program, opt, 1)
    return straight, program.full_state_dict()
