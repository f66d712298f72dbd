"""Every `recsvc ...` and `make ...` command in README.md runs as written, as far as the parsers can tell.

- `recsvc` commands of the README's code blocks are parsed by the real `recsvc` parser (every command declared in
  pyproject.toml, its real argument types); a command in an inline code span must at least name a real
  (sub)command. No placeholder is left (a bare upper-case word such as `B` or `IDS`, `<...>`, `[...]`, `...`).
- What a parser cannot see: `--ids` of `build` / `tune target` / `tune capacity` is a semantic_ids.json file
  (`tokenizer assign` takes the directory), and every drafter a command names was saved under that name by a
  `recsvc train drafter --out-name NAME` earlier on the page.
- `make` commands: every target is a target of the Makefile, and every `VAR=value` they set is read by them (a
  dry run, `make -n`, with the variable set to a marker value must print the marker).
- The page stays a newcomer's: at most 250 lines, `make test` named as the test command, the quickstart first.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from recsvc.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
# values that stand for a placeholder where the README defines one (none today: it uses example paths)
PLACEHOLDERS: dict[str, str] = {}
BUILTIN_DRAFTERS = {"retrieval", "drafter"}  # `recsvc bench drafters` names that need no trained drafter


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def block_commands(body: str) -> list[list[str]]:
    """The `recsvc` / `make` commands of a shell block as argv lists (continuations joined, comments dropped).

    >>> block_commands("# a comment\\nrecsvc data stats \\\\\\n    --data d   # the split\\nls\\nmake demo")
    [['recsvc', 'data', 'stats', '--data', 'd'], ['make', 'demo']]
    """
    out: list[list[str]] = []
    for line in body.replace("\\\n", " ").splitlines():
        if line.split(" ", 1)[0] not in ("recsvc", "make"):
            continue
        out.append([PLACEHOLDERS.get(w, w) for w in shlex.split(line, comments=True)])
    return out


def readme_commands() -> list[list[str]]:
    return [cmd for lang, body in code_blocks(README.read_text()) if lang in ("", "bash", "sh")
            for cmd in block_commands(body)]


def inline_commands() -> list[list[str]]:
    """`recsvc ...` / `make ...` in inline code spans of the prose (fenced blocks left out)."""
    prose = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M)
    spans = re.findall(r"`((?:recsvc|make) [^`]+)`", prose.replace("\n", " "))
    return [shlex.split(span) for span in spans]


def placeholders(argv: list[str]) -> list[str]:
    return [w for w in argv if re.fullmatch(r"[A-Z][A-Z_]*", w) or re.search(r"<[^>]*>|\[.*\]|\.\.\.", w)]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"`{shlex.join(['recsvc', *argv])}` does not parse: {err.getvalue().strip()}") from None


def test_readme_is_a_newcomers_page():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines (at most {MAX_LINES})"
    first_screen = "\n".join(text.splitlines()[:12])
    assert "What goes in" in first_screen and "What comes out" in first_screen
    commands = readme_commands()
    assert ["make", "test"] in commands and ["make", "demo"] in commands
    assert "## Every day: refresh, gate, swap" in text and "--bundle /models/current" in text


def test_the_daily_loop_fits_in_15_lines_and_each_command_is_run_by_a_test():
    """The daily loop's section (heading to the next heading) is at most 15 lines; its `recsvc` commands are the
    ones tests/test_refresh.py runs end to end (serve a symlink, refresh run --publish it) and
    tests/test_bundle_swap.py (a flip by hand)."""
    text = README.read_text()
    section = text[text.index("## Every day: refresh, gate, swap"):]
    section = section[: section.index("\n## ", 3)]
    assert len(section.strip().splitlines()) <= 15
    commands = [c for lang, body in code_blocks(section) for c in block_commands(body)]
    assert [c[:3] for c in commands] == [["recsvc", "serve", "--bundle"], ["recsvc", "refresh", "run"]]
    refresh = commands[1]
    assert refresh[refresh.index("--bundle") + 1] == refresh[refresh.index("--publish") + 1] == commands[0][3]
    tests = (ROOT / "tests" / "test_refresh.py").read_text()
    assert '"serve", "--bundle", str(current)' in tests and '"--publish", str(current)' in tests


def test_every_recsvc_command_in_a_code_block_parses(parser):
    commands = [argv for argv in readme_commands() if argv[0] == "recsvc"]
    assert len(commands) >= 40, len(commands)
    failures = []
    for argv in commands:
        left = placeholders(argv)
        if left:
            failures.append(f"`{shlex.join(argv)}`: undefined placeholder(s) {left}")
            continue
        try:
            parse(parser, argv[1:])
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


def subcommand_path(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """The (sub)command names of ``words`` that ``parser`` knows, in order, up to the first flag."""
    found: list[str] = []
    current = parser
    for word in words:
        if word.startswith("-"):
            break
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        found.append(word)
        current = subs[0].choices[word]
    return found


def test_inline_recsvc_commands_name_real_commands(parser):
    failures = []
    for argv in inline_commands():
        if argv[0] != "recsvc":
            continue
        path = subcommand_path(parser, argv[1:])
        rest = argv[1 + len(path):]
        if not path or (_has_subcommands(parser, path) and rest and rest[0] != "..." and not rest[0].startswith("-")):
            failures.append(f"`{shlex.join(argv)}`: not a recsvc command (known part: {path})")
    assert not failures, "\n".join(failures)


def _has_subcommands(parser: argparse.ArgumentParser, path: list[str]) -> bool:
    current = parser
    for word in path:
        sub = next(a for a in current._actions if isinstance(a, argparse._SubParsersAction))
        current = sub.choices[word]
    return any(isinstance(a, argparse._SubParsersAction) for a in current._actions)


def test_ids_are_the_semantic_ids_file_where_a_file_is_read(parser):
    failures = []
    for argv in readme_commands():
        if argv[0] != "recsvc" or "--ids" not in argv:
            continue
        value = argv[argv.index("--ids") + 1]
        path = subcommand_path(parser, argv[1:])
        wants_file = path in (["build"], ["tune", "target"], ["tune", "capacity"], ["train", "items"])
        if wants_file != value.endswith("semantic_ids.json"):
            failures.append(f"`{shlex.join(argv)}`: --ids {value} (a {'file' if wants_file else 'directory'} "
                            "is read)")
    assert not failures, "\n".join(failures)


def drafter_names(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The trained drafters a command reads by name."""
    path = subcommand_path(parser, argv[1:])
    args = parse(parser, argv[1:])
    if path == ["bench", "drafters"]:
        return [m for m in args.methods.split(",") if m not in BUILTIN_DRAFTERS]
    if path == ["bench", "speculative"] and args.drafter == "llama" and args.drafter_name:
        return [args.drafter_name]
    if path == ["bench", "seeds"]:
        return [args.reference]
    if path == ["serve"] and getattr(args, "drafter", None) not in (None, "auto"):
        return [args.drafter]
    return []


def test_drafters_are_named_as_the_commands_above_them_saved_them(parser):
    saved: set[str] = set()
    failures = []
    for argv in readme_commands():
        if argv[0] != "recsvc":
            continue
        path = subcommand_path(parser, argv[1:])
        if path == ["train", "drafter"]:
            name = parse(parser, argv[1:]).out_name
            if name:
                saved.add(name)
            continue
        missing = [n for n in drafter_names(parser, argv) if n not in saved]
        if missing:
            failures.append(f"`{shlex.join(argv)}` reads drafter(s) {missing}, saved above: {sorted(saved)}")
    assert not failures, "\n".join(failures)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.MULTILINE)}


def marker(var: str) -> str:
    """A value for ``var`` that the dry run's output shows wherever it is read, also through another variable's
    ``$(dir ...)`` (``IDS ?= $(dir $(BUNDLE))ids``)."""
    return f"/tmp/readme-marker/{var}/x"


def test_every_make_command_names_targets_and_variables_they_read():
    assert shutil.which("make"), "make is needed (the README's quickstart)"
    targets = makefile_targets()
    commands = [argv for argv in readme_commands() + inline_commands() if argv[0] == "make"]
    assert commands
    failures = []
    for argv in commands:
        words = argv[1:]
        names = [w for w in words if "=" not in w]
        assigned = dict(w.split("=", 1) for w in words if "=" in w)
        unknown = [n for n in names if n not in targets]
        if unknown or not names:
            failures.append(f"`{shlex.join(argv)}`: not Makefile targets: {unknown or 'none named'}")
            continue
        if not assigned:
            continue
        dry = subprocess.run(["make", "-n", "--no-print-directory", *names,
                              *(f"{var}={marker(var)}" for var in assigned)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
        assert dry.returncode == 0, f"`make -n {' '.join(names)}`: {dry.stderr[-2000:]}"
        unused = [var for var in assigned if marker(var).removesuffix("x") not in dry.stdout]
        if unused:
            failures.append(f"`{shlex.join(argv)}`: {', '.join(unused)} not read by {' '.join(names)}")
    assert not failures, "\n".join(failures)
