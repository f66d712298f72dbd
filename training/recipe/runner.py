"""Run a recipe stage by stage, resumably.

Each stage runs its ``recsvc`` commands in this process (``recsvc.cli.main.run_command``: the same flags and
outputs as on a command line); when all of them finish, BUNDLE/bundle.json records the stage under "recipe"
(``{"<stage>": {"done": true, "commands": [...], "seconds": ..., "finished_at": ...}}``). A later run skips a stage
recorded done with the same command lines; one whose parameters changed since runs again (each command resumes by
itself: a finished build stage or tuning study is kept, see their own docs). An interrupted stage is not recorded
and runs again, its commands resuming where they stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from recsvc.bundle.directory import Bundle
from training.recipe.stages import Command, RecipePaths, Stage

RECORD = "recipe"  # the bundle.json key of the stages' records


def recorded(bundle: Bundle) -> dict[str, Any]:
    """The bundle's recipe records, by stage name ({} before any)."""
    return dict(bundle.read().get(RECORD) or {})


def is_done(records: dict[str, Any], name: str, commands: Sequence[Command]) -> bool:
    rec = records.get(name) or {}
    return bool(rec.get("done")) and rec.get("commands") == [c.line() for c in commands]


def record_done(bundle: Bundle, name: str, commands: Sequence[Command], seconds: float) -> None:
    meta = bundle.read()
    records = dict(meta.get(RECORD) or {})
    records[name] = {"done": True, "commands": [c.line() for c in commands], "seconds": round(seconds, 1),
                     "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    bundle.update(**{RECORD: records})


def default_run(command: Command) -> None:
    from recsvc.cli.main import run_command

    run_command(command.name, list(command.argv))


def run_recipe(stages: Sequence[Stage], paths: RecipePaths, label: str = "recipe", dry_run: bool = False,
               run: Callable[[Command], None] = default_run, say: Callable[[str], None] = print) -> dict[str, str]:
    """Run ``stages`` in order into ``paths.bundle`` -> {stage: "done" | "skipped" | "would run" | "would skip"}."""
    existing = Bundle(paths.bundle).meta_path.is_file()
    bundle = Bundle.create(paths.bundle, data=paths.data) if existing or not dry_run else None
    outcome: dict[str, str] = {}
    start = time.monotonic()
    for n, stage in enumerate(stages, 1):
        commands = stage.commands(paths)
        records = recorded(bundle) if bundle is not None else {}
        head = f"[{label} {n}/{len(stages)}] {stage.name}"
        done = is_done(records, stage.name, commands)
        if dry_run:
            outcome[stage.name] = "would skip" if done else "would run"
            say(f"{head}: {'done earlier' if done else 'to run'}")
            for c in commands:
                say(f"  {c.line()}")
            continue
        assert bundle is not None
        if done:
            outcome[stage.name] = "skipped"
            say(f"{head}: done earlier ({records[stage.name].get('finished_at')}), skipped")
            continue
        if records.get(stage.name, {}).get("done"):
            say(f"{head}: recorded with other parameters; running its commands again (each keeps what it finds "
                "finished: `recsvc build` keeps a trained target, so a new target wants a new bundle)")
        say(f"{head}: running ({len(commands)} command{'s' if len(commands) > 1 else ''})")
        t0 = time.monotonic()
        for c in commands:
            run(c)
        seconds = time.monotonic() - t0
        record_done(bundle, stage.name, commands, seconds)
        outcome[stage.name] = "done"
        say(f"{head}: finished in {seconds / 60:.1f} min (recipe so far {(time.monotonic() - start) / 60:.1f} min)")
    return outcome


def run_stage(stage: Stage, paths: RecipePaths, run: Callable[[Command], None] = default_run) -> None:
    """One stage's commands, unrecorded (a caller that keeps its own record: ``tune capacity``, the GPU benches)."""
    for command in stage.commands(paths):
        run(command)
