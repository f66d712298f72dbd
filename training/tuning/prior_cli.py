"""``recsvc prior fit``: fit a bundle's item-transition prior (BUNDLE/prior), fused into decoding when its weight
is > 0 (``recsvc.engine.scoring.prior``; the service and ``recsvc eval`` pick it up).

    recsvc prior fit --bundle B [--data D] [--fit-on auto|train|train+valid] [--window 1] [--decay 0.5]
                     [--beta 1.0] [--weight 1.0]

``--fit-on auto`` counts the periods the served target was trained on: the bundle's recorded protocol
("paper": train; "deploy": train + valid). The catalog is the bundle's (``bundle.load_ids().item_ids``), so
the prior's rows are the trie's item rows. bundle.json records ``"prior": {settings..., "fit_on": ...}``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import asdict

from recsvc.errors import UserError
from training.choices import FIT_PERIODS, PROTOCOLS

FIT_ON = ("auto", *FIT_PERIODS)


def register(subparsers) -> None:
    prior = subparsers.add_parser("prior", help="the item-transition prior fused into beam search")
    sub = prior.add_subparsers(dest="prior_command", metavar="WHAT")
    p = sub.add_parser("fit", help="count item transitions into BUNDLE/prior")
    p.add_argument("--bundle", required=True, help="bundle directory")
    p.add_argument("--data", help="data directory (default: the one recorded in the bundle)")
    p.add_argument("--fit-on", choices=FIT_ON, default="auto",
                   help="periods counted; auto: the bundle's protocol (paper: train, deploy: train+valid)")
    p.add_argument("--window", type=int, default=1, help="last history items that vote (default: %(default)s)")
    p.add_argument("--decay", type=float, default=0.5, help="weight of the t-th last item: decay**t")
    p.add_argument("--beta", type=float, default=1.0, help="popularity back-off pseudo-count per source item")
    p.add_argument("--weight", type=float, default=1.0,
                   help="fusion weight w of w * log P(item) in beam search (0: fitted but not fused)")
    p.set_defaults(func=cmd_prior_fit)
    prior.set_defaults(func=lambda _args: prior.print_help() or 2)


def resolve_fit_on(fit_on: str, protocol: str) -> str:
    """"auto" -> the periods the bundle's target was trained on: paper -> "train", deploy -> "train+valid"."""
    if fit_on != "auto":
        return fit_on
    if protocol not in PROTOCOLS:
        raise UserError(f"bundle protocol {protocol!r} is neither {' nor '.join(PROTOCOLS)}: pass --fit-on")
    return "train+valid" if protocol == "deploy" else "train"


def prior_sequences(data, fit_on: str) -> Iterable[list[int]]:
    """Chronological per-user sequences of the chosen periods (users in id order)."""
    if fit_on not in FIT_ON[1:]:
        raise UserError(f"--fit-on must be one of {', '.join(FIT_ON)}, got {fit_on!r}")
    seqs = data.sequences(fit_on)
    return [seqs[u] for u in sorted(seqs)]


def cmd_prior_fit(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import load_split_dir
    from recsvc.priors.transition import PriorSettings, TransitionPrior

    settings = PriorSettings(window=args.window, decay=args.decay, beta=args.beta, weight=args.weight).check()
    bundle = Bundle.open(args.bundle)
    meta = bundle.read()
    fit_on = resolve_fit_on(args.fit_on, meta.get("protocol", "paper"))
    data_dir = bundle.resolve_data_dir(args.data)
    if not (data_dir / "sequential_train.txt").is_file():
        raise UserError(f"{data_dir} has no sequential_train.txt (pass --data DIR)")
    data = load_split_dir(data_dir)
    ids = bundle.load_ids()
    prior = TransitionPrior.fit(prior_sequences(data, fit_on), ids.item_ids.tolist(), settings, fitted_on=fit_on)
    prior.save(bundle.prior_dir)
    record = {**asdict(settings), "fit_on": fit_on}
    bundle.update(prior=record)
    transitions = int(prior.counts.sum())
    print(f"prior: {transitions} transitions ({len(prior.counts)} distinct pairs) over {len(ids)} items, "
          f"fitted on {fit_on}; {prior.settings} -> {bundle.prior_dir}")
    if settings.weight == 0:
        print("weight 0: the prior is stored but not fused (refit with --weight > 0 to fuse it)")
    return 0
