"""What one rank's fake training step measured: peak memory by kind, the collectives it issued,
the FLOPs it executed."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.runtime.verify.fake import Watch, optimizer_state


@dataclass(frozen=True)
class Issued:
    """One collective a rank issued: kind, mesh axis, bytes per rank (nccl-tests' size), phase."""

    kind: str
    axis: int
    nbytes: float
    phase: str


@dataclass(frozen=True)
class Measured:
    """One rank's step: ``peak`` bytes and their split by kind (:data:`KINDS`), the collectives
    issued (``buckets``: gradient buckets that carried their sums), FLOPs executed (torch's
    FlopCounterMode), and the seconds verifying it took."""

    rank: int
    stage: int | None
    peak: int
    memory: dict
    collectives: tuple[Issued, ...]
    buckets: int
    flops: int
    seconds: float
    host_peak: int = 0  # bytes on the host at its own peak (an offloaded optimizer's)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "peak": self.peak, "memory": dict(self.memory),
                "collectives": [vars(c) for c in self.collectives], "buckets": self.buckets,
                "flops": self.flops, "seconds": self.seconds, "host_peak": self.host_peak}


def measured(watch: Watch, module, opt, *, rank: int, stage: int | None, seconds: float,
             masters=None) -> Measured:
    """The :class:`Measured` of a step ``watch`` watched (``module``: the rank's module, whose
    parameters, buffers and gradients these are; ``opt``: its optimizer; ``masters``: the fp32
    master weights it steps under mixed precision or its ZeRO shards, counted as optimizer
    state with their gradients as gradients)."""
    params = list(module.parameters()) + list(module.buffers())
    own = masters.owned() if masters is not None else []
    grads = [p.grad for p in list(module.parameters()) + own if p.grad is not None]
    memory = watch.memory.peak_by_kind(parameters=params, gradients=grads, optimizer_state=optimizer_state(opt) + own)
    return Measured(rank=rank, stage=stage, peak=watch.memory.peak, memory=memory,
                    collectives=tuple(Issued(*c) for c in watch.log.issued), buckets=watch.log.buckets,
                    flops=int(watch.flops.get_total_flops()), seconds=seconds, host_peak=watch.memory.host_peak)


__all__ = ["Issued", "Measured", "measured"]
