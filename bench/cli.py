"""`recsvc bench NAME`: benchmarks are commands, not timed tests (BENCHMARKS.md).

Each benchmark is a module declared in pyproject.toml's ``recsvc.benches`` entry points (``recsvc/commands.py``
reads them): its ``HELP`` line, ``add_args(parser)`` and ``run(args)``. One whose package is not installed is
skipped.
"""

from __future__ import annotations

import argparse

from recsvc import commands
from recsvc.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (results go to BENCHMARKS.md)")
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, module in commands.load(commands.BENCHES):
        bp = sub.add_parser(name, help=module.HELP)
        module.add_args(bp)
        bp.set_defaults(func=_runner(module))


def _runner(module):
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "users", 1) is not None and getattr(args, "users", 1) < 1:
            raise UserError("--users must be >= 1")
        module.run(args)
        return 0

    return run
