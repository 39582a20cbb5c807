"""The ``autopar`` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    print(
        "autopar demo: not built yet. Capture and sharding rules work today;"
        " planning, the baseline comparison and the 2-rank run land with later issues."
    )
    return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description="Auto-parallel graph compiler for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan a GPT-2-style model for a DGX cluster and check a 2-rank run")
    demo.set_defaults(func=_demo)
    from autopar.profiler import add_profile_arguments, run_profile_command

    profile = sub.add_parser("profile", help="measure this machine's devices and collectives; cache the results")
    add_profile_arguments(profile)
    profile.set_defaults(func=run_profile_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
