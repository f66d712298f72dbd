"""The re-scored objective of ``recsvc tune prior`` / ``recsvc tune mix``, and its check against a full decode.

By default a trial of those searches re-scores each validation user's cached candidates (``training.tuning.rescore``,
``training.tuning.rescore_cache``) instead of running the fused beam search over every user; ``--full-decode`` keeps the
search per trial (the reference, ~17 s per trial on Beauty's 4,295 validation users on one core). The cache is
built once per study (BUNDLE/tune/candidates/NAME-<digest>, keyed like the study plus the candidate widths;
resumed part by part) and the chosen settings are then checked with one full decode on validation
(``full_decode_check``): both figures with their standard errors, the paired difference, and how many users got
the same top 10 from both.

``target_over_prior`` is the headline figure a search writes into bundle.json ("target_over_prior", or
"target_over_prior_excl" for the prior of a service that excludes history): the fused target's lists
(the full decode of the chosen settings) against the prior's own ranking on the same validation users, NDCG@10
and Recall@10, ratio of means with a 95% paired bootstrap interval (``training.evaluation.lead.paired_lead``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from recsvc.data.split import EvalUser
from recsvc.priors.mixed import SequenceModel
from recsvc.priors.transition import TransitionPrior
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation.rankers import TargetRanker
from training.tuning.rescore import DenseMasses, PriorTables, Rescorer, SearchTables, sequence_top, standard_error
from training.tuning.rescore_cache import BEAM_KEY, BeamStore, CandidateCache, Widths, build_candidates, cache_dir

K = 10


def add_rescore_args(p: argparse.ArgumentParser, sequence: int = 0) -> None:
    p.add_argument("--full-decode", action="store_true",
                   help="run the fused beam search over every user in every trial (the reference; slow) instead of "
                        "re-scoring each user's cached candidates")
    p.add_argument("--candidates", type=int, default=Widths.beam,
                   help="the target's unfused beam width that draws each user's cached candidates")
    p.add_argument("--prior-candidates", type=int, default=Widths.prior,
                   help="candidates the prior adds: top successors of each of the last 5 history items, and the "
                        "most popular items")
    if sequence:
        p.add_argument("--sequence-candidates", type=int, default=sequence,
                       help="candidates SASRec adds: its top items per user")


def widths_of(args: argparse.Namespace) -> Widths:
    return Widths(beam=args.candidates, prior=args.prior_candidates,
                  sequence=getattr(args, "sequence_candidates", 0)).check()


def rescorer(tune_dir: Path, name: str, key: dict[str, Any], widths: Widths, ranker: TargetRanker,
             trie: CatalogTrie, users: Sequence[EvalUser], prior: TransitionPrior,
             exclude_history: bool, width: int, sequence: SequenceModel | None = None
             ) -> tuple[Rescorer, dict[str, Any]]:
    """The study's candidates (built or resumed under TUNE_DIR/candidates) and the prior's tables at them; a trial
    replays the served search's pruning at beam ``width`` on the candidates (``training.tuning.rescore.SearchTables``;
    with a SASRec ``sequence`` mixed in, its masses come from ``DenseMasses``)."""
    top = sequence_top(sequence, prior, users, widths.sequence) if sequence is not None and widths.sequence else None
    index = {u.user_id: i for i, u in enumerate(users)}
    beams = BeamStore(tune_dir / "candidates", {k: key[k] for k in BEAM_KEY}, widths.beam, users)

    def build(chunk: Sequence[EvalUser]):
        mine = [top[index[u.user_id]] for u in chunk] if top is not None else None
        found = beams.load(chunk)
        part = build_candidates(ranker, trie, chunk, prior, widths, exclude_history, mine, progress=True,
                                beams=found)
        beams.save(chunk, found)
        return part

    cache = CandidateCache(cache_dir(tune_dir / "candidates", name, key, widths), key, widths, users)
    cands, info = cache.load_or_build(build)
    start = time.monotonic()
    tables = PriorTables.build(prior, trie, users, cands)
    search = SearchTables.build(prior, trie, users, cands)
    dense = DenseMasses(prior, sequence, trie, users, cands) if sequence is not None else None
    info = {**info, "dir": str(cache.directory), "beams": str(beams.directory), "beam_parts_reused": beams.reused,
            "widths": asdict(widths), "candidates_per_user":
            round(float((cands.items >= 0).sum(1).float().mean()), 1),
            "prefixes_per_user": round(float(((cands.leaves >= 0) & (cands.items < 0)).sum(1).float().mean()), 1),
            "tables_seconds": round(time.monotonic() - start, 1),
            "ranking": "the served search replayed"}
    print(f"candidates: {info['candidates_per_user']} per user ({info['parts_reused']} parts reused, "
          f"{info['parts_built']} built in {info['seconds']} s, {info['beam_parts_reused']} of them on another "
          f"study's wide beams; prior tables {info['tables_seconds']} s) "
          f"in {cache.directory}")
    return Rescorer(cands, tables, users, K, search, width, dense), info


def full_decode_check(decoded: Mapping[int, Sequence[int]], rescored: Mapping[int, Sequence[int]],
                      users: Sequence[EvalUser], decode_seconds: float | None = None,
                      covered: float | None = None) -> dict[str, Any]:
    """The chosen settings' full decode against their re-scored lists on the same users: each figure with its
    standard error, the paired difference, and the share of users whose top 10 agree (as lists and as sets).
    ``decode_seconds``: the full decode's time (one ``--full-decode`` trial's), recorded beside them; ``covered``:
    the share of the decoded items among the cached candidates (``training.tuning.rescore.coverage``)."""
    from training.evaluation.lead import per_user

    scored = [u for u in users if u.targets]
    out: dict[str, Any] = {"users": len(scored), "full_decode_seconds": (round(decode_seconds, 2)
                                                                         if decode_seconds is not None else None)}
    for name, lists in (("rescored", rescored), ("full_decode", decoded)):
        out[name] = {}
        for metric in ("ndcg", "recall"):
            v = per_user(lists, scored, K, metric)
            out[name][f"{metric}@{K}"], out[name][f"{metric}@{K}_se"] = float(v.mean()), standard_error(v)
    for metric in ("ndcg", "recall"):
        d = per_user(rescored, scored, K, metric) - per_user(decoded, scored, K, metric)
        out[f"diff_{metric}@{K}"], out[f"diff_{metric}@{K}_se"] = float(d.mean()), standard_error(d)
    same_list = [list(rescored.get(u.user_id, ()))[:K] == list(decoded.get(u.user_id, ()))[:K] for u in users]
    overlap = [len(set(list(rescored.get(u.user_id, ()))[:K]) & set(list(decoded.get(u.user_id, ()))[:K]))
               / max(1, len(list(decoded.get(u.user_id, ()))[:K])) for u in users]
    same_set = [set(list(rescored.get(u.user_id, ()))[:K]) == set(list(decoded.get(u.user_id, ()))[:K])
                for u in users]
    out.update(same_top10_lists=float(np.mean(same_list)), same_top10_sets=float(np.mean(same_set)),
               top10_overlap=float(np.mean(overlap)), decoded_in_candidates=covered)
    gap = abs(out["rescored"][f"ndcg@{K}"] - out["full_decode"][f"ndcg@{K}"])
    out["within_one_se"] = bool(gap <= out["full_decode"][f"ndcg@{K}_se"])
    return out


def format_check(check: Mapping[str, Any]) -> str:
    r, f = check["rescored"], check["full_decode"]
    cells = [f"{label}@{K} re-scored {r[f'{m}@{K}']:.4f} +- {r[f'{m}@{K}_se']:.4f}, full decode "
             f"{f[f'{m}@{K}']:.4f} +- {f[f'{m}@{K}_se']:.4f} (paired difference {check[f'diff_{m}@{K}']:+.4f} +- "
             f"{check[f'diff_{m}@{K}_se']:.4f})" for m, label in (("ndcg", "NDCG"), ("recall", "Recall"))]
    return (f"check of the chosen settings on {check['users']} validation users: " + "; ".join(cells) +
            f"; the same top 10 for {100 * check['same_top10_lists']:.1f}% of users "
            f"({100 * check['same_top10_sets']:.1f}% as sets, overlap {100 * check['top10_overlap']:.1f}%"
            + (f", {100 * check['decoded_in_candidates']:.1f}% of the decoded items among the candidates"
               if check.get("decoded_in_candidates") is not None else "") + "); "
            f"NDCG@{K} {'within' if check['within_one_se'] else 'NOT within'} one standard error"
            + (f"; the full decode took {check['full_decode_seconds']:.1f} s"
               if check.get("full_decode_seconds") is not None else ""))


def decode_lists(ranker: TargetRanker, users: Sequence[EvalUser], exclude_history: bool, width: int,
                 prior: Any) -> dict[int, list[int]]:
    """The fused search's top 10 of every user, as a trial of ``--full-decode`` ranks them."""
    return ranker.lists(users, K, width, exclude_history, prior)


def target_over_prior(fused: Mapping[int, Sequence[int]], alone: Mapping[int, Sequence[int]],
                      users: Sequence[EvalUser], source: str, prior_dir: str) -> dict[str, Any]:
    """The fused target's lists against the prior's own ranking on the same validation users (paired)."""
    from training.evaluation.lead import paired_lead, per_user

    scored = [u for u in users if u.targets]
    out: dict[str, Any] = {"split": "valid", "users": len(scored), "source": source, "prior": prior_dir,
                           "k": K}
    for metric in ("ndcg", "recall"):
        lead = paired_lead(per_user(fused, scored, K, metric), per_user(alone, scored, K, metric))
        out[f"{metric}@{K}"] = {"fused": lead["model"], "prior_alone": lead["baseline"], "ratio": lead["ratio"],
                                "ratio_lo": lead["ratio_lo"], "ratio_hi": lead["ratio_hi"], "diff": lead["diff"],
                                "diff_se": lead["diff_se"]}
    return out


def per_trial(study, ran: int) -> float | None:
    """Mean seconds of the objective over the trials run now (the last ``ran``), None when none ran."""
    done = [t.user_attrs["seconds"] for t in study.trials[-ran:] if ran and "seconds" in t.user_attrs]
    return round(float(np.mean(done)), 3) if done else None
