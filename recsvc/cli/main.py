"""The ``recsvc`` console script: one entry point, one subcommand module per concern.

Each subcommand module exposes ``register(subparsers)``; handlers import their heavy dependencies lazily so
``recsvc --help`` stays fast. A :class:`recsvc.errors.UserError` (or a missing input file) becomes
``error: ...`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from recsvc.cli.worker_exit import finish_worker
from recsvc.errors import UserError

# subcommand name -> module with register(subparsers); modules are added as the product grows.
SUBCOMMANDS: dict[str, str] = {
    "data": "training.data.cli",
    "tokenizer": "tokenizer_rqvae.cli",
    "train": "training.cli",
    "build": "training.build_cli",
    "bundle": "recsvc.cli.bundle",
    "catalog": "recsvc.cli.catalog",
    "eval": "training.eval_cli",
    "prior": "training.prior_cli",
    "tune": "training.tune",
    "bench": "recsvc.bench.cli",
    "serve": "recsvc.service.cli",
    "client": "recsvc.client.cli",
    "demo": "recsvc.cli.demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsvc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a stage not built yet must not break the others
            if exc.name and module_name.startswith(exc.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command -> its exit code; a torchrun worker leaves here (``recsvc.cli.worker_exit``)."""
    code = _run(argv)
    finish_worker(code)
    return code


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: file not found: {exc.filename or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
