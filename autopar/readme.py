"""README.md sections generated from the code, between ``<!-- NAME:start -->`` / ``<!-- NAME:end -->``
markers: the supported-ops table (from the rule registry) and ring all-reduce vs a parameter
server (from the communication cost model).

    python -m autopar.readme                     # print every section
    python -m autopar.readme --write README.md   # regenerate them in place (atomically)
"""

from __future__ import annotations

import argparse
import sys

from autopar.core.errors import AutoparError
from autopar.cost_models.cluster import GBIT
from autopar.cost_models.communication import Link, flat_time, parameter_server_time
from autopar.passes.rules.table import markdown_table
from autopar.plan.files import write_text

GRADIENT_BYTES = 1e9                       # 250M fp32 gradients
ETHERNET = Link(25 * GBIT, 30e-6)          # one 25 Gbit/s Ethernet port per worker (Alpa's testbed)
WORKERS = (2, 4, 16, 64, 256)


def ring_vs_parameter_server() -> str:
    """Seconds to synchronise 1 GB of gradients per step: ring all-reduce vs parameter servers."""
    lines = ["| workers | ring all-reduce | PS, 1 server | PS, 4 servers | PS, a server per worker |",
             "|---:|---:|---:|---:|---:|"]
    for n in WORKERS:
        ps = [parameter_server_time(GRADIENT_BYTES, workers=n, servers=k, link=ETHERNET) for k in (1, 4, n)]
        ring = flat_time("all_reduce", GRADIENT_BYTES, n, ETHERNET)
        lines.append(f"| {n} | {ring:.2f} s | " + " | ".join(f"{t:.2f} s" for t in ps) + " |")
    return "\n".join(lines)


SECTIONS = {"ops-table": markdown_table, "ring-vs-ps": ring_vs_parameter_server}


def regenerate(text: str) -> str:
    """``text`` with every generated section rewritten between its markers."""
    for name, make in SECTIONS.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        head, sep, rest = text.partition(start)
        _, sep2, tail = rest.partition(end)
        if not sep or not sep2:
            raise AutoparError(f"no {start} ... {end} markers in the text; add them where the section goes")
        text = f"{head}{start}\n{make()}\n{end}{tail}"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="README", help="rewrite the sections in this file")
    args = parser.parse_args(argv)
    if not args.write:
        print("\n\n".join(make() for make in SECTIONS.values()))
        return 0
    with open(args.write) as f:
        text = regenerate(f.read())
    write_text(args.write, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
