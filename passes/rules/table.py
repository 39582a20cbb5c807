"""The README's table of supported ops, generated from the registry.

    python -m autopar.passes.rules.table            # print the markdown table
    python -m autopar.passes.rules.table --write README.md   # replace it between the markers
"""

from __future__ import annotations

import argparse
import sys

from autopar.passes import rules  # noqa: F401  (registers every family)
from autopar.passes.rules.registry import entry, registered_ops

START, END = "<!-- ops-table:start -->", "<!-- ops-table:end -->"


def markdown_table() -> str:
    """One row per rule family: how many ops and which."""
    families: dict[str, list[str]] = {}
    for op in registered_ops():
        family = entry(op).rule.__module__.rsplit(".", 1)[-1]
        families.setdefault(family, []).append(str(op).removeprefix("aten."))
    lines = ["| family | ops | ATen ops with a sharding rule |", "|---|---|---|"]
    for family in sorted(families):
        ops = families[family]
        lines.append(f"| {family} | {len(ops)} | {', '.join(f'`{o}`' for o in ops)} |")
    lines.append(f"| **total** | **{sum(len(v) for v in families.values())}** | |")
    return "\n".join(lines)


def replace_in(text: str) -> str:
    """``text`` with the table between the markers regenerated."""
    head, sep, rest = text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"no {START} ... {END} markers in the text")
    return f"{head}{START}\n{markdown_table()}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="README", help="rewrite the table in this file")
    args = parser.parse_args(argv)
    if args.write:
        with open(args.write) as f:
            text = f.read()
        with open(args.write, "w") as f:
            f.write(replace_in(text))
    else:
        print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
