"""The nightly property run: many random models × meshes × plans on gloo ranks against one process.

CI runs ``tests/test_properties.py`` with a few derandomized examples and no shrinking; this runs
the same property with fresh randomness, many examples and Hypothesis's shrinking, and prints
its statistics (which models, meshes and plans were drawn, how many stored sharded tensors)::

    python benchmarks/properties_nightly.py                  # 50 examples per kind of plan: 350
    python benchmarks/properties_nightly.py --examples 1000 --seed 7

It exits with pytest's status: 0 when every example trained like one process, 1 with the
shrunk failing example printed otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEST = os.path.join(HERE, os.pardir, "tests", "test_properties.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50,
                        help="Hypothesis examples per kind of plan, of 7 (default 50)")
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error("--examples must be positive")
    env = {**os.environ, "AUTOPAR_PROPERTY_EXAMPLES": str(args.examples), "AUTOPAR_PROPERTY_NIGHTLY": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.normpath(TEST),
           "--hypothesis-show-statistics"]
    if args.seed is not None:
        cmd.append(f"--hypothesis-seed={args.seed}")
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
