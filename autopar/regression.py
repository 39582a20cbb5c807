"""Plan diffs and golden-plan regression tests.

:func:`diff_plans` lists what changed between two plans: parameter and input placements, node
strategies, pipeline stages, and every predicted cost. :func:`assert_plan_matches` compares a
plan with a saved golden plan and fails with that diff when a sharding changed or the predicted
step time or peak memory regressed by more than ``cost_rtol`` (improvements pass; large ones
warn that the golden file is stale)::

    from autopar.testing import assert_plan_matches
    assert_plan_matches(compiled.plan, "golden/gpt2.json", cost_rtol=0.02)

A relative golden path is taken from the folder of the calling file. With
``AUTOPAR_UPDATE_GOLDEN=1`` in the environment (``pytest --autopar-update-golden`` sets it) a
golden file that is missing or does not match is rewritten (atomically) instead.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field

from autopar.core.errors import PlanError
from autopar.plan import Plan
from autopar.plan.report import GiB, fmt_time, plan_stages, stage_index

UPDATE_ENV = "AUTOPAR_UPDATE_GOLDEN"


class PlanMismatch(AssertionError):
    """A plan differs from its golden plan (the message is the readable diff)."""


class GoldenStaleWarning(UserWarning):
    """A plan is cheaper than its golden plan by more than the tolerance: update the golden file."""


def _cost_fields(plan) -> dict[str, float]:
    t, m = plan.time, plan.memory
    out = {
        "step time": t.total, "time.compute": t.compute, "time.communication": t.communication,
        "time.resharding": t.resharding, "time.bubble": t.bubble, "peak memory": m.total,
        "memory.parameters": m.parameters, "memory.gradients": m.gradients,
        "memory.optimizer": m.optimizer, "memory.activations": m.activations, "mfu": plan.mfu,
    }
    for k, st in enumerate(plan_stages(plan)):
        for f in ("time", "memory"):
            if isinstance(getattr(st, f, None), (int, float)):
                out[f"stage {k} {f}"] = float(getattr(st, f))
    return out


def _fmt_cost(name: str, v: float) -> str:
    if name == "mfu":
        return f"{v * 100:.2f}%"
    if "memory" in name:
        return f"{v / GiB:.4f} GiB"
    return fmt_time(v)


def _rel(old: float, new: float) -> float:
    if old == new:
        return 0.0
    return (new - old) / abs(old) if old else float("inf")


STAGE_FIELDS = ("ranks", "mesh_shape", "layers", "has_pre", "has_post", "zero", "recompute", "in_flight")


def _stage_text(st) -> str:
    return " ".join(f"{f}={getattr(st, f)!r}" for f in STAGE_FIELDS if hasattr(st, f))


def _stages_repr(plan) -> tuple:
    """The pipeline's structure (not its costs): schedule, micro-batches, each stage's fields."""
    stages = plan_stages(plan)
    return ((f"{len(stages)} stage(s), {getattr(plan, 'micro_batches', 1)} micro-batch(es),"
             f" schedule {getattr(plan, 'schedule', None)}"),) + tuple(
        f"stage {k}: {_stage_text(st)}" for k, st in enumerate(stages))


@dataclass
class PlanDiff:
    """What changed from plan ``old`` to plan ``new`` (each list holds tuples of strings/floats)."""

    old_name: str
    new_name: str
    mesh: tuple | None = None  # (old mesh, new mesh) when they differ
    fingerprint_changed: bool = False
    placements: list = field(default_factory=list)  # (kind, name, old, new); None = absent
    nodes: list = field(default_factory=list)  # (node, module, old strategy, new strategy)
    node_stages: list = field(default_factory=list)  # (node, old stage, new stage)
    stages: tuple | None = None  # (old, new) stage descriptions when they differ
    costs: dict = field(default_factory=dict)  # field -> (old, new), every cost field

    @property
    def sharding_changed(self) -> bool:
        return bool(self.mesh or self.placements or self.nodes or self.node_stages or self.stages)

    def regressions(self, rtol: float) -> list[str]:
        """Step time or peak memory grown by more than ``rtol``."""
        return [k for k in ("step time", "peak memory") if _rel(*self.costs[k]) > rtol]

    def improvements(self, rtol: float) -> list[str]:
        return [k for k in ("step time", "peak memory") if _rel(*self.costs[k]) < -rtol]

    def text(self, *, rtol: float = 0.0, limit: int = 25) -> str:
        """The diff as text: changed shardings and stages, then cost fields that moved by more
        than ``rtol`` (all that moved when ``rtol`` is 0); at most ``limit`` lines per list."""
        lines = []
        if self.mesh:
            lines.append(f"mesh changed: {self.mesh[0]} -> {self.mesh[1]}")
        if self.fingerprint_changed:
            lines.append("the model's graph changed (fingerprints differ): node names may not correspond")
        if self.placements:
            lines.append(f"sharding changed for {len(self.placements)} parameter(s)/input(s):")
            width = min(60, max(len(p[1]) for p in self.placements))
            kw = max(len(p[0]) for p in self.placements)
            for kind, name, a, b in self.placements[:limit]:
                lines.append(f"  {kind:{kw}s} {name:{width}s}  {_pl(a)} -> {_pl(b)}")
            lines += _more(self.placements, limit)
        if self.nodes:
            lines.append(f"strategy changed for {len(self.nodes)} node(s):")
            for node, module, a, b in self.nodes[:limit]:
                lines.append(f"  {node} ({module or '-'}): {a or 'absent'}  =>  {b or 'absent'}")
            lines += _more(self.nodes, limit)
        if self.stages:
            lines.append("pipeline changed:")
            a, b = self.stages
            for k in range(max(len(a), len(b))):
                x, y = (a[k] if k < len(a) else "absent"), (b[k] if k < len(b) else "absent")
                if x != y:
                    lines += [f"  - {x}", f"  + {y}"]
        if self.node_stages:
            lines.append(f"stage changed for {len(self.node_stages)} node(s):")
            for node, a, b in self.node_stages[:limit]:
                lines.append(f"  {node}: stage {a} -> {b}")
            lines += _more(self.node_stages, limit)
        moved = [(k, a, b) for k, (a, b) in self.costs.items() if abs(_rel(a, b)) > rtol and a != b]
        if moved:
            lines.append("predicted costs that moved" + (f" by more than {rtol:.1%}:" if rtol else ":"))
            for k, a, b in moved:
                r = _rel(a, b)
                pct = f"{r:+.1%}" if r != float("inf") else "new"
                lines.append(f"  {k:20s} {_fmt_cost(k, a):>14s} -> {_fmt_cost(k, b):>14s}  ({pct})")
        return "\n".join(lines) if lines else "no differences"


def _pl(p) -> str:
    return "absent" if p is None else ",".join(p)


def _more(items, limit) -> list[str]:
    return [f"  ... and {len(items) - limit} more"] if len(items) > limit else []


def diff_plans(old, new) -> PlanDiff:
    """Everything that differs between two plans (see :class:`PlanDiff`)."""
    d = PlanDiff(old.name, new.name)
    if tuple(old.mesh_shape) != tuple(new.mesh_shape):
        d.mesh = (tuple(old.mesh_shape), tuple(new.mesh_shape))
    d.fingerprint_changed = old.fingerprint != new.fingerprint
    tables = [("parameter", old.parameter_placements, new.parameter_placements),
              ("input", old.input_placements, new.input_placements)]
    old_stages, new_stages = plan_stages(old), plan_stages(new)
    for k in range(max(len(old_stages), len(new_stages))):
        so = old_stages[k] if k < len(old_stages) else None
        sn = new_stages[k] if k < len(new_stages) else None
        for attr, kind in (("parameter_placements", f"s{k} param"), ("input_placements", f"s{k} input")):
            tables.append((kind, getattr(so, attr, None) or {}, getattr(sn, attr, None) or {}))
    for kind, a, b in tables:
        for name in sorted(set(a) | set(b)):
            pa, pb = a.get(name), b.get(name)
            if (tuple(pa) if pa else None) != (tuple(pb) if pb else None):
                d.placements.append((kind, name, pa, pb))
    old_nodes = {n.node: n for n in old.nodes}
    new_nodes = {n.node: n for n in new.nodes}
    old_index, new_index = stage_index(old), stage_index(new)
    for name in list(old_nodes) + [n for n in new_nodes if n not in old_nodes]:
        a, b = old_nodes.get(name), new_nodes.get(name)
        sa, sb = (a.strategy if a else None), (b.strategy if b else None)
        if sa != sb:
            d.nodes.append((name, (b or a).module, sa, sb))
        elif a and b and old_index.get(name) != new_index.get(name):
            d.node_stages.append((name, old_index.get(name), new_index.get(name)))
    if _stages_repr(old) != _stages_repr(new):
        d.stages = (_stages_repr(old), _stages_repr(new))
    oc, nc = _cost_fields(old), _cost_fields(new)
    d.costs = {k: (oc[k], nc[k]) for k in oc if k in nc}
    return d


def _caller_dir() -> str:
    frame = sys._getframe(2)
    f = frame.f_globals.get("__file__")
    return os.path.dirname(os.path.abspath(f)) if f else os.getcwd()


def _update_requested(update) -> bool:
    if update is not None:
        return bool(update)
    return os.environ.get(UPDATE_ENV, "") not in ("", "0", "false", "False")


def assert_plan_matches(plan, golden, *, cost_rtol: float = 0.02, update: bool | None = None) -> None:
    """Fail (:class:`PlanMismatch`, an AssertionError) when ``plan`` differs from the golden plan
    file ``golden`` in sharding or stages, or regresses its predicted step time or peak memory
    by more than ``cost_rtol`` (relative). ``update`` (default: ``$AUTOPAR_UPDATE_GOLDEN``)
    rewrites a missing or mismatching golden file instead of failing. See the module docstring."""
    if not isinstance(plan, Plan):
        raise PlanError(f"assert_plan_matches needs a Plan, got {type(plan).__name__}")
    if not (isinstance(cost_rtol, (int, float)) and 0 <= cost_rtol < 1):
        raise PlanError(f"cost_rtol must be in [0, 1), got {cost_rtol!r}")
    path = os.fspath(golden)
    if not os.path.isabs(path):
        path = os.path.join(_caller_dir(), path)
    want_update = _update_requested(update)
    if not os.path.exists(path):
        if want_update:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            plan.save(path)
            return
        raise PlanMismatch(f"no golden plan at {path}: create it with pytest --autopar-update-golden"
                           f" (or {UPDATE_ENV}=1), then review and commit it")
    try:
        expected = Plan.load(path)
    except PlanError:
        if not want_update:
            raise
        plan.save(path)  # a golden file from another schema version: rewrite it as asked
        return
    d = diff_plans(expected, plan)
    regressed = d.regressions(cost_rtol)
    if d.sharding_changed or regressed:
        if want_update:
            plan.save(path)
            return
        why = []
        if d.sharding_changed:
            why.append("shardings changed")
        if regressed:
            why.append(f"{' and '.join(regressed)} regressed by more than {cost_rtol:.1%}")
        raise PlanMismatch(
            f"plan {plan.name!r} does not match golden {path}: {'; '.join(why)}\n"
            + d.text(rtol=cost_rtol)
            + f"\nif the new plan is right: pytest --autopar-update-golden (or {UPDATE_ENV}=1)"
        )
    better = d.improvements(cost_rtol)
    if better:
        if want_update:
            plan.save(path)
            return
        warnings.warn(GoldenStaleWarning(
            f"plan {plan.name!r} improves on golden {path} ({', '.join(better)} down by more than"
            f" {cost_rtol:.1%}); update it with pytest --autopar-update-golden\n" + d.text(rtol=cost_rtol)),
            stacklevel=2)


__all__ = ["GoldenStaleWarning", "PlanDiff", "PlanMismatch", "assert_plan_matches", "diff_plans"]
