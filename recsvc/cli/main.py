"""The ``recsvc`` console script: one entry point, one subcommand module per concern.

Each subcommand module exposes ``register(subparsers)`` and is declared in pyproject.toml's ``recsvc.commands``
entry points (``recsvc/commands.py`` reads them; a command whose package is not installed is skipped); handlers
import their heavy dependencies lazily so ``recsvc --help`` stays fast. A :class:`recsvc.errors.UserError` (or a
missing input file) becomes ``error: ...`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

from recsvc import commands
from recsvc.cli.worker_exit import finish_worker
from recsvc.errors import UserError
from recsvc_base.progress import ENV_MODE, MODES, quiet_library_bars


def register_command(name: str, sub: argparse._SubParsersAction) -> None:
    """Registers the one subcommand ``name`` (its module alone, e.g. without the service's gRPC code)."""
    found = commands.load(commands.COMMANDS, name)
    if not found:
        raise UserError(f"no command {name!r} is installed")
    found[0][1](sub)


def run_command(name: str, argv: list[str]) -> None:
    """One ``recsvc`` subcommand in this process, registering only its own module (the service's gRPC code is not
    imported: a GPU image without it runs the build and training commands); a non-zero exit raises UserError."""
    print("$ recsvc " + name + " " + " ".join(argv), flush=True)
    parser = argparse.ArgumentParser(prog="recsvc")
    register_command(name, parser.add_subparsers(dest="command"))
    args = parser.parse_args([name, *argv])
    if int(args.func(args) or 0) != 0:
        raise UserError(f"`recsvc {name} {' '.join(argv)}` failed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsvc", description=__doc__.splitlines()[0])
    parser.add_argument("--progress", choices=MODES, default=None,
                        help="progress display: bar (redrawn bars), line (a plain line at most once a minute), "
                             "off; default auto: bars on a terminal, lines otherwise (env RECSVC_PROGRESS; "
                             "TQDM_DISABLE=1 silences both)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, register in commands.load(commands.COMMANDS):
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command -> its exit code; a torchrun worker leaves here (``recsvc.cli.worker_exit``)."""
    code = _run(argv)
    finish_worker(code)
    return code


def missing_file_message(exc: FileNotFoundError | PermissionError) -> str:
    """What the user is told about an input file that could not be opened. safetensors reports a file that exists
    but cannot be read (e.g. written 0600 by another user, read by a container's user) as "No such file or
    directory": such a file is named as unreadable, with its mode and owner."""
    path = exc.filename or str(exc).rpartition("No such file or directory: ")[2]
    if isinstance(exc, PermissionError) or (path and os.path.exists(path) and not os.access(path, os.R_OK)):
        try:
            st = os.stat(path)
        except OSError:
            return f"permission denied: {path or exc}"
        return (f"cannot read {path}: permission denied (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}, "
                f"gid {st.st_gid}; this process runs as uid {os.getuid()}, gid {os.getgid()})")
    return f"file not found: {exc.filename or exc}"


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.progress is not None:  # the environment carries it to worker processes (torchrun) too
        os.environ[ENV_MODE] = args.progress
    quiet_library_bars()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError) as exc:
        print(f"error: {missing_file_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
