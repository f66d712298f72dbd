"""Python API for notebooks: teacher data, drafter training and acceptance measurements on a bundle.

    >>> from training.drafters.api import (                                                     # doctest: +SKIP
    ...     load_bundle, build_teacher, train_drafter, evaluate_acceptance)
    >>> b = load_bundle("artifacts/beauty/bundle")                                               # doctest: +SKIP
    >>> build_teacher(b, k=20)                                 # BUNDLE/teacher (resumes)         # doctest: +SKIP
    >>> train_drafter(b, method="atspeed-s", alpha=0.5, epochs=4, out_name="atspeed-s")          # doctest: +SKIP
    >>> evaluate_acceptance(b, split="test", k=10, gamma=3, users=200, drafter="atspeed-s")      # doctest: +SKIP
    {'k': 10, 'n': 10, 'gamma': 3, 'users': 200, 'strict': {'AS': ..., 'WS': ..., 'target_calls': ...}, ...}

``measure_acceptance`` is the shared measurement (``recsvc bench drafters`` uses it): per K, per user, the
target's own decoding (plain beam search; sampling beam search for relaxed) and then every drafter's
speculative decoding of the same request, one request at a time, interleaved, so WS@K (plain time /
speculative time) compares runs under the same machine load. AS@K = accepted draft depths per request.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recsvc.bundle.directory import Bundle
from recsvc.errors import UserError
from recsvc.recommender.api import SPECULATIVE

if TYPE_CHECKING:  # the engine is imported when a measurement runs
    from recsvc.data.split import SplitData
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.engine.speculation.ports import Drafter
    from recsvc.recommender.parts import TargetParts

MODES = SPECULATIVE  # the modes a drafter is measured in


def load_bundle(path: str | Path | Bundle) -> Bundle:
    """An existing bundle (UserError if ``path`` has no bundle.json)."""
    return path if isinstance(path, Bundle) else Bundle.open(path)


def build_teacher(bundle: str | Path | Bundle, k: int = 20, max_prefixes: int | None = None, batch_size: int = 32,
                  lambda_mix: float = 0.0, **kwargs: Any) -> dict[str, Any]:
    """BUNDLE/teacher for the current target (see ``training.drafters.teacher.build_teacher`` for the other options:
    shard_size, seed, dtype, data_dir, force, progress). Returns its meta.json."""
    from training.drafters.teacher import build_teacher as build

    return build(load_bundle(bundle).root, k=k, max_prefixes=max_prefixes, batch_size=batch_size,
                 lambda_mix=lambda_mix, **kwargs)


def train_drafter(bundle: str | Path | Bundle, method: str = "atspeed-s", alpha: float = 0.5,
                  preset: str = "drafter-small", epochs: int = 8, batch_size: int = 32, lr: float = 1e-3,
                  out_name: str | None = None, select_by: str = "as", resume: bool = False, force: bool = False,
                  seed: int = 0, max_minutes: float | None = None, patience: int = 2, bf16: str = "auto",
                  **kwargs: Any) -> dict[str, Any]:
    """Train one drafter (``training.drafters.train.train_drafter``; extra keywords go there: k, as_users, as_k,
    gamma, draft_beams, verify, init_from, eval_max_users, data_dir, ...). Saved to BUNDLE/drafters/<out_name>, or
    BUNDLE/drafter (the served one) without ``out_name``."""
    from training.drafters.train import train_drafter as train
    from training.target_lm.train import TrainConfig

    cfg = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, resume=resume,
                      max_minutes=max_minutes, patience=patience, bf16=bf16)
    data_dir = kwargs.pop("data_dir", None)
    eval_max_users = kwargs.pop("eval_max_users", 2000)
    info = train(load_bundle(bundle).root, data_dir, preset=preset, method=method, cfg=cfg,
                 eval_max_users=eval_max_users, force=force, alpha=alpha, select_by=select_by,
                 out_name=out_name, **kwargs)
    info.pop("main_process", None)
    return info


# ------------------------------------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class Setup:
    """What a measurement needs from a bundle (loaded once): the target and its catalog
    (``recsvc.recommender.parts.load_target``), the data split and the beam search over the target."""

    parts: TargetParts
    data: SplitData
    engine: BeamSearch
    dtype: str = "auto"


def load_setup(bundle: str | Path | Bundle, dtype: str = "auto", data_dir: str | Path | None = None,
               attention: str = "fp32") -> Setup:
    """The bundle's target in the service's configuration (bf16, the engine's "fp32" attention mode), on the CPU."""
    from recsvc.data.split import load_split_dir
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.recommender.parts import PartsChoice, load_target

    parts = load_target(load_bundle(bundle), PartsChoice.target_only(dtype, attention=attention))
    engine = BeamSearch(parts.target, parts.trie, parts.prompts.code_offset)
    return Setup(parts, load_split_dir(parts.bundle.resolve_data_dir(data_dir)), engine, dtype)


def load_drafter(setup: Setup, name: str | Path | None) -> Drafter:
    """A Drafter by name (``recsvc.recommender.drafter_registry``): None / "drafter" = BUNDLE/drafter;
    "retrieval" = the training-free REST-style one (over the training sequences); a name under BUNDLE/drafters/;
    or a model directory."""
    from recsvc.recommender.drafter_registry import DraftSource, build_drafter

    parts = setup.parts
    source = DraftSource(parts.bundle, parts.target, parts.trie, parts.prompts.code_offset, setup.dtype,
                         sequences=lambda: setup.data.train.values())
    return build_drafter(str(name or "drafter"), source)


def pick_users(setup: Setup, split: str, users: int | Sequence[int] | None, seed: int = 0) -> list:
    from recsvc.data.sampling import sample_users

    pool = setup.data.eval_users(split)
    if users is None or isinstance(users, int):
        return sample_users(pool, users, seed)
    wanted = set(int(u) for u in users)
    found = [u for u in pool if u.user_id in wanted]
    if len(found) != len(wanted):
        raise UserError(f"{len(wanted) - len(found)} of the given users have no {split} targets")
    return found


def supports_relaxed(drafter) -> bool:
    """Relaxed verification needs a drafter that samples (``Drafter.samples``: the LLaMA drafter; retrieval /
    oracle / transition do not)."""
    return bool(drafter.samples)


@torch.inference_mode()
def measure_acceptance(setup: Setup, drafters: Mapping[str, Any], users: Sequence, ks: Sequence[int],
                       modes: Sequence[str] = MODES, n_mult: float = 1.0, gamma: int = 3, temperature: float = 1.0,
                       recall_at: int = 5, progress: bool = True,
                       draft_beams: int | None = None) -> list[dict[str, Any]]:
    """One row per (mode, K, drafter): AS, AS_se (its standard error over users), accepted (the accepted depths
    of each user, in ``users`` order), WS, plain_ms, spec_ms, target_calls (speculative, per request),
    plain_calls, identical (strict) or recall@R / ndcg@R (relaxed, when K >= R); plus a row per (mode, K) for
    drafter "target" (the target's own decoding: its recall@R / ndcg@R). N = max(K, round(n_mult * K)), or
    max(K, ``draft_beams``) when given (a fixed N for every K, as in the AtSpeed paper: N = 40)."""
    from recsvc.data.metrics import evaluate_rankings, standard_error
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.search.sampling import make_generators
    from recsvc_base.progress import progress_bar

    bad = [m for m in modes if m not in MODES]
    if bad or not users:
        raise UserError(f"modes must be among {MODES} and users non-empty (got {bad}, {len(users)} users)")
    trie, engine, builder = setup.parts.trie, setup.engine, setup.parts.prompts
    temp = torch.tensor([temperature])
    rows: list[dict[str, Any]] = []
    for mode in modes:
        relaxed = mode == "relaxed"
        usable = {name: d for name, d in drafters.items() if not relaxed or supports_relaxed(d)}
        for k in ks:
            n = max(k, draft_beams if draft_beams is not None else round(n_mult * k))
            plain_ms, rank_plain = [], {}
            stats = {name: {"ms": [], "calls": [], "acc": [], "same": 0, "rank": {}, "differing": []}
                     for name in usable}
            for i, u in enumerate(progress_bar(users, desc=f"{mode} K={k}", enabled=progress, leave=False)):
                pb = PromptBatch.from_lists([builder.prompt_ids(u.history)])
                runs = 2 if i == 0 else 1  # the first user warms up
                for _ in range(runs):  # the target alone (relaxed: its own sampling beam search)
                    start = time.perf_counter()
                    plain_out = decode(engine, None, pb, [u.history], mode, k, (0, 0), temperatures=temp,
                                       generators=make_generators([i]))
                    ms = 1000 * (time.perf_counter() - start)
                plain_ms.append(ms)
                plain = plain_out.leaves[0]
                rank_plain[u.user_id] = trie.leaf_items(plain[plain >= 0])
                for name, drafter in usable.items():
                    for _ in range(runs):
                        session = (drafter.sampling_session(pb, [u.history], None) if relaxed  # untimed
                                   else drafter.session(pb, [u.history], None))
                        start = time.perf_counter()
                        out = decode(engine, drafter, pb, [u.history], mode, k, (n, gamma), temperatures=temp,
                                     generators=make_generators([i]), session=session)
                        ms = 1000 * (time.perf_counter() - start)
                    s = stats[name]
                    s["ms"].append(ms)
                    s["calls"].append(int(out.target_calls[0]))
                    s["acc"].append(int(out.accepted[0]))
                    leaves = out.leaves[0]
                    same = torch.equal(leaves, plain)
                    s["same"] += int(same)
                    if not same and not relaxed:  # how far from plain: the same items, and the scores' largest gap
                        a, b = out.scores[0].sort().values, plain_out.scores[0].sort().values
                        gap = torch.where(a.isfinite() & b.isfinite(), a - b, 0.0).abs().max()
                        s["differing"].append({"user": u.user_id, "same_items": set(leaves.tolist()) ==
                                               set(plain.tolist()), "max_score_gap": float(gap)})
                    s["rank"][u.user_id] = trie.leaf_items(leaves[leaves >= 0])
            p_ms = statistics.mean(plain_ms)
            base = {"mode": mode, "k": k, "N": n, "gamma": gamma, "users": len(users)}
            target_row = {**base, "drafter": "target", "plain_ms": p_ms, "plain_calls": float(trie.levels)}
            if k >= recall_at:
                m = evaluate_rankings(rank_plain, users, [recall_at])
                target_row.update({f"recall@{recall_at}": m[f"recall@{recall_at}"],
                                   f"ndcg@{recall_at}": m[f"ndcg@{recall_at}"]})
            rows.append(target_row)
            for name, s in stats.items():
                s_ms = statistics.mean(s["ms"])
                acc = s["acc"]
                row = {**base, "drafter": name, "AS": float(statistics.mean(acc)), "AS_se": standard_error(acc),
                       "WS": p_ms / s_ms,
                       "plain_ms": p_ms, "spec_ms": s_ms, "target_calls": float(statistics.mean(s["calls"])),
                       "plain_calls": float(trie.levels), "accepted": acc}
                if relaxed and k >= recall_at:
                    m = evaluate_rankings(s["rank"], users, [recall_at])
                    row.update({f"recall@{recall_at}": m[f"recall@{recall_at}"],
                                f"ndcg@{recall_at}": m[f"ndcg@{recall_at}"]})
                elif not relaxed:
                    row["identical"] = s["same"] / len(users)
                    row["differing"] = s["differing"]  # [{user, same_items, max_score_gap}] where not identical
                rows.append(row)
    return rows


def evaluate_acceptance(bundle: str | Path | Bundle | Setup, split: str = "test", k: int = 10, n: int | None = None,
                        gamma: int = 3, users: int | Sequence[int] | None = 200, drafter: str | Path | None = None,
                        modes: Sequence[str] = MODES, temperature: float = 1.0, dtype: str = "auto", seed: int = 0,
                        progress: bool = False, attention: str = "fp32") -> dict[str, Any]:
    """AS@K, WS@K and target calls per request of one drafter (default: BUNDLE/drafter; a name under
    BUNDLE/drafters/, "retrieval", or a model directory), strict and relaxed. ``n``: draft beams (default K);
    ``users``: how many sampled users of ``split`` (None: all) or a list of user ids."""
    setup = bundle if isinstance(bundle, Setup) else load_setup(bundle, dtype, attention=attention)
    chosen = pick_users(setup, split, users, seed)
    d = load_drafter(setup, drafter)
    n = n or k
    rows = measure_acceptance(setup, {"drafter": d}, chosen, [k], modes, n_mult=n / k, gamma=gamma,
                              temperature=temperature, progress=progress)
    out: dict[str, Any] = {"k": k, "n": n, "gamma": gamma, "users": len(chosen), "split": split}
    keys = ("AS", "AS_se", "WS", "target_calls", "plain_calls", "plain_ms", "spec_ms", "identical", "recall@5",
            "ndcg@5")
    for r in rows:
        if r["drafter"] == "drafter":
            out[r["mode"]] = {key: r[key] for key in keys if key in r}
    return out
