"""What a prior-fusion search computes once: each validation user's candidate items with the target's log-probs.

A trial of ``recsvc tune prior`` / ``recsvc tune mix`` changes only the prior (its settings, its SASRec mix, its
fusion weight); the target's side of a fused score, sum_t log p(c_t | c_<t, prompt) of an item's L codes, is the
same in every trial. This module computes it once per study for each user's *candidate set*:

- the target's own wide beam (an unfused constrained beam search at width ``Widths.beam``, far wider than the
  served width), whose scores are those log-probs already;
- whatever the prior could add (``prior_rows``): the ``Widths.prior`` most frequent successors of each of the
  user's last ``HISTORY_POSITIONS`` items under the train-period transition counts, the ``Widths.prior`` most
  popular items (the back-off that dominates at large beta), and, for the SASRec mix, SASRec's top
  ``Widths.sequence`` items. Their log-probs come from one forced pass (the ranker's ``leaf_logprobs``; the token
  target's, ``training.evaluation.token_passes``: the prompt, then the distinct prefixes of those items fed level
  by level through the engine's beam cache; the item-level target's: the code decoder over each item's path),
  the same log-softmax as the search, so a beam's score and a forced item's log-prob agree.

Candidates are trie leaves (a collided leaf stands for several items, as in the search); with history excluded,
leaves all of whose items are history are left out (``CatalogTrie.dead_nodes``), and each leaf is read as its
lowest item id that is not history (``CatalogTrie.leaf_items``), exactly as a search result is read.
``training.tuning.rescore`` then scores and ranks them per trial.

Stored next to the study (``CandidateCache``): DIR/meta.json (the objective key, widths, users) and one
safetensors file per ``PART_USERS`` users, so an interrupted build resumes at the first missing part and a
changed key (another target, other users, other widths) builds into another directory. The wide beams are stored
apart as well (``BeamStore``, beams-<digest> beside the studies' directories), keyed only by what a beam depends on
(the target, the data, the users, the history rule, the precision, the width): ``tune mix`` then reads the beams of
``tune prior`` under the same history rule and runs only the forced pass of the candidates it adds.

Shapes: U users, M candidates per user (padded: leaf -1, item -1, log-prob -inf), B users of a batch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsvc.data.split import EvalUser
from recsvc.priors.transition import TransitionPrior
from recsvc_base.progress import progress_bar
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation.rankers import TargetRanker

CACHE_VERSION = 2
PART_USERS = 256  # users per stored part (the unit of resumption)
BATCH = 32  # users per forward batch
HISTORY_POSITIONS = 5  # the last items whose successors are candidates (``tune prior`` searches window 1..5)


@dataclass(frozen=True)
class Widths:
    """How wide each user's candidate set is drawn."""

    beam: int = 100  # the target's unfused beam (five times the served 20)
    prior: int = 20  # successors per history position, and the most popular items
    sequence: int = 0  # SASRec's top items (``tune mix``; 0: none)

    def check(self) -> Widths:
        from recsvc.errors import UserError

        if self.beam < 1 or self.prior < 0 or self.sequence < 0:
            raise UserError(f"candidate widths must be >= 1 (beam) and >= 0 (prior, sequence), got {self}")
        return self


@dataclass(frozen=True)
class Candidates:
    """Each user's candidate leaves, the items they are served as and the target's log-prob of each."""

    user_ids: np.ndarray  # [U]
    leaves: torch.Tensor  # [U, M] int64 trie leaves (-1: padding; an internal node: a prefix without candidates)
    items: torch.Tensor  # [U, M] int64 item ids (-1: padding, or a prefix)
    target: torch.Tensor  # [U, M] float32 sum of the L code log-probs (-inf: padding)
    partial: torch.Tensor  # [U, M, L] float32 the sums over codes 1..d of each depth d (-inf: padding)

    @staticmethod
    def concat(parts: Sequence[Candidates]) -> Candidates:
        width = max(int(p.leaves.shape[1]) for p in parts)

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        def pad3(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[1]), value=float("-inf"))

        return Candidates(np.concatenate([p.user_ids for p in parts]),
                          torch.cat([pad(p.leaves, -1) for p in parts]), torch.cat([pad(p.items, -1) for p in parts]),
                          torch.cat([pad(p.target, float("-inf")) for p in parts]),
                          torch.cat([pad3(p.partial) for p in parts]))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"user_ids": torch.from_numpy(np.asarray(self.user_ids, dtype=np.int64)), "leaves": self.leaves,
                "items": self.items, "target": self.target, "partial": self.partial}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Candidates:
        return cls(t["user_ids"].numpy(), t["leaves"], t["items"], t["target"], t["partial"])


def prior_rows(prior: TransitionPrior, history: Sequence[int], widths: Widths,
               sequence_top: np.ndarray | None = None) -> np.ndarray:
    """Catalog rows the prior could bring into a user's fused top-k (see the module doc), unsorted, unique."""
    rows: list[np.ndarray] = []
    if widths.prior:
        recent = [prior._row[int(i)] for i in reversed(list(history)) if int(i) in prior._row][:HISTORY_POSITIONS]
        for r in recent:
            lo, hi = prior.indptr[r], prior.indptr[r + 1]
            succ, counts = prior.indices[lo:hi], prior.counts[lo:hi]
            rows.append(succ[np.argsort(-counts, kind="stable")[: widths.prior]])
        rows.append(_popular(prior)[: widths.prior])
    if sequence_top is not None:
        rows.append(sequence_top)
    return np.unique(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)


def _popular(prior: TransitionPrior) -> np.ndarray:
    return np.lexsort((prior.item_ids, -prior.popularity))


@torch.inference_mode()
def build_candidates(ranker: TargetRanker, trie: CatalogTrie, users: Sequence[EvalUser],
                     prior: TransitionPrior, widths: Widths, exclude_history: bool,
                     sequence_top: Sequence[np.ndarray] | None = None, progress: bool = False,
                     beams: dict[int, UserBeam] | None = None) -> Candidates:
    """The candidates of ``users`` (in their order) under ``ranker``'s target (a token or an item-level one,
    ``training.evaluation.rankers``). ``sequence_top``: per user, SASRec's top catalog rows. ``beams``: user id ->
    that user's wide beam when another study computed it (``BeamStore``; a batch whose users all have one runs no
    search); the beams computed here are added to it."""
    leaf_of_row = trie.item_path[:, trie.levels]  # [n] each catalog row's leaf
    index = {u.user_id: i for i, u in enumerate(users)}
    order = sorted(users, key=lambda u: min(len(u.history), ranker.max_history))  # similar prompts together
    out: list[tuple[int, torch.Tensor, list[int], torch.Tensor]] = []
    batches = [order[i: i + BATCH] for i in range(0, len(order), BATCH)]
    for chunk in progress_bar(batches, desc="candidates", unit="batch", enabled=progress, leave=False):
        histories = [u.history for u in chunk]
        excluded = [u.history for u in chunk] if exclude_history else None
        dead = trie.dead_nodes(excluded) if excluded else None
        if beams is not None and all(u.user_id in beams for u in chunk):
            visited = _stack_beams([beams[u.user_id] for u in chunk])
        else:
            visited = ranker.wide_beam(histories, widths.beam, dead)
            if beams is not None:
                beams.update({u.user_id: [(n[r], s[r]) for n, s in visited] for r, u in enumerate(chunk)})
        beam_leaves, beam_partial = visited[-1]
        extra = []
        for r, u in enumerate(chunk):
            top = sequence_top[index[u.user_id]] if sequence_top is not None else None
            leaves = torch.unique(leaf_of_row[torch.from_numpy(prior_rows(prior, u.history, widths, top))])
            if dead is not None:
                leaves = leaves[~dead[r, leaves]]
            found = beam_leaves[r][beam_leaves[r] >= 0]
            extra.append(leaves[~torch.isin(leaves, found)])
        width = max(1, max(len(e) for e in extra))
        forced = torch.full((len(chunk), width), -1, dtype=torch.long)
        for r, e in enumerate(extra):
            forced[r, : len(e)] = e
        scores = ranker.leaf_logprobs(histories, forced)
        for r, u in enumerate(chunk):
            keep = beam_leaves[r] >= 0
            leaves = torch.cat([beam_leaves[r][keep], forced[r, : len(extra[r])]])
            partial = torch.cat([beam_partial[r][keep], scores[r, : len(extra[r])]])
            items = trie.leaf_items(leaves, excluded[r] if excluded else ()) if len(leaves) else []
            # the wide beam's prefixes that lead to no candidate: they hold beams in a replayed search
            # (``training.tuning.rescore.SearchTables``) without ever being listed (item -1, log-prob -inf)
            known = set(trie.ancestors[leaves].reshape(-1).tolist()) if len(leaves) else set()
            for nodes, sums in visited[:-1]:
                spare = [j for j, node in enumerate(nodes[r].tolist()) if node >= 0 and node not in known]
                leaves = torch.cat([leaves, nodes[r, spare]])
                partial = torch.cat([partial, sums[r, spare]])
                items = items + [-1] * len(spare)
            out.append((index[u.user_id], leaves, items, partial))
    out.sort(key=lambda x: x[0])
    width = max(1, max(len(x[1]) for x in out))
    leaves_t = torch.full((len(out), width), -1, dtype=torch.long)
    items_t = torch.full((len(out), width), -1, dtype=torch.long)
    partial_t = torch.full((len(out), width, trie.levels), float("-inf"))
    for i, (_, leaves, items, partial) in enumerate(out):
        leaves_t[i, : len(leaves)] = leaves
        items_t[i, : len(items)] = torch.tensor(items, dtype=torch.long)
        partial_t[i, : len(partial)] = partial
    return Candidates(np.array([u.user_id for u in users], dtype=np.int64), leaves_t, items_t,
                      partial_t[..., -1].contiguous(), partial_t)


UserBeam = list[tuple[torch.Tensor, torch.Tensor]]  # per depth d = 1..L: (nodes [W], partial sums [W, L])


def _stack_beams(rows: Sequence[UserBeam]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Users' wide beams as a ranker's ``wide_beam`` returns a batch's: per depth, (nodes [B, W], sums [B, W, L])."""
    out = []
    for depth in range(len(rows[0])):
        width = max(int(r[depth][0].shape[0]) for r in rows)
        nodes = torch.full((len(rows), width), -1, dtype=torch.long)
        sums = torch.full((len(rows), width, rows[0][depth][1].shape[1]), float("-inf"))
        for i, r in enumerate(rows):
            n, s = r[depth]
            nodes[i, : len(n)], sums[i, : len(n)] = n, s
        out.append((nodes, sums))
    return out


class BeamStore:
    """The target's wide beams (its ranker's ``wide_beam``) of a study's users, stored part by part (``PART_USERS``)
    under
    ROOT/beams-<digest of the key and width> and read by every study with the same key: ``tune prior`` and ``tune
    mix`` under one history rule search the same target over the same users at the same width, so the second study
    runs only its own added candidates' forced pass. ``key``: what a beam depends on (``BEAM_KEY`` fields)."""

    def __init__(self, root: Path, key: dict[str, Any], width: int, users: Sequence[EvalUser]) -> None:
        text = json.dumps({"key": key, "width": width, "version": CACHE_VERSION}, sort_keys=True, default=str)
        self.directory = root / f"beams-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        self.position = {u.user_id: i for i, u in enumerate(users)}
        self.reused = self.stored = 0

    def _path(self, chunk: Sequence[EvalUser]) -> Path:
        return self.directory / f"part-{self.position[chunk[0].user_id] // PART_USERS:05d}.safetensors"

    def load(self, chunk: Sequence[EvalUser]) -> dict[int, UserBeam]:
        """user id -> wide beam of the stored part holding ``chunk`` (empty: not stored yet)."""
        from safetensors.torch import load_file

        path = self._path(chunk)
        if not path.is_file():
            return {}
        t = load_file(str(path))
        _check_users(path, t["user_ids"].tolist(), chunk)
        self.reused += 1
        depths = sum(k.startswith("nodes_") for k in t)
        return {u.user_id: [(t[f"nodes_{d}"][i], t[f"sums_{d}"][i]) for d in range(depths)]
                for i, u in enumerate(chunk)}

    def save(self, chunk: Sequence[EvalUser], beams: dict[int, UserBeam]) -> None:
        """Stores the part's beams (once: a stored part is left as it is)."""
        path = self._path(chunk)
        if path.is_file():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tensors = {"user_ids": torch.tensor([u.user_id for u in chunk], dtype=torch.long)}
        for d, (nodes, sums) in enumerate(_stack_beams([beams[u.user_id] for u in chunk])):
            tensors[f"nodes_{d}"], tensors[f"sums_{d}"] = nodes, sums
        _write_part(path, tensors)
        self.stored += 1


BEAM_KEY = ("model", "data", "users", "seed", "exclude_history", "dtype")  # the study key's fields a beam depends on


class CandidateCache:
    """The candidates of one study's users, stored in parts under ``directory`` (``cache_dir``) and resumed."""

    def __init__(self, directory: Path, key: dict[str, Any], widths: Widths, users: Sequence[EvalUser]) -> None:
        self.directory, self.key, self.widths, self.users = directory, key, widths, list(users)

    @property
    def parts(self) -> int:
        return (len(self.users) + PART_USERS - 1) // PART_USERS

    def _part(self, i: int) -> Path:
        return self.directory / f"part-{i:05d}.safetensors"

    def built(self) -> int:
        """Parts already stored."""
        return sum(self._part(i).is_file() for i in range(self.parts))

    def load_or_build(self, build) -> tuple[Candidates, dict[str, Any]]:
        """All users' candidates: stored parts read, missing ones built with ``build(users) -> Candidates`` and
        stored as each finishes. Returns (candidates, {"parts_built": .., "parts_reused": .., "seconds": ..})."""
        from safetensors.torch import load_file

        self.directory.mkdir(parents=True, exist_ok=True)
        meta = self.directory / "meta.json"
        if not meta.is_file():
            meta.write_text(json.dumps({"version": CACHE_VERSION, "key": self.key, "widths": asdict(self.widths),
                                        "users": len(self.users), "part_users": PART_USERS}, default=str,
                                       sort_keys=True, indent=1) + "\n")
        start, built, parts = time.monotonic(), 0, []
        for i in range(self.parts):
            chunk = self.users[i * PART_USERS: (i + 1) * PART_USERS]
            path = self._part(i)
            if path.is_file():
                part = Candidates.from_tensors(load_file(str(path)))
                _check_users(path, part.user_ids.tolist(), chunk)
            else:
                part = build(chunk)
                _write_part(path, part.tensors())
                built += 1
            parts.append(part)
        return Candidates.concat(parts), {"parts_built": built, "parts_reused": self.parts - built,
                                          "seconds": round(time.monotonic() - start, 1)}


def _check_users(path: Path, stored: list[int], chunk: Sequence[EvalUser]) -> None:
    if stored != [u.user_id for u in chunk]:
        raise RuntimeError(f"{path}: holds other users than this study's (a stale cache?)")


def _write_part(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A part is either whole or absent: written beside, then moved into place."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def cache_dir(root: Path, name: str, key: dict[str, Any], widths: Widths) -> Path:
    """ROOT/NAME-<digest of the objective key, the widths and the cache version>."""
    text = json.dumps({"key": key, "widths": asdict(widths), "version": CACHE_VERSION}, sort_keys=True, default=str)
    return root / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
