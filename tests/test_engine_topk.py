"""``select_topk`` (recsvc.engine.scoring.topk): one request on the host is selected over its allowed candidates
only; the best ``width`` equal the stable sort of every candidate, ties (to the lower index), -0.0 against 0.0,
NaN and +inf included, and a row with fewer allowed candidates than ``width`` is padded as before."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsvc.engine.scoring.topk import select_topk

VALUES = st.sampled_from([float("-inf")] * 6 + [-2.0, -1.5, -1.0, -0.5, -0.0, 0.0, 1.0, float("inf"), float("nan")])


def stable_sort(cand: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every candidate sorted (stable, descending), the first ``width``, padded with -inf at index 0."""
    b, n = cand.shape
    full = torch.cat([cand, torch.full((b, max(0, width - n)), float("-inf"))], 1)
    scores, idx = torch.sort(full, dim=1, descending=True, stable=True)
    return scores[:, :width], torch.where(idx[:, :width] < n, idx[:, :width], 0)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.lists(VALUES, min_size=1, max_size=60), st.integers(1, 12))
def test_selection_equals_the_stable_sort(b: int, values: list[float], width: int) -> None:
    cand = torch.tensor([values] * b)
    if b > 1:
        cand[1:] = cand[1:].roll(1, 1)  # the rows differ: the batched path beside the one-row one
    scores, idx = select_topk(cand, width)
    want_scores, want_idx = stable_sort(cand, width)
    assert torch.equal(idx, want_idx)
    assert torch.equal(scores.nan_to_num(), want_scores.nan_to_num())
    assert torch.equal(torch.signbit(scores), torch.signbit(want_scores))  # -0.0 stays -0.0


def test_a_trie_step_row() -> None:
    """A row as a trie step leaves it: most candidates absent (-inf), ties among the rest."""
    cand = torch.full((1, 5120), float("-inf"))
    cols = torch.randperm(5120, generator=torch.Generator().manual_seed(0))[:300]
    cand[0, cols] = torch.randint(-40, 0, (300,), generator=torch.Generator().manual_seed(1)).float() / 8
    for width in (1, 20, 300, 301):
        got, want = select_topk(cand, width), stable_sort(cand, width)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
