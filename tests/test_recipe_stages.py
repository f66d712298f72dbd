"""The recipe as code (training/recipe): each stage's command lines equal the ones the Makefile listed before the
recipe became code, the Makefile's targets reach them through ``recsvc build --recipe`` (read from ``make -n``),
and the Makefile lists no tuning command of its own."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from recsvc.errors import UserError
from training.build_cli import register
from training.recipe.recipes import SERVED, WEAK, override, parse_value, select
from training.recipe.stages import RecipePaths

ROOT = Path(__file__).resolve().parents[1]

# the Makefile's beauty-ids / beauty-target / weak-target-beauty command lines before the recipe became code, with
# its variables at their defaults (BEAUTY=data/beauty, BUNDLE=artifacts/beauty/bundle, IDS=artifacts/beauty/ids,
# CF_WEIGHT=0.1, TARGET_MINUTES=25, TARGET_THREADS=2, REFIT=scratch, DENSE_HEAD=1.0, SEED=0, SASREC_MINUTES=30,
# WEAK=artifacts/beauty-weak)
TODAY_SERVED = {
    "ids": [
        "recsvc train sasrec --data data/beauty --fit-on train --out artifacts/beauty/ids-sasrec --threads 1 "
        "--cache-dir artifacts/baselines --max-minutes 30",
        "recsvc tokenizer build --data data/beauty --out artifacts/beauty/ids --known-through valid "
        "--cf-embeddings artifacts/beauty/ids-sasrec/model.safetensors --cf-weight 0.1",
    ],
    "target": [
        "recsvc build --data data/beauty --out artifacts/beauty/bundle --ids artifacts/beauty/ids/semantic_ids.json "
        "--preset small --prompt compact --window-stride 5 --protocol deploy --refit scratch --refit-epochs auto "
        "--threads 2 --max-minutes 25 --fit-budget --epochs 6 --seed 0 --dense-head 1.0"],
    "prior": ["recsvc tune prior --bundle artifacts/beauty/bundle --trials 30 --budget-minutes 25 --users all "
              "--threads 1"],
    "prior-excl": ["recsvc tune prior --bundle artifacts/beauty/bundle --trials 30 --budget-minutes 25 --users all "
                   "--threads 1 --exclude-history"],
    "mix": ["recsvc tune mix --bundle artifacts/beauty/bundle --trials 25 --budget-minutes 25 --users all --threads 1 "
            "--cache-dir artifacts/baselines --sasrec-max-minutes 30"],
    "mix-excl": ["recsvc tune mix --bundle artifacts/beauty/bundle --trials 25 --budget-minutes 25 --users all "
                 "--threads 1 --cache-dir artifacts/baselines --sasrec-max-minutes 30 --exclude-history"],
    "history": ["recsvc tune history --bundle artifacts/beauty/bundle --threads 1"],
    "dense": ["recsvc tune dense --bundle artifacts/beauty/bundle --threads 1 --rule cold-guard"],
    "fresh": ["recsvc tune fresh --bundle artifacts/beauty/bundle --threads 1 --gate rate"],
    "head": ["recsvc train head --bundle artifacts/beauty/bundle --method wordkd --alpha 1.0 --prefixes 12000 "
             "--epochs 6 --threads 1"],
}
TODAY_WEAK = {
    "target": [
        "recsvc build --data data/beauty --out artifacts/beauty-weak/bundle --ids "
        "artifacts/beauty/ids/semantic_ids.json --preset small --prompt compact --window-stride 5 --protocol deploy "
        "--refit scratch --refit-epochs auto --threads 2 --epochs 1 --patience 0"],
    "prior": ["recsvc tune prior --bundle artifacts/beauty-weak/bundle --trials 20 --budget-minutes 8 --users 1000 "
              "--threads 2"],
    "prior-excl": ["recsvc tune prior --bundle artifacts/beauty-weak/bundle --trials 20 --budget-minutes 8 "
                   "--users 1000 --threads 2 --exclude-history"],
    "mix": ["recsvc tune mix --bundle artifacts/beauty-weak/bundle --trials 25 --budget-minutes 10 --users 1000 "
            "--threads 2 --cache-dir artifacts/baselines --sasrec-max-minutes 30"],
    "mix-excl": ["recsvc tune mix --bundle artifacts/beauty-weak/bundle --trials 25 --budget-minutes 10 "
                 "--users 1000 --threads 2 --cache-dir artifacts/baselines --sasrec-max-minutes 30 --exclude-history"],
    "history": ["recsvc tune history --bundle artifacts/beauty-weak/bundle --threads 2"],
}
IDS = Path("artifacts/beauty/ids/semantic_ids.json")


def lines(stages, paths: RecipePaths) -> dict[str, list[str]]:
    return {s.name: [c.line() for c in s.commands(paths)] for s in stages}


def test_each_stage_runs_todays_command_lines() -> None:
    assert lines(SERVED, RecipePaths(Path("data/beauty"), Path("artifacts/beauty/bundle"), IDS)) == TODAY_SERVED
    assert lines(WEAK, RecipePaths(Path("data/beauty"), Path("artifacts/beauty-weak/bundle"), IDS)) == TODAY_WEAK


def make_recipe_runs(*targets: str) -> list[list[str]]:
    """The ``recsvc build --recipe`` lines ``make -n TARGETS`` prints, as argv after ``recsvc build``."""
    assert shutil.which("make"), "make is needed"
    dry = subprocess.run(["make", "-n", "--no-print-directory", *targets, "VENV=/venv"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert dry.returncode == 0, dry.stderr
    return [shlex.split(line)[2:] for line in dry.stdout.replace("\\\n", " ").splitlines()
            if line.startswith("/venv/bin/recsvc build --recipe")]


def build_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["build", *argv])


@pytest.mark.parametrize("target,recipe,today", [("beauty-ids", SERVED, {"ids": TODAY_SERVED["ids"]}),
                                                 ("beauty-target", SERVED, {k: v for k, v in TODAY_SERVED.items()
                                                                            if k != "ids"}),
                                                 ("weak-target-beauty", WEAK, TODAY_WEAK)])
def test_the_makefile_reaches_todays_commands_through_the_recipe(target, recipe, today) -> None:
    runs = make_recipe_runs(target)
    assert len(runs) == 1
    args = build_args(runs[0])
    assert args.recipe == ("weak" if recipe is WEAK else "served")
    stages = select(override(recipe, args.settings), args.from_stage, args.to_stage)
    assert lines(stages, RecipePaths(args.data, args.out, args.ids)) == today


def test_the_makefile_lists_no_tuning_command() -> None:
    commands = [line for line in (ROOT / "Makefile").read_text().splitlines()
                if line.startswith("\t") and not line.lstrip().startswith(("@#", "#"))]
    assert commands and not [c for c in commands if re.search(r"recsvc tune\b", c)]


def test_overrides_are_typed_and_refused_when_they_name_nothing() -> None:
    stages = override(SERVED, ["target.seed=2", "threads=1", "target.max_minutes=0.5", "target.refit=none",
                               "prior.exclude_history=true", "mix.users=200"])
    by = {s.name: s for s in stages}
    assert by["target"].seed == 2 and by["target"].max_minutes == 0.5 and by["target"].refit is None
    assert all(s.threads == 1 for s in stages) and by["prior"].exclude_history is True and by["mix"].users == 200
    assert SERVED[1].seed == 0  # the recipe itself is unchanged
    for bad in ("target.seed=two", "nosuch=1", "ghost.seed=1", "seed", "prior.users=some"):
        with pytest.raises(UserError):
            override(SERVED, [bad])
    assert parse_value(bool, "no", "x") is False
    with pytest.raises(UserError):
        select(SERVED, "head", "ids")


def test_the_build_refuses_its_own_flags_beside_a_recipe_and_recipe_flags_without_one(tmp_path, capsys,
                                                                                         monkeypatch) -> None:
    from cli_commands import only_commands

    import recsvc.cli.main as cli

    only_commands(monkeypatch, "build")
    (tmp_path / "data").mkdir()
    base = ["build", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "b")]
    assert cli.main([*base, "--recipe", "served", "--from", "target", "--preset", "tiny", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "drop --preset, --threads" in err and "--set" in err and not (tmp_path / "b").exists()
    assert cli.main([*base, "--from", "target"]) == 2 and "go with --recipe" in capsys.readouterr().err
    assert cli.main([*base, "--recipe", "served", "--set", "target.seed=x"]) == 2
    assert "target.seed=x" in capsys.readouterr().err
    assert cli.main([*base, "--recipe", "served"]) == 2 and "--ids" in capsys.readouterr().err
    # --dry-run prints the commands and writes nothing
    assert cli.main([*base, "--recipe", "served", "--from", "history", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[served 1/4] history: to run" in out and f"recsvc train head --bundle {tmp_path / 'b'}" in out
    assert not (tmp_path / "b").exists()


def test_the_item_level_recipe_runs_the_item_target_then_the_same_tunings() -> None:
    from training.recipe.recipes import SERVED_ITEMS, TUNINGS

    paths = RecipePaths(Path("data/beauty"), Path("artifacts/beauty-items/bundle"), IDS)
    got = lines(SERVED_ITEMS, paths)
    assert list(got) == ["ids", "target", *(s.name for s in TUNINGS), "fresh"]
    assert got["ids"] == TODAY_SERVED["ids"]
    assert got["target"] == ["recsvc train items --bundle artifacts/beauty-items/bundle --protocol deploy --epochs 20 "
                             "--threads 1 --seed 0"]
    assert [s.name for s in override(SERVED_ITEMS, ["target.crop=0.5"]) if getattr(s, "crop", None)] == ["target"]
