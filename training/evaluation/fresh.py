"""Cold / warm slices and fresh-item lists for offline evaluation (torch-free: the baselines use it too).

The cold slice of a split is the targets that are catalog items nobody interacted with in the fitting period
(``cold_items``); a model with a fresh-items component (``recsvc.content.fresh``) gives them the tails of its
lists, read at every cutoff (``fresh_lists``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from recsvc.content.fresh import FreshItems
from recsvc.data.metrics import ndcg_at_k, recall_at_k, slice_users, standard_error
from recsvc.data.split import EvalUser, SplitData

if TYPE_CHECKING:
    from tokenizer_rqvae.ids import SemanticIds


def cold_items(data: SplitData, fit_on: str, catalog: Sequence[int]) -> set[int]:
    """Catalog items nobody interacted with in the fitting period ("train" or "train+valid"): the cold slice."""
    seen = interacted(data, fit_on)
    return {int(i) for i in catalog if int(i) not in seen}


def prefix_sharing(ids: SemanticIds, items: Iterable[int], known: Iterable[int]) -> dict[str, float]:
    """The share of ``items`` (e.g. the cold slice's) whose first n codes begin some ``known`` item's id (the items
    the target was trained on), for n = 1 .. L - 1: how many new items the target's beams could reach along code
    paths it saw continue. A new item on an unseen n-code prefix asks the target for a code after a prefix that no
    trained item continues. Example: known (1, 2, 3, 4), new (1, 2, 9, 9) -> {"1": 1.0, "2": 1.0, "3": 0.0}."""
    rows = {int(i): r for r, i in enumerate(ids.item_ids.tolist())}
    codes = ids.codes.tolist()
    new = [tuple(codes[rows[int(i)]]) for i in items if int(i) in rows]
    trained = [tuple(codes[rows[int(i)]]) for i in known if int(i) in rows]
    out = {}
    for n in range(1, ids.levels):
        seen = {c[:n] for c in trained}
        out[str(n)] = sum(c[:n] in seen for c in new) / len(new) if new else 0.0
    return out


def fresh_candidates(data: SplitData, split: str, fit_on: str, catalog: Sequence[int]) -> set[int]:
    """The fresh items when ``split`` is served by a model fitted on ``fit_on``: the items the catalog holds by
    then that nobody interacted with in the fitting period.

    The split has no release dates, so the catalog of a period is taken to be the items interacted with by its
    end (for the test period: the whole catalog, which is how the split was built). On valid this keeps items
    first seen in the test period out of the candidates, as they would be out of a catalog of that time; on test
    it is every item without a train / valid interaction. The same rule on both is what lets validation choose
    the slots for test."""
    if split == "test":
        present = {int(i) for i in catalog}
    else:
        present = {i for seq in data.sequences("train").values() for i in seq}
        present |= {i for seq in data.valid.values() for i in seq}
        present &= {int(i) for i in catalog}
    return present - interacted(data, fit_on)


def interacted(data: SplitData, fit_on: str) -> set[int]:
    """Items interacted with in the fitting period ("train" or "train+valid")."""
    return {i for seq in data.sequences(fit_on).values() for i in seq}


def fresh_lists(fresh: FreshItems | None, rankings: dict[int, list[int]], users: Sequence[EvalUser],
                exclude_history: bool = False, candidates: dict[int, list[tuple[int, float]]] | None = None
                ) -> Callable[[int], dict[int, list[int]]]:
    """k -> each user's list read at k: the ranking itself, or with its tail given to fresh items
    (``FreshItems.merge``). ``candidates``: user id -> fresh candidates computed beforehand (at least ``slots``
    of them, best first, with the same window; a search reuses them across settings), else computed here once."""
    if fresh is None or fresh.settings.slots <= 0:
        return lambda k: rankings
    by_user = candidates if candidates is not None else fresh_candidates_by_user(
        fresh, users, fresh.settings.slots, exclude_history)
    return lambda k: {u: fresh.merge(r, by_user.get(u, []), k) for u, r in rankings.items()}


def fresh_candidates_by_user(fresh: FreshItems, users: Sequence[EvalUser], n: int,
                             exclude_history: bool = False) -> dict[int, list[tuple[int, float]]]:
    """user id -> the n fresh items most similar to the user's history (``FreshItems.candidates``)."""
    cands = fresh.candidates([u.history for u in users], n, [u.history for u in users] if exclude_history else None)
    return {u.user_id: c for u, c in zip(users, cands, strict=True)}


def paired_effect(with_slots: dict[int, list[int]], without: dict[int, list[int]], users: Sequence[EvalUser],
                  k: int, items: set[int], inside: bool) -> dict[str, float]:
    """What the slots change on one slice (``inside``: the cold targets, else the warm ones), user by user:
    mean and standard error of the per-user difference of Recall@k and NDCG@k (with - without), and the standard
    error of the slice's figure without the slots (``*_se``: the noise of the figure a reader compares), so that
    "within noise" is a stated number rather than an impression."""
    part = slice_users(users, items, inside)
    out: dict[str, float] = {"users": float(len(part))}
    for name, fn in (("recall", recall_at_k), ("ndcg", ndcg_at_k)):
        base = [fn(without.get(u.user_id, []), u.targets, k) for u in part]
        diff = [fn(with_slots.get(u.user_id, []), u.targets, k) - b for u, b in zip(part, base, strict=True)]
        out[f"{name}@{k}_diff"] = sum(diff) / len(diff) if diff else 0.0
        out[f"{name}@{k}_diff_se"] = standard_error(diff)
        out[f"{name}@{k}_se"] = standard_error(base)  # the noise of the slice's figure itself
    return out
