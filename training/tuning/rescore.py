"""A prior-fusion trial as a re-scoring: the fused score of every cached candidate, ranked, for all users at once.

The engine's fused search scores an item y of leaf l with  log p_target(y) + w * log m(l),  m(l) the prior mass of
the leaf's items (``recsvc.engine.scoring.prior``; the root's mass is the same for every item of a user, so it never
changes a ranking). ``training.tuning.rescore_cache`` holds log p_target of each user's candidates; here a trial
computes the prior's mass at those candidates from per-component tables built once per run (``PriorTables``), adds it
with the trial's weight, takes each user's top k and scores them (NDCG@k, Recall@k as
``recsvc.data.metrics``), vectorised over [U, M] tensors (~10 ms per trial for the transition prior on 4,295
users; the SASRec mix adds one log-sum-exp over [U, catalog] per trial for its temperature).

The prior's tables, exactly the terms ``TransitionPrior.probs`` and ``MixedPrior.probs`` sum:

    P_tr(j) = sum_{t < min(window, r)} decay^t [count(h_t -> j) / (out(h_t) + beta) + beta pop(j) / (out(h_t) + beta)]
              / sum_t decay^t      (pop(j) alone without a known history item; pop(j) for a term of 0 + 0 counts)
    M(j) = (1 - mix) P_tr(j) + mix softmax(s / T)_j          (mix 0 for a history SASRec does not know)
    log P(j) = log M(j) + product * log softmax(s)_j          (+ const; items SASRec lacks: its row's minimum)

so a trial gathers nothing: ``counts`` [U, T, M, G] (G: items of a leaf, T = ``HISTORY_POSITIONS``), ``pop``
[U, M, G], ``out`` [U, T] and SASRec's scores at the candidates are fixed; the settings only reweight them.
Leaves of several items sum their items' P (log-sum-exp over G), as the engine's trie masses do.

Ranked so, a trial gives the exact fused ranking of the candidates, which the served search (a beam search at the
bundle's width) does not compute: it prunes after every code, keeping the width's best prefixes by
T(prefix) + w * log m(prefix), T the target's log-prob of the prefix and m the prior mass of every catalog item
under it. ``SearchTables`` (the transition prior's terms summed under each candidate's prefixes) and
``DenseMasses`` (a mix's masses, recomputed over the catalog per trial) let ``Rescorer`` replay that pruning on the
candidates, so its lists are the served search's wherever the search's beams stay among the candidates' prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from recsvc.data.split import EvalUser
from recsvc.priors.mixed import MixSettings, SequenceModel
from recsvc.priors.transition import PriorSettings, TransitionPrior
from tokenizer_rqvae.trie import CatalogTrie
from training.tuning.rescore_cache import HISTORY_POSITIONS, Candidates

SEQUENCE_BATCH = 512  # users per SASRec forward


@dataclass(frozen=True)
class SequenceTables:
    """SASRec's part of the mix for every user: its scores over the catalog's model items [U, m'] (for the
    temperature's normaliser) and, at each candidate's items, its score, log softmax and whether it has one."""

    scores: torch.Tensor  # [U, m'] float32 s(j | h) over the catalog items SASRec was fitted on
    at: torch.Tensor  # [U, M, G] s at each candidate item (0 where SASRec lacks the item)
    logq: torch.Tensor  # [U, M, G] log softmax(s) at each candidate item (its row's minimum where it lacks it)
    has: torch.Tensor  # [U, M, G] bool: SASRec scores the item
    known: torch.Tensor  # [U] bool: the history has an item SASRec knows


@dataclass(frozen=True)
class PriorTables:
    """The train-period transition prior's terms at each user's candidates (see the module doc)."""

    counts: torch.Tensor  # [U, T, M, G] float32 count(h_t -> j)
    pop: torch.Tensor  # [U, M, G] float32 pop(j) (0 at padding)
    out: torch.Tensor  # [U, T] float32 transitions out of h_t
    positions: torch.Tensor  # [U] history items the prior can read (at most T)
    member: torch.Tensor  # [U, M, G] bool: a real item of the leaf
    sequence: SequenceTables | None = None

    @classmethod
    def build(cls, prior: TransitionPrior, trie: CatalogTrie, users: Sequence[EvalUser], cands: Candidates,
              sequence: SequenceModel | None = None) -> PriorTables:
        rows_of_leaf = leaf_rows(trie)  # [num_leaves, G]
        leaves = cands.leaves
        rows = torch.where((leaves >= trie.num_internal)[..., None],
                           rows_of_leaf[(leaves - trie.num_internal).clamp(min=0)],
                           torch.full((1, 1, 1), -1, dtype=torch.long))  # [U, M, G] catalog rows, -1: none
        member = rows >= 0
        u, m, g = rows.shape
        counts = np.zeros((u, HISTORY_POSITIONS, m, g), dtype=np.float32)
        out = np.zeros((u, HISTORY_POSITIONS), dtype=np.float32)
        positions = np.zeros(u, dtype=np.int64)
        rows_np = rows.numpy()
        for i, user in enumerate(users):
            recent = [prior._row[int(x)] for x in reversed(list(user.history)) if int(x) in prior._row]
            recent = recent[:HISTORY_POSITIONS]
            positions[i] = len(recent)
            flat = rows_np[i].reshape(-1)
            for t, r in enumerate(recent):
                out[i, t] = prior.out_counts[r]
                lo, hi = prior.indptr[r], prior.indptr[r + 1]
                succ = prior.indices[lo:hi]  # ascending (CSR built from sorted pairs)
                if not len(succ):
                    continue
                at = np.searchsorted(succ, flat).clip(max=len(succ) - 1)
                hit = (flat >= 0) & (succ[at] == flat)
                counts[i, t].reshape(-1)[hit] = prior.counts[lo:hi][at[hit]]  # a view: [M, G] is contiguous
        pop = torch.where(member, torch.from_numpy(prior.popularity)[rows.clamp(min=0)], 0.0)
        seq = sequence_tables(sequence, prior, users, rows) if sequence is not None else None
        return cls(torch.from_numpy(counts), pop, torch.from_numpy(out), torch.from_numpy(positions), member, seq)

    def transition(self, st: PriorSettings) -> torch.Tensor:
        """[U, M, G] P_tr at each candidate item (``TransitionPrior.probs``'s value, normalised)."""
        return transition_mass(self.counts, self.pop, self.out, self.positions, st)

    def log_mass(self, st: PriorSettings, mix: MixSettings | None = None) -> torch.Tensor:
        """[U, M] log of each candidate leaf's prior mass, up to a per-user constant (-inf at padding)."""
        p = self.transition(st)
        seq = self.sequence
        if mix is None or (mix.mix <= 0 and mix.product <= 0):
            return _log_leaf(torch.where(self.member, p, 0.0).log())
        assert seq is not None, "a mix needs the SASRec tables (PriorTables.build(sequence=...))"
        if mix.mix > 0:
            lse = torch.logsumexp(seq.scores / mix.temperature, dim=1)  # [U] the temperature's normaliser
            q = torch.where(seq.has, (seq.at / mix.temperature - lse[:, None, None]).exp(), 0.0)
            share = torch.where(seq.known, mix.mix, 0.0)[:, None, None]
            p = (1.0 - share) * p + share * q
        log_p = torch.where(self.member, p, 0.0).log()
        if mix.product > 0:
            log_p = log_p + mix.product * torch.where(seq.known[:, None, None], seq.logq, 0.0)
        return _log_leaf(torch.where(self.member, log_p, float("-inf")))


def transition_mass(counts: torch.Tensor, pop: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
                    st: PriorSettings) -> torch.Tensor:
    """P_tr summed over sets of items (an item, a leaf's items, a prefix's items): ``counts`` [U, T, ...] their
    transition counts from each history position, ``pop`` [U, ...] their popularity, ``out`` [U, T], ``positions``
    [U] -> [U, ...] (the module doc's formula, which is linear in the counts and the popularity)."""
    t = torch.arange(HISTORY_POSITIONS)
    used = t[None, :] < torch.clamp(positions, max=st.window)[:, None]  # [U, T]
    w = torch.where(used, torch.tensor(st.decay, dtype=torch.float32) ** t, 0.0)  # [U, T]
    denom = out + st.beta
    pos = denom > 0
    on_pop = torch.where(pos, st.beta / torch.where(pos, denom, 1.0), 1.0) * w  # [U, T]
    on_count = torch.where(pos, 1.0 / torch.where(pos, denom, 1.0), 0.0) * w
    total = w.sum(1)  # [U]
    extra = (1,) * (pop.dim() - 1)
    p = pop * on_pop.sum(1).view(-1, *extra) + torch.einsum("ut...,ut->u...", counts, on_count)
    p = p / torch.where(total > 0, total, 1.0).view(-1, *extra)
    return torch.where((positions > 0).view(-1, *extra), p, pop)


@dataclass(frozen=True)
class SearchTables:
    """The served beam search's pruning, replayed on the candidates (``Rescorer(..., search=...)``): for each
    depth d = 1..L-1, each candidate's depth-d prefix as a group id per user, and the transition prior's terms
    summed over ALL catalog items under that prefix (not only the candidates), so a prefix's fused score
    T(prefix) + w * log m(prefix) is the one the search ranks it by."""

    groups: list[torch.Tensor]  # L-1 tensors [U, M]: the prefix's group (-1: padding)
    counts: list[torch.Tensor]  # L-1 tensors [U, T, M]: counts from h_t into the prefix's items
    pop: list[torch.Tensor]  # L-1 tensors [U, M]: the popularity of the prefix's items

    @classmethod
    def build(cls, prior: TransitionPrior, trie: CatalogTrie, users: Sequence[EvalUser],
              cands: Candidates) -> SearchTables:
        levels = trie.levels
        leaves = cands.leaves
        anc = torch.where((leaves >= 0)[..., None], trie.ancestors[leaves.clamp(min=0)].cpu(), -1)  # [U, M, L]
        path = trie.item_path.cpu().numpy()  # [n, L+1]
        node_pop = np.zeros(trie.num_nodes, dtype=np.float64)
        for d in range(1, levels):
            np.add.at(node_pop, path[:, d], prior.popularity)
        groups, counts, pops = [], [], []
        for d in range(1, levels):
            at = anc[..., d - 1]  # [U, M]
            groups.append(_group_ids(at))
            pops.append(torch.where(at >= 0, torch.from_numpy(node_pop.astype(np.float32))[at.clamp(min=0)], 0.0))
            counts.append(torch.zeros(len(users), HISTORY_POSITIONS, at.shape[1]))
        anc_np = anc.numpy()
        for i, user in enumerate(users):
            recent = [prior._row[int(x)] for x in reversed(list(user.history)) if int(x) in prior._row]
            for t, r in enumerate(recent[:HISTORY_POSITIONS]):
                lo, hi = prior.indptr[r], prior.indptr[r + 1]
                if lo == hi:
                    continue
                succ, cnt = prior.indices[lo:hi], prior.counts[lo:hi]
                for d in range(1, levels):
                    uniq, inverse = np.unique(path[succ, d], return_inverse=True)
                    sums = np.bincount(inverse.reshape(-1), weights=cnt, minlength=len(uniq))
                    want = anc_np[i, :, d - 1]
                    at = np.searchsorted(uniq, want).clip(max=len(uniq) - 1)
                    hit = (want >= 0) & (uniq[at] == want)
                    counts[d - 1][i, t, torch.from_numpy(np.nonzero(hit)[0])] = torch.from_numpy(
                        sums[at[hit]].astype(np.float32))
        return cls(groups, counts, pops)


def _group_ids(nodes: torch.Tensor) -> torch.Tensor:
    """[U, M] nodes (-1: none) -> [U, M] per row, the same id for the same node (0, 1, ...; -1 at -1)."""
    key = torch.where(nodes >= 0, nodes, torch.iinfo(torch.long).max)
    sorted_, order = torch.sort(key, dim=1, stable=True)
    first = torch.ones_like(sorted_, dtype=torch.bool)
    first[:, 1:] = sorted_[:, 1:] != sorted_[:, :-1]
    gid = torch.empty_like(order).scatter_(1, order, first.long().cumsum(1) - 1)
    return torch.where(nodes >= 0, gid, -1)


def _log_leaf(log_p: torch.Tensor) -> torch.Tensor:
    """[U, M, G] log P of a leaf's items -> [U, M] log of their sum."""
    return log_p[..., 0] if log_p.shape[2] == 1 else torch.logsumexp(log_p, dim=2)


def leaf_rows(trie: CatalogTrie) -> torch.Tensor:
    """[num_leaves, G] the catalog rows of each leaf's items (G: the most items a leaf holds; -1 padding)."""
    leaf = (trie.item_path[:, trie.levels] - trie.num_internal).cpu()  # [n]
    n_leaves = trie.num_nodes - trie.num_internal
    g = int(torch.bincount(leaf, minlength=n_leaves).max())
    out = torch.full((n_leaves, g), -1, dtype=torch.long)
    order = torch.argsort(leaf, stable=True)
    slot = torch.zeros(n_leaves, dtype=torch.long)
    for r in order.tolist():
        lf = int(leaf[r])
        out[lf, slot[lf]] = r
        slot[lf] += 1
    return out


@torch.inference_mode()
def sequence_tables(sequence: SequenceModel, prior: TransitionPrior, users: Sequence[EvalUser],
                    rows: torch.Tensor) -> SequenceTables:
    """SASRec's scores of every user (``SequenceModel.scores``, over the catalog items it was fitted on) and their
    values at the candidates' catalog rows ``rows`` [U, M, G]."""
    cols = np.searchsorted(prior.item_ids, sequence.item_ids).clip(max=len(prior.item_ids) - 1)
    ok = prior.item_ids[cols] == sequence.item_ids
    model_rows = torch.from_numpy(np.nonzero(ok)[0])  # SASRec rows that are catalog items
    model_of_row = torch.full((len(prior.item_ids),), -1, dtype=torch.long)  # catalog row -> column of `scores`
    model_of_row[torch.from_numpy(cols[ok])] = torch.arange(len(model_rows))
    parts, known = [], []
    for lo in range(0, len(users), SEQUENCE_BATCH):
        s, k = sequence.scores([u.history for u in users[lo: lo + SEQUENCE_BATCH]])
        parts.append(s[:, model_rows])
        known.append(k)
    scores = torch.cat(parts) if parts else torch.zeros(0, len(model_rows))
    col = model_of_row[rows.clamp(min=0)]  # [U, M, G]
    has = (col >= 0) & (rows >= 0)
    at = torch.where(has, scores.gather(1, col.clamp(min=0).reshape(len(users), -1)).view(col.shape), 0.0)
    logq_all = torch.log_softmax(scores, dim=1)
    low = logq_all.amin(dim=1)  # [U] the row's minimum: SASRec's value for items it lacks
    logq = torch.where(has, at - torch.logsumexp(scores, dim=1)[:, None, None], low[:, None, None])
    return SequenceTables(scores, at, logq, has, torch.cat(known) if known else torch.zeros(0, dtype=torch.bool))


def sequence_top(sequence: SequenceModel, prior: TransitionPrior, users: Sequence[EvalUser], k: int
                 ) -> list[np.ndarray]:
    """Per user, the catalog rows of SASRec's ``k`` highest-scored items (candidates of the mix's cache)."""
    cols = np.searchsorted(prior.item_ids, sequence.item_ids).clip(max=len(prior.item_ids) - 1)
    ok = prior.item_ids[cols] == sequence.item_ids
    catalog_cols = torch.from_numpy(cols[ok])
    model_rows = torch.from_numpy(np.nonzero(ok)[0])
    out: list[np.ndarray] = []
    with torch.inference_mode():
        for lo in range(0, len(users), SEQUENCE_BATCH):
            s, _ = sequence.scores([u.history for u in users[lo: lo + SEQUENCE_BATCH]])
            top = torch.topk(s[:, model_rows], min(k, len(model_rows)), dim=1).indices
            out.extend(catalog_cols[top].numpy())
    return out


class DenseMasses:
    """The prior's log-mass at each candidate's prefixes and leaf, computed as the engine computes it
    (``recsvc.engine.scoring.prior.prior_log_mass`` over the whole catalog's probabilities) for a mix, whose prefix
    masses sum SASRec's probabilities of every item under a prefix: SASRec's scores of every user are computed once,
    a trial recomputes the mixture ([U, n]) and its trie masses, in chunks of users (~2 s on Beauty)."""

    def __init__(self, prior: TransitionPrior, sequence: SequenceModel, trie: CatalogTrie,
                 users: Sequence[EvalUser], cands: Candidates) -> None:
        self.prior, self.sequence, self.trie = prior, sequence, trie
        self.histories = [u.history for u in users]
        leaves = cands.leaves
        self.nodes = torch.where((leaves >= 0)[..., None], trie.ancestors[leaves.clamp(min=0)].cpu(), -1)  # [U,M,L]
        parts, known = [], []
        with torch.inference_mode():
            for lo in range(0, len(users), SEQUENCE_BATCH):
                s, k = sequence.scores(self.histories[lo: lo + SEQUENCE_BATCH])
                parts.append(s)
                known.append(k)
        self.scores = torch.cat(parts)  # [U, m] SASRec's scores of its own items
        self.known = torch.cat(known)  # [U]

    def log_masses(self, st: PriorSettings, mix: MixSettings) -> torch.Tensor:
        """[U, M, L] log m(node) of each candidate's depth-1..L nodes, up to a per-user constant (the root's mass,
        which ranks nothing; -inf where it has none): the masses ``prior_log_mass`` sums, one ``index_add_`` per
        depth into that depth's nodes."""
        from recsvc.priors.mixed import MixedPrior

        mixed = MixedPrior(self.prior.with_settings(st), self.sequence, mix)
        out = torch.full(self.nodes.shape, float("-inf"))
        path = self.trie.item_path.cpu()  # [n, L+1]
        with torch.inference_mode():
            for lo in range(0, len(self.histories), SEQUENCE_BATCH):
                hi = lo + SEQUENCE_BATCH
                p = mixed.combine(torch.from_numpy(mixed.transition.probs(self.histories[lo:hi])),
                                  self.scores[lo:hi], self.known[lo:hi]).float()  # [B, n]
                mass = torch.zeros(p.shape[0], self.trie.num_nodes)
                for d in range(1, self.trie.levels + 1):
                    mass.index_add_(1, path[:, d], p)
                nodes = self.nodes[lo:hi]
                got = mass.gather(1, nodes.clamp(min=0).reshape(len(nodes), -1)).view(nodes.shape)
                out[lo:hi] = torch.where(nodes >= 0, got.log(), float("-inf"))
        return out


class Rescorer:
    """Ranks every user's candidates by fused score and scores the top k (``evaluate``), trial after trial."""

    def __init__(self, cands: Candidates, tables: PriorTables, users: Sequence[EvalUser], k: int = 10,
                 search: SearchTables | None = None, width: int = 0, dense: DenseMasses | None = None) -> None:
        """``search`` and ``width``: replay the served search's pruning at beam width max(k, width) on the
        candidates, with the transition prior's prefix masses from ``SearchTables``, or with a mix's from
        ``dense`` (``DenseMasses``; then every trial with a mix takes them from there); without either: the exact
        fused ranking of the candidates."""
        if cands.user_ids.tolist() != [u.user_id for u in users]:
            raise ValueError("the candidates belong to other users")
        self.cands, self.tables, self.users, self.k = cands, tables, list(users), k
        self.search, self.width, self.dense = search, max(k, width), dense
        targets = [set(u.targets) for u in users]
        items = cands.items.tolist()
        self.relevant = torch.tensor([[int(i in t) for i in row] for row, t in zip(items, targets, strict=True)],
                                     dtype=torch.float64).reshape(cands.items.shape)  # [U, M]
        self.has_targets = torch.tensor([bool(t) for t in targets])
        self.n_targets = torch.tensor([max(len(t), 1) for t in targets], dtype=torch.float64)
        discount = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))  # [k]
        self.discount = discount
        ideal = torch.cat([torch.zeros(1, dtype=torch.float64), discount.cumsum(0)])  # IDCG over 0..k targets
        self.idcg = ideal[torch.clamp(self.n_targets.long(), max=k)]

    def fused(self, st: PriorSettings, mix: MixSettings | None = None) -> torch.Tensor:
        """[U, M] each candidate's fused score (the target's log-prob + w * log m(leaf); -inf: never listed)."""
        mixing = mix is not None and (mix.mix > 0 or mix.product > 0)
        if self.search is not None and mixing and self.dense is None:
            raise ValueError("the search's pruning is replayed for the transition prior alone, not a SASRec mix")
        if self.search is None:
            if st.weight <= 0:
                return self.cands.target
            return self.cands.target + st.weight * self.tables.log_mass(st, mix)
        if st.weight <= 0:
            return torch.where(self._survivors(st, None), self.cands.target, float("-inf"))
        if mixing:
            assert self.dense is not None and mix is not None
            masses = self.dense.log_masses(st, mix)  # [U, M, L]
            leaf = masses[..., -1]

            def prefix(d: int) -> torch.Tensor:
                return masses[..., d]
        else:
            leaf = self.tables.log_mass(st)
            t, search = self.tables, self.search

            def prefix(d: int) -> torch.Tensor:
                return transition_mass(search.counts[d], search.pop[d], t.out, t.positions, st).log()
        fused = self.cands.target + st.weight * leaf
        return torch.where(self._survivors(st, prefix), fused, float("-inf"))

    def _survivors(self, st: PriorSettings, prefix) -> torch.Tensor:
        """[U, M] whether each candidate's every prefix stays among the ``width`` best of its depth, as the beam
        search at that width keeps them (each depth's prefixes ranked by T(prefix) + w * log m(prefix);
        ``prefix(d)``: [U, M] log m of each candidate's depth d + 1 prefix, None without the prior)."""
        assert self.search is not None
        alive = self.cands.leaves >= 0
        for d, groups in enumerate(self.search.groups):
            score = self.cands.partial[..., d]
            if prefix is not None:
                score = score + st.weight * prefix(d)
            score = torch.where(alive, score, float("-inf"))
            n = int(groups.max()) + 1 if groups.numel() else 0
            if n <= self.width:
                continue  # every prefix of this depth fits in the beam
            best = torch.full((score.shape[0], n), float("-inf")).scatter_reduce(
                1, groups.clamp(min=0), score, "amax", include_self=True)  # [U, P] each prefix's score
            values, cols = torch.topk(best, self.width, dim=1)
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, cols, torch.isfinite(values))
            alive = alive & kept.gather(1, groups.clamp(min=0))
        return alive

    def top(self, st: PriorSettings, mix: MixSettings | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns [U, k] of each user's best k candidates, whether each is listed [U, k])."""
        scores = self.fused(st, mix)
        k = min(self.k, scores.shape[1])
        values, cols = torch.topk(scores, k, dim=1)
        return cols, torch.isfinite(values)

    def per_user(self, st: PriorSettings, mix: MixSettings | None = None) -> dict[str, np.ndarray]:
        """``{"ndcg@k": [n], "recall@k": [n]}`` of the users with targets (``recsvc.data.metrics``)."""
        cols, listed = self.top(st, mix)
        hits = self.relevant.gather(1, cols) * listed  # [U, k]
        dcg = (hits * self.discount[: hits.shape[1]]).sum(1)
        keep = self.has_targets
        return {f"ndcg@{self.k}": (dcg / self.idcg)[keep].numpy(),
                f"recall@{self.k}": (hits.sum(1) / self.n_targets)[keep].numpy()}

    def evaluate(self, st: PriorSettings, mix: MixSettings | None = None) -> dict[str, float]:
        """``{"ndcg@k": mean, "recall@k": mean}`` over the users with targets."""
        return {key: float(v.mean()) if len(v) else 0.0 for key, v in self.per_user(st, mix).items()}

    def lists(self, st: PriorSettings, mix: MixSettings | None = None) -> dict[int, list[int]]:
        """user id -> the re-scored top-k item ids."""
        cols, listed = self.top(st, mix)
        items = self.cands.items.gather(1, cols)
        return {int(uid): [int(i) for i, ok in zip(row, lst, strict=True) if ok]
                for uid, row, lst in zip(self.cands.user_ids, items.tolist(), listed.tolist(), strict=True)}


def coverage(scorer: Rescorer, lists: dict[int, list[int]], k: int = 10) -> float:
    """The share of the items of ``lists`` (each user's first k) that are among that user's candidates: below 1,
    wider candidates would bring the re-scored lists closer to those; at 1, what differs is the search's pruning
    (the re-scored ranking is the exact fused ranking of the candidates, the served search a beam search)."""
    hit = total = 0
    for uid, row in zip(scorer.cands.user_ids.tolist(), scorer.cands.items.tolist(), strict=True):
        mine = set(row)
        listed = list(lists.get(int(uid), ()))[:k]
        hit += sum(i in mine for i in listed)
        total += len(listed)
    return hit / total if total else 1.0


def standard_error(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0
