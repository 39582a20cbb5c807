"""Rule checker: every strategy of every registered op, run sharded in one process vs unsharded.

    python -m autopar.passes.rules.check                 # all ops
    python -m autopar.passes.rules.check --op aten.mm.default

Each op's registered samples are sharded as a strategy says on meshes of 1, 2 and 3 axes, the
op runs per simulated rank, the outputs are assembled (``Partial`` summed) and compared with
the unsharded op. Exit status 1 if any strategy is wrong or an op has no samples.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch

from autopar.core.ir import spec_of_call
from autopar.passes import rules
from autopar.passes.rules.registry import entry, registered_ops, strategies
from autopar.passes.rules.simulate import check_strategy

CHECK_MESHES: tuple[tuple[int, ...], ...] = ((2,), (4,), (2, 2), (2, 2, 2))


@dataclass
class OpReport:
    op: str
    checked: int = 0
    failures: list[str] = field(default_factory=list)
    sharded_strategies: int = 0


def check_op(op, meshes=CHECK_MESHES) -> OpReport:
    """Check every strategy of ``op`` on each of its samples and meshes."""
    ent = entry(op)
    report = OpReport(str(op))
    if ent is None or ent.samples is None:
        report.failures.append("no samples registered: the rule cannot be checked")
        return report
    torch.manual_seed(0)
    for args, kwargs in ent.samples():
        result = op(*args, **kwargs)
        spec = spec_of_call(op, args, kwargs, result)
        for mesh in meshes:
            for strat in strategies(spec, mesh):
                if any(any(not isinstance(p, rules.Replicate) for p in s) for s in strat.outputs + strat.inputs):
                    report.sharded_strategies += 1
                try:
                    check_strategy(op, args, kwargs, strat, mesh)
                except Exception as exc:  # report every failure, keep checking
                    report.failures.append(f"mesh {mesh} {strat.name}: {type(exc).__name__}: {exc}")
                report.checked += 1
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.passes.rules.check", description=__doc__.split("\n")[0])
    parser.add_argument("--op", action="append", help="check only this op (e.g. aten.mm.default); repeatable")
    args = parser.parse_args(argv)
    ops = registered_ops()
    if args.op:
        wanted = set(args.op)
        ops = [op for op in ops if str(op) in wanted]
        missing = wanted - {str(op) for op in ops}
        if missing:
            print(f"no rule registered for: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
    total = failed = 0
    for op in ops:
        rep = check_op(op)
        total += rep.checked
        failed += len(rep.failures)
        status = "ok" if not rep.failures else f"{len(rep.failures)} FAILED"
        print(f"{rep.op:55s} {rep.checked:5d} strategies checked  {status}")
        for f in rep.failures[:5]:
            print(f"    {f}")
    print(f"{len(ops)} ops, {total} strategy checks, {failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
