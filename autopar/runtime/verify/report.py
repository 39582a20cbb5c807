"""What verify found: per rank, the plan's predictions beside what the fake step measured, judged
by the tolerances the plan must meet, as a terminal table or JSON.

A rank passes when its peak memory is within :data:`PEAK_RTOL` of the measured peak and every
kind within :data:`KIND_RTOL` of the peak (a kind is judged by how much of the peak it misplaces,
so a few bytes of a small kind cannot fail it), when it issued exactly the collectives the plan
records (kind, mesh axis, bytes and count per phase), and when its FLOPs are within
:data:`FLOPS_RTOL` of the predicted ones.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from autopar.runtime.verify.measured import Measured
from autopar.runtime.verify.memory import KINDS

PEAK_RTOL = 0.10
KIND_RTOL = 0.15
FLOPS_RTOL = 0.02
GiB = 2**30


def _key(kind: str, axis: int, nbytes: float, phase: str) -> tuple:
    return kind, int(axis), round(float(nbytes)), phase


@dataclass(frozen=True)
class Predicted:
    """What the plan predicts for one rank: peak bytes by kind (:data:`KINDS`), its collectives
    as ``(kind, mesh axis, bytes, phase)`` (None: the plan does not record them) and the FLOPs it
    executes (None: not predicted)."""

    memory: dict
    collectives: tuple | None
    flops: float | None
    host: float = 0.0  # bytes on the host at its peak (an offloaded optimizer's)

    @property
    def peak(self) -> float:
        return float(sum(self.memory.values()))


@dataclass(frozen=True)
class RankCheck:
    """One rank: what the plan predicted beside what was measured."""

    predicted: Predicted
    measured: Measured

    @property
    def peak_ratio(self) -> float:
        """Predicted over measured peak memory."""
        return self.predicted.peak / self.measured.peak if self.measured.peak else float("inf")

    def kind_errors(self) -> dict[str, float]:
        """Per kind: |predicted - measured| as a share of the measured peak."""
        peak = max(self.measured.peak, 1)
        return {k: abs(self.predicted.memory.get(k, 0.0) - self.measured.memory.get(k, 0)) / peak for k in KINDS}

    def collective_diff(self) -> tuple[Counter, Counter] | None:
        """(predicted but not issued, issued but not predicted), or None when not predicted."""
        if self.predicted.collectives is None:
            return None
        want = Counter(_key(*c) for c in self.predicted.collectives)
        got = Counter(_key(c.kind, c.axis, c.nbytes, c.phase) for c in self.measured.collectives)
        return want - got, got - want

    @property
    def flops_ratio(self) -> float | None:
        if self.predicted.flops is None:
            return None
        if not self.measured.flops:
            return 1.0 if not self.predicted.flops else float("inf")
        return self.predicted.flops / self.measured.flops

    def problems(self) -> list[str]:
        """Each prediction that misses its tolerance, as a sentence (empty: the rank passes)."""
        out = []
        if abs(self.peak_ratio - 1) > PEAK_RTOL:
            out.append(f"peak memory predicted {self.predicted.peak / GiB:.3f} GiB, measured"
                       f" {self.measured.peak / GiB:.3f} GiB (ratio {self.peak_ratio:.2f})")
        for kind, err in self.kind_errors().items():
            if err > KIND_RTOL:
                out.append(f"{kind}: predicted {self.predicted.memory.get(kind, 0) / GiB:.3f} GiB, measured"
                           f" {self.measured.memory[kind] / GiB:.3f} GiB at the peak")
        if (self.predicted.host or self.measured.host_peak) and not (
                abs(self.predicted.host - self.measured.host_peak) <= PEAK_RTOL * self.measured.host_peak):
            out.append(f"host memory predicted {self.predicted.host / GiB:.3f} GiB, measured"
                       f" {self.measured.host_peak / GiB:.3f} GiB")
        diff = self.collective_diff()
        if diff is not None and (diff[0] or diff[1]):
            out.append(f"collectives: {sum(diff[0].values())} predicted were not issued, {sum(diff[1].values())}"
                       " issued were not predicted")
        ratio = self.flops_ratio
        if ratio is not None and abs(ratio - 1) > FLOPS_RTOL:
            out.append(f"FLOPs predicted {self.predicted.flops:.4g}, executed {self.measured.flops:.4g}"
                       f" (ratio {ratio:.3f})")
        return out

    def to_dict(self) -> dict:
        diff = self.collective_diff()
        return {
            "measured": self.measured.to_dict(),
            "predicted": {"peak": self.predicted.peak, "memory": dict(self.predicted.memory),
                          "collectives": None if self.predicted.collectives is None
                          else [list(c) for c in self.predicted.collectives], "flops": self.predicted.flops,
                          "host": self.predicted.host},
            "peak_ratio": self.peak_ratio, "flops_ratio": self.flops_ratio,
            "collectives_missing": None if diff is None else [list(k) + [n] for k, n in sorted(diff[0].items())],
            "collectives_unexpected": None if diff is None else [list(k) + [n] for k, n in sorted(diff[1].items())],
            "problems": self.problems(),
        }


@dataclass(frozen=True)
class Verification:
    """Every verified rank of one plan (one rank per distinct program)."""

    plan: str
    world_size: int
    ranks: tuple[RankCheck, ...]

    @property
    def ok(self) -> bool:
        return not any(r.problems() for r in self.ranks)

    def to_dict(self) -> dict:
        return {"plan": self.plan, "world_size": self.world_size, "ok": self.ok,
                "ranks": [r.to_dict() for r in self.ranks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self) -> str:
        """The terminal report: per rank, memory by kind, collectives by kind and phase, FLOPs."""
        head = (f"verify {self.plan!r}: {len(self.ranks)} rank program(s) of {self.world_size}, one training"
                " step each on fake tensors (predicted / measured)")
        lines = [head]
        for r in self.ranks:
            m, p = r.measured, r.predicted
            where = f"rank {m.rank}" + (f" (stage {m.stage})" if m.stage is not None else "")
            lines.append(f"\n{where}: verified in {m.seconds:.1f} s")
            lines.append(f"  {'memory at the peak':22s} {'predicted':>12s} {'measured':>12s}")
            for kind in KINDS:
                lines.append(f"  {kind:22s} {p.memory.get(kind, 0) / GiB:9.3f} GiB {m.memory[kind] / GiB:8.3f} GiB")
            lines.append(f"  {'peak':22s} {p.peak / GiB:9.3f} GiB {m.peak / GiB:8.3f} GiB"
                         f"   ratio {r.peak_ratio:.3f}")
            if p.host or m.host_peak:
                lines.append(f"  {'host (offloaded)':22s} {p.host / GiB:9.3f} GiB {m.host_peak / GiB:8.3f} GiB")
            lines += _collective_lines(r)
            flops = "-" if p.flops is None else f"{p.flops:.4g}"
            ratio = "" if r.flops_ratio is None else f"   ratio {r.flops_ratio:.3f}"
            lines.append(f"  {'FLOPs executed':22s} {flops:>12s} {m.flops:12.4g}{ratio}")
            problems = r.problems()
            lines += [f"  MISMATCH {x}" for x in problems] or ["  all predictions within tolerance"]
        lines.append("\nOK: the plan is what runs" if self.ok else "\nMISMATCH: see the lines above")
        return "\n".join(lines)

    __str__ = table


def _collective_lines(r: RankCheck) -> list[str]:
    rows: dict = {}
    for kind, axis, nbytes, phase in (r.predicted.collectives or ()):
        row = rows.setdefault((kind, int(axis), phase), [0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += nbytes
    for c in r.measured.collectives:
        row = rows.setdefault((c.kind, int(c.axis), c.phase), [0, 0.0, 0, 0.0])
        row[2] += 1
        row[3] += c.nbytes
    lines = [f"  {'collectives (count, MiB)':22s} {'predicted':>12s} {'measured':>12s}"]
    for (kind, axis, phase), (pn, pb, mn, mb) in sorted(rows.items()):
        label = f"{kind} {'pp' if axis < 0 else f'axis {axis}'} {phase[:3]}"
        pred = "-" if r.predicted.collectives is None else f"{pn:4d} {pb / 2**20:7.1f}"
        lines.append(f"  {label:22s} {pred:>12s} {mn:4d} {mb / 2**20:7.1f}")
    if r.measured.buckets:
        lines.append(f"  (gradient sums carried in {r.measured.buckets} bucket launch(es))")
    return lines


__all__ = ["FLOPS_RTOL", "KIND_RTOL", "PEAK_RTOL", "Predicted", "RankCheck", "Verification"]
