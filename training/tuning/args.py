"""What the ``recsvc tune`` searches share on their command line, and what those flags open: the bundle, its
split data and its semantic ids."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NamedTuple

from recsvc.bundle.loading import PRECISIONS
from training.cli import user_count


def add_bundle_args(p: argparse.ArgumentParser) -> None:
    """``--bundle`` (the bundle tuned) and ``--data`` (its split data, by default the one it was built from)."""
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None, help="data directory (default: the bundle's)")


def add_search_args(p: argparse.ArgumentParser, trials: int, metrics: tuple[str, ...]) -> None:
    """An Optuna search's bounds (``--trials``, ``--budget-minutes``), its validation users and its metric."""
    p.add_argument("--trials", type=int, default=trials)
    p.add_argument("--budget-minutes", type=float, default=15.0)
    p.add_argument("--users", type=user_count, default=1000, metavar="N|all",
                   help="validation users: a fixed random sample of N, or all (every one; the recipe's)")
    p.add_argument("--metric", choices=metrics, default="ndcg@10")


def add_grid_args(p: argparse.ArgumentParser, metrics: tuple[str, ...]) -> None:
    """A grid's validation users (every one by default) and its metric."""
    p.add_argument("--users", type=int, default=None, help="validation users (default: all)")
    p.add_argument("--metric", choices=metrics, default="ndcg@10")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """``--seed``, the target's ``--dtype`` and the torch ``--threads``."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--threads", type=int, default=None)


class TuningInputs(NamedTuple):
    """The bundle a search tunes, its data directory, the split read from it and the bundle's semantic ids."""

    bundle: Any  # recsvc.bundle.directory.Bundle
    data_dir: Path
    data: Any  # recsvc.data.split.SplitData
    ids: Any  # tokenizer_rqvae.ids.SemanticIds


def open_inputs(args: argparse.Namespace) -> TuningInputs:
    """Apply ``--threads``, open ``--bundle`` and read ``--data`` (default: the bundle's) and the ids."""
    import torch

    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import load_split_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = Bundle.open(args.bundle)
    data_dir = bundle.resolve_data_dir(args.data)
    return TuningInputs(bundle, data_dir, load_split_dir(data_dir), bundle.load_ids())
