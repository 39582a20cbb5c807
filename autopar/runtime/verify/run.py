"""``verify``: run one rank of each distinct program of a plan for one fake training step and set
what it measured beside what the plan predicts (:mod:`autopar.runtime.verify.report`).

The ranks run are rank 0 of a one-program plan (every rank runs the same program, on its own
shards) and the first rank of each pipeline stage; ``rank=`` picks one rank instead.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import DataDependentOutputException

from autopar.core.precision import named
from autopar.plan import Plan
from autopar.plan.assignment import assignment_of
from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.program import DistributedProgram
from autopar.runtime.verify.fake import CPU, FAKE_HOST, VerifyError
from autopar.runtime.verify.memory import KINDS
from autopar.runtime.verify.report import Predicted, RankCheck, Verification
from autopar.runtime.verify.single import measure_rank
from autopar.runtime.verify.staged import measure_stage_rank


def _kinds(breakdown) -> dict:
    return {k: float(getattr(breakdown, k)) for k in KINDS}


def predicted(plan: Plan, rank: int) -> Predicted:
    """What ``plan`` predicts for ``rank``: the worst device's memory by kind, collective records
    and FLOPs (a pipelined plan: its stage's), None where the plan records none."""
    if not plan.stages:
        return Predicted(_kinds(plan.memory), _records(plan.collective_records), plan.flops_per_device or None,
                         host=plan.host_memory)
    stage = next(s for s in plan.stages if rank in s.ranks)
    memory = _kinds(stage.breakdown) if stage.breakdown is not None else {"activations": float(stage.memory)}
    return Predicted(memory, _records(stage.collective_records), stage.flops_per_device or None)


def _records(records) -> tuple | None:
    """``(kind, mesh axis, bytes, phase)`` of each record (axis -2: several axes); None: not recorded."""
    if records is None:
        return None
    return tuple((c.kind, c.axes[0] if len(c.axes) == 1 else -2, c.nbytes, c.phase) for c in records)


def ranks_to_verify(plan: Plan, rank: int | None) -> list[int]:
    """``[rank]``, or one rank of each distinct program (see the module docstring)."""
    if rank is not None:
        if not 0 <= rank < plan.num_devices:
            raise VerifyError(f"rank {rank} is not in this plan's {plan.num_devices} ranks (0..{plan.num_devices - 1})")
        return [rank]
    return [s.ranks[0] for s in plan.stages] if plan.stages else [0]


def verify(plan: Plan, captured, model, *, loss_fn=None, rank: int | None = None) -> Verification:
    """Run ``plan``'s programs of ``model`` (captured as ``captured``; any device, ``"meta"``
    included) for one fake training step per verified rank and compare with the plan."""
    try:
        return _verify(plan, captured, model, loss_fn=loss_fn, rank=rank)
    except DataDependentOutputException as exc:
        raise VerifyError(f"a rank's program reads a tensor's value ({exc.func}, e.g. .item() or a data-dependent"
                          " size), which fake tensors cannot give: verify cannot run this plan's programs; train"
                          " with them on real tensors (autopar.testing.run_distributed) to measure them") from None


def _verify(plan: Plan, captured, model, *, loss_fn, rank) -> Verification:
    optimizer, precision = plan.options.optimizer, named(plan.precision)
    checks = []
    if plan.stages:
        program = PipelineProgram(captured, plan, model=model, loss_fn=loss_fn, device=CPU)
        for r in ranks_to_verify(plan, rank):
            checks.append(RankCheck(predicted(plan, r), measure_stage_rank(program, captured, r,
                                                                            optimizer=optimizer, precision=precision)))
    else:
        program = DistributedProgram(captured, assignment_of(plan, captured), model=model, device=CPU, zero=plan.zero,
                                     recompute=plan.recompute, offload=plan.offload, host=FAKE_HOST,
                                     offload_parameters=plan.offload_parameters, tiles=plan.tiles,
                                     offload_activations=plan.offload_activations)
        for r in ranks_to_verify(plan, rank):
            checks.append(RankCheck(predicted(plan, r), measure_rank(program, captured, r, optimizer=optimizer,
                                                                     precision=precision)))
    return Verification(plan.name, plan.num_devices, tuple(checks))


__all__ = ["predicted", "ranks_to_verify", "verify"]
