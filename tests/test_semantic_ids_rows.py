"""SemanticIds.rows_of: code paths -> item rows, the lookup the training losses share (hypothesis property)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_rqvae.ids import SemanticIds


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), size=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_rows_of_finds_every_item_and_nothing_else(n: int, size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    paths = {tuple(int(c) for c in rng.integers(0, size, 3)) for _ in range(n)}
    codes = np.array(sorted(paths, key=lambda p: rng.random()), dtype=np.int64)  # [n', 3], rows in random order
    ids = SemanticIds(np.arange(1, len(codes) + 1, dtype=np.int64), codes, codebook_size=size)
    assert ids.rows_of(codes).tolist() == list(range(len(codes)))
    queries = rng.integers(-1, size + 1, (50, 3))  # codes one below and one above the codebook too
    expected = [next((r for r, p in enumerate(codes.tolist()) if p == q), -1) for q in queries.tolist()]
    assert ids.rows_of(queries).tolist() == expected


def test_rows_of_rejects_out_of_range_codes_that_would_alias_a_path() -> None:
    # key(0, 4) with codebook 4 equals key(1, 0): the out-of-range path must not be read as item 2's
    ids = SemanticIds(np.array([1, 2]), np.array([[0, 3], [1, 0]]), codebook_size=4)
    assert ids.rows_of(np.array([[0, 4], [1, 0], [0, 3], [-1, 3]])).tolist() == [-1, 1, 0, -1]
    assert SemanticIds(np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64)).rows_of(
        np.array([[0, 1]])).tolist() == [-1]
