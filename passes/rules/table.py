"""The README's table of supported ops, generated from the registry (written into README.md by
``python -m autopar.readme --write README.md``)."""

from __future__ import annotations

from autopar.passes import rules  # noqa: F401  (registers every family)
from autopar.passes.rules.derived import pointwise_ops
from autopar.passes.rules.registry import entry, registered_ops


def markdown_table() -> str:
    """One row per rule family: how many ops and which; the elementwise rules derived from
    torch's ``pointwise`` tag form the row ``derived (Tag.pointwise)``."""
    families: dict[str, list[str]] = {}
    for op in registered_ops():
        family = entry(op).rule.__module__.rsplit(".", 1)[-1]
        families.setdefault(family, []).append(str(op).removeprefix("aten."))
    families["derived (Tag.pointwise)"] = [str(op).removeprefix("aten.") for op in pointwise_ops()]
    lines = ["| family | ops | ATen ops with a sharding rule |", "|---|---|---|"]
    for family in sorted(families):
        ops = families[family]
        lines.append(f"| {family} | {len(ops)} | {', '.join(f'`{o}`' for o in ops)} |")
    lines.append(f"| **total** | **{sum(len(v) for v in families.values())}** | |")
    return "\n".join(lines)
