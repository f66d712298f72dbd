"""The recipe's stages: one frozen dataclass per kind of step, its parameters typed and defaulted as the served
recipe runs them (the Makefile's ``beauty-ids`` / ``beauty-target``).

A stage is data: ``commands(paths)`` turns it into the ``recsvc`` command lines it runs (each a :class:`Command`,
run in-process by ``recsvc.cli.main.run_command``), so the recipe, the benches and ``tune capacity`` run the same
commands with the same flags. An optional field left ``None`` is not passed (the command's own default applies).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

Users = int | Literal["all"]


@dataclass(frozen=True)
class RecipePaths:
    """Where one run of a recipe reads and writes: the split data, the bundle, the semantic ids file (the ids
    stage writes it and its SASRec beside it, ``IDS_DIR-sasrec``; None: the build's own RQ-VAE ids)."""

    data: Path
    bundle: Path
    ids: Path | None = None

    @property
    def ids_dir(self) -> Path:
        if self.ids is None:
            raise ValueError("this stage needs the semantic ids file (--ids)")
        return self.ids.parent

    @property
    def sasrec_dir(self) -> Path:
        """The ids' collaborative SASRec (the Makefile's ``$(IDS)-sasrec``)."""
        return Path(f"{self.ids_dir}-sasrec")


@dataclass(frozen=True)
class Command:
    """One ``recsvc NAME ARGV...`` command line."""

    name: str
    argv: tuple[str, ...]

    def line(self) -> str:
        return " ".join(("recsvc", self.name, *self.argv))


def _opt(flag: str, value: object) -> list[str]:
    """``[flag, str(value)]``, or nothing for None."""
    return [] if value is None else [flag, str(value)]


def _flag(flag: str, on: bool) -> list[str]:
    return [flag] if on else []


@dataclass(frozen=True)
class Ids:
    """The item ids: a train-period SASRec (its item table is the ids' collaborative term, LETTER-style), then
    ``tokenizer build`` (RQ-VAE over the item texts + that term, the cold-start protocol through ``known_through``).
    """

    name: str = "ids"
    fit_on: str = "train"
    threads: int | None = 1
    cache_dir: str = "artifacts/baselines"
    sasrec_max_minutes: float = 30
    known_through: str = "valid"
    cf_weight: float = 0.1
    rqvae_epochs: int | None = None

    def commands(self, paths: RecipePaths) -> list[Command]:
        sasrec = ["sasrec", "--data", str(paths.data), "--fit-on", self.fit_on, "--out", str(paths.sasrec_dir),
                  *_opt("--threads", self.threads), "--cache-dir", self.cache_dir,
                  "--max-minutes", str(self.sasrec_max_minutes)]
        build = ["build", "--data", str(paths.data), "--out", str(paths.ids_dir), "--known-through",
                 self.known_through, "--cf-embeddings", str(paths.sasrec_dir / "model.safetensors"),
                 "--cf-weight", str(self.cf_weight), *_opt("--epochs", self.rqvae_epochs)]
        return [Command("train", tuple(sasrec)), Command("tokenizer", tuple(build))]


@dataclass(frozen=True)
class Target:
    """``recsvc build``: tokenizer and target LM over the ids (deploy protocol: selected on the train period, then
    refit on train + valid), the schedule sized to ``max_minutes`` (``fit_budget``), the dense head beside it."""

    name: str = "target"
    preset: str = "small"
    prompt: str = "compact"
    window_stride: int = 5
    protocol: str = "deploy"
    refit: str | None = "scratch"
    refit_epochs: str | None = "auto"
    threads: int | None = 2
    max_minutes: float | None = 25
    fit_budget: bool = True
    epochs: int = 6
    seed: int | None = 0
    dense_head: float | None = 1.0
    patience: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    drafter_preset: str | None = None
    drafter_epochs: int | None = None
    recall_users: int | None = None
    eval_users: int | None = None
    optimizer: str | None = None
    prior_loss: float | None = None  # the transition prior inside the target's loss at this weight (None: off)
    dropout: float | None = None  # dropout while the target trains (training.target_lm.dropout; None: none)

    def commands(self, paths: RecipePaths) -> list[Command]:
        argv = ["--data", str(paths.data), "--out", str(paths.bundle), *_opt("--ids", paths.ids),
                "--preset", self.preset, "--prompt", self.prompt, "--window-stride", str(self.window_stride),
                "--protocol", self.protocol, *_opt("--refit", self.refit), *_opt("--refit-epochs", self.refit_epochs),
                *_opt("--threads", self.threads), *_opt("--max-minutes", self.max_minutes),
                *_flag("--fit-budget", self.fit_budget), "--epochs", str(self.epochs), *_opt("--seed", self.seed),
                *_opt("--dense-head", self.dense_head), *_opt("--patience", self.patience),
                *_opt("--batch-size", self.batch_size), *_opt("--lr", self.lr),
                *_opt("--drafter-preset", self.drafter_preset), *_opt("--drafter-epochs", self.drafter_epochs),
                *_opt("--recall-users", self.recall_users), *_opt("--eval-users", self.eval_users),
                *_opt("--optimizer", self.optimizer), *_opt("--prior-loss", self.prior_loss),
                *_opt("--dropout", self.dropout)]
        return [Command("build", tuple(argv))]


@dataclass(frozen=True)
class ItemTarget:
    """``recsvc train items --bundle``: the item-level target (a timeline over items and a small code decoder) over
    the ids, deploy protocol (the epoch chosen on the train period's validation, then a fresh model trained that
    long on train + valid). Fields left None take the command's defaults (training/item_target/command.py)."""

    name: str = "target"
    protocol: str = "deploy"
    epochs: int = 20
    threads: int | None = 1
    seed: int | None = 0
    dropout: float | None = None
    crop: float | None = None
    hidden: int | None = None
    layers: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    patience: int | None = None
    max_minutes: float | None = None

    def commands(self, paths: RecipePaths) -> list[Command]:
        argv = ["items", "--bundle", str(paths.bundle), "--protocol", self.protocol, "--epochs", str(self.epochs),
                *_opt("--threads", self.threads), *_opt("--seed", self.seed), *_opt("--dropout", self.dropout),
                *_opt("--crop", self.crop), *_opt("--hidden", self.hidden), *_opt("--layers", self.layers),
                *_opt("--lr", self.lr), *_opt("--batch-size", self.batch_size), *_opt("--patience", self.patience),
                *_opt("--max-minutes", self.max_minutes)]
        return [Command("train", tuple(argv))]


@dataclass(frozen=True)
class TunePrior:
    """``recsvc tune prior``: the transition prior's fusion, chosen on validation (with history items excluded:
    BUNDLE/prior-excl)."""

    name: str = "prior"
    trials: int = 30
    budget_minutes: float = 25
    users: Users = "all"
    threads: int | None = 1
    exclude_history: bool = False
    dtype: str | None = None
    full_decode: bool = False  # every trial a full decode (the search before trials re-scored cached candidates)

    def commands(self, paths: RecipePaths) -> list[Command]:
        argv = ["prior", "--bundle", str(paths.bundle), "--trials", str(self.trials), "--budget-minutes",
                str(self.budget_minutes), "--users", str(self.users), *_opt("--threads", self.threads),
                *_flag("--exclude-history", self.exclude_history), *_opt("--dtype", self.dtype),
                *_flag("--full-decode", self.full_decode)]
        return [Command("tune", tuple(argv))]


@dataclass(frozen=True)
class TuneMix:
    """``recsvc tune mix``: SASRec mixed into the fused prior, chosen on validation."""

    name: str = "mix"
    trials: int = 25
    budget_minutes: float = 25
    users: Users = "all"
    threads: int | None = 1
    cache_dir: str = "artifacts/baselines"
    sasrec_max_minutes: float = 30
    exclude_history: bool = False
    dtype: str | None = None
    full_decode: bool = False

    def commands(self, paths: RecipePaths) -> list[Command]:
        argv = ["mix", "--bundle", str(paths.bundle), "--trials", str(self.trials), "--budget-minutes",
                str(self.budget_minutes), "--users", str(self.users), *_opt("--threads", self.threads),
                "--cache-dir", self.cache_dir, "--sasrec-max-minutes", str(self.sasrec_max_minutes),
                *_flag("--exclude-history", self.exclude_history), *_opt("--dtype", self.dtype),
                *_flag("--full-decode", self.full_decode)]
        return [Command("tune", tuple(argv))]


@dataclass(frozen=True)
class TuneHistory:
    """``recsvc tune history``: whether served lists leave out the user's history items. The base of the tunings
    that score the served lists of validation users (``users``: a sample; None: all) with one choice rule each."""

    search: ClassVar[str] = "history"
    name: str = "history"
    threads: int | None = 1
    users: int | None = None
    dtype: str | None = None

    def choice_flags(self) -> list[str]:
        """The search's own choice flags."""
        return []

    def commands(self, paths: RecipePaths) -> list[Command]:
        argv = [self.search, "--bundle", str(paths.bundle), *_opt("--threads", self.threads), *self.choice_flags(),
                *_opt("--users", self.users), *_opt("--dtype", self.dtype)]
        return [Command("tune", tuple(argv))]


@dataclass(frozen=True)
class TuneDense(TuneHistory):
    """``recsvc tune dense``: how the dense head's items merge into the lists (``rule``: the choice rule)."""

    search: ClassVar[str] = "dense"
    name: str = "dense"
    rule: str = "cold-guard"

    def choice_flags(self) -> list[str]:
        return ["--rule", self.rule]


@dataclass(frozen=True)
class TuneFresh(TuneHistory):
    """``recsvc tune fresh``: the fresh-item slots (``gate``: how a fresh item qualifies)."""

    search: ClassVar[str] = "fresh"
    name: str = "fresh"
    gate: str = "rate"

    def choice_flags(self) -> list[str]:
        return ["--gate", self.gate]


@dataclass(frozen=True)
class TrainHead:
    """``recsvc train head``: the served draft head, aligned to the target (``method``, ``alpha``)."""

    name: str = "head"
    method: str = "wordkd"
    alpha: float = 1.0
    prefixes: int = 12000
    epochs: int = 6
    threads: int | None = 1
    dtype: str | None = None

    def commands(self, paths: RecipePaths) -> list[Command]:
        argv = ["head", "--bundle", str(paths.bundle), "--method", self.method, "--alpha", str(self.alpha),
                "--prefixes", str(self.prefixes), "--epochs", str(self.epochs), *_opt("--threads", self.threads),
                *_opt("--dtype", self.dtype)]
        return [Command("train", tuple(argv))]


Stage = Ids | Target | ItemTarget | TunePrior | TuneMix | TuneHistory | TuneDense | TuneFresh | TrainHead
