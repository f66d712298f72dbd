"""Collision resolution: zero collisions, stable non-colliding items, determinism (hypothesis properties)."""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsvc.errors import UserError
from tokenizer_rqvae import collisions
from tokenizer_rqvae.collisions import IdSpace, last_level_distance, resolve_collisions


def _residuals_for(codes: np.ndarray, latents: np.ndarray, codebooks: np.ndarray) -> np.ndarray:
    """latents [n, D] + codes [n, L] -> residual entering each level [n, L, D]."""
    n, levels = codes.shape
    out = np.zeros((n, levels, latents.shape[1]), dtype=np.float64)
    r = latents.astype(np.float64).copy()
    for lv in range(levels):
        out[:, lv] = r
        r = r - codebooks[lv][codes[:, lv]]
    return out


@st.composite
def catalogs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    levels = draw(st.integers(1, 4))
    k = draw(st.integers(2, 5))
    dim = draw(st.integers(1, 3))
    n = draw(st.integers(1, min(k**levels, 80)))
    mode = draw(st.sampled_from(["random", "identical", "few_ids", "identical_embeddings_random_ids"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    codebooks = rng.normal(size=(levels, k, dim))
    latents = rng.normal(size=(n, dim))
    codes = rng.integers(0, k, size=(n, levels))
    if mode == "identical":  # adversarial: every item has the same embedding, hence the same id
        latents[:] = latents[0]
        codes[:] = codes[0]
    elif mode == "few_ids":
        pool = rng.integers(0, k, size=(draw(st.integers(1, 3)), levels))
        codes = pool[rng.integers(0, len(pool), size=n)]
    elif mode == "identical_embeddings_random_ids":
        latents[:] = latents[0]
    return codes.astype(np.int64), _residuals_for(codes, latents, codebooks), codebooks


def _groups(codes: np.ndarray) -> dict[tuple[int, ...], list[int]]:
    out: dict[tuple[int, ...], list[int]] = {}
    for row, c in enumerate(codes.tolist()):
        out.setdefault(tuple(c), []).append(row)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs(), st.booleans())
def test_resolution_is_collision_free_and_minimal(cat: tuple, use_sinkhorn: bool) -> None:
    codes, residuals, codebooks = cat
    n, levels = codes.shape
    k = codebooks.shape[1]
    res = resolve_collisions(codes, residuals, codebooks, sinkhorn_epsilon=0.05 if use_sinkhorn else None)
    out = res.codes
    assert out.shape == codes.shape
    assert len({tuple(r) for r in out.tolist()}) == n  # zero collisions
    assert out.min() >= 0 and out.max() < k
    groups = _groups(codes)
    dist = last_level_distance(codes, residuals, codebooks)
    for code, rows in groups.items():
        keep = min(rows, key=lambda r: (dist[r], r))
        assert tuple(out[keep]) == code  # the closest item of each id keeps it (all singletons too)
        assert all(tuple(out[r]) != code for r in rows if r != keep)
    assert res.collisions_before == n - len(groups)
    assert res.groups_before == sum(len(r) > 1 for r in groups.values())
    assert len(res.moved) == res.collisions_before
    again = resolve_collisions(codes, residuals, codebooks, sinkhorn_epsilon=0.05 if use_sinkhorn else None)
    np.testing.assert_array_equal(again.codes, out)  # deterministic


@settings(max_examples=60, deadline=None)
@given(catalogs())
def test_movers_keep_longest_free_prefix(cat: tuple) -> None:
    """Without Sinkhorn a mover changes only the levels it must: its kept prefix had no free id left when
    it was placed, one level longer."""
    codes, residuals, codebooks = cat
    res = resolve_collisions(codes, residuals, codebooks)
    levels = codes.shape[1]
    k = codebooks.shape[1]
    taken = {tuple(r) for r in np.delete(res.codes, res.moved, axis=0).tolist()}
    for row in res.moved:  # replay in placement order
        own, new = tuple(codes[row]), tuple(res.codes[row])
        first = next(lv for lv in range(levels) if own[lv] != new[lv])
        longer = own[: first + 1]
        free_under_longer = [s for s in itertools.product(range(k), repeat=levels - len(longer))
                             if longer + s not in taken]
        assert not free_under_longer, (own, new)
        taken.add(new)


def test_full_catalog_of_identical_items_fills_the_whole_space() -> None:
    k, levels, n = 3, 3, 27
    codebooks = np.random.default_rng(0).normal(size=(levels, k, 2))
    codes = np.zeros((n, levels), dtype=np.int64)
    residuals = _residuals_for(codes, np.zeros((n, 2)), codebooks)
    out = resolve_collisions(codes, residuals, codebooks).codes
    assert sorted(map(tuple, out.tolist())) == list(itertools.product(range(k), repeat=levels))


def test_over_capacity_is_a_user_error() -> None:
    codebooks = np.zeros((2, 2, 1))
    codes = np.zeros((5, 2), dtype=np.int64)
    with pytest.raises(UserError, match="distinct ids"):
        resolve_collisions(codes, np.zeros((5, 2, 1)), codebooks)


def test_worked_example_nearest_free_last_code() -> None:
    """Docstring example: A keeps (1, 2); B moves to the free last code nearest its level-1 residual."""
    codebooks = np.array([[[0.0], [1.0], [2.0], [3.0]], [[0.0], [10.0], [20.0], [30.0]]])  # [2, 4, 1]
    codes = np.array([[1, 2], [1, 2], [1, 3]])
    residuals = np.array([[[1.0], [20.1]], [[1.0], [12.0]], [[1.0], [30.0]]])  # B is 8 from code 2, 2 from code 1
    res = resolve_collisions(codes, residuals, codebooks)
    assert res.codes.tolist() == [[1, 2], [1, 1], [1, 3]]
    assert res.moved == [1] and res.changed_from_level == {1: 1}


def test_climbs_a_level_when_the_prefix_is_full() -> None:
    codebooks = np.array([[[0.0], [5.0]], [[0.0], [1.0]], [[0.0], [0.5]]])  # [3, 2, 1]
    codes = np.array([[0, 0, 0], [0, 0, 1], [0, 0, 0]])  # prefix (0, 0) full after the keepers
    residuals = _residuals_for(codes, np.array([[0.0], [0.5], [0.9]]), codebooks)
    res = resolve_collisions(codes, residuals, codebooks)
    assert res.codes[0].tolist() == [0, 0, 0] and res.codes[1].tolist() == [0, 0, 1]
    # mover (row 2, latent 0.9, residual 0.9 at level 1): best free (c, d) under (0,) is (1, 0) -> 1.0 total
    assert res.codes[2].tolist() == [0, 1, 0]
    assert res.changed_from_level == {1: 1}


def test_id_space_prefix_bookkeeping() -> None:
    s = IdSpace(levels=2, codebook_size=2)
    s.add((0, 1))
    s.add((0, 0))
    assert s.is_full((0,)) and not s.is_full(()) and not s.is_taken((1, 0)) and s.is_taken((0, 1))
    assert s.taken_under(()) == 2


@settings(max_examples=80, deadline=None)
@given(catalogs())
def test_greedy_search_path_also_resolves_everything(cat: tuple) -> None:
    """Suffix spaces above EXACT_LIMIT are searched greedily; force that path on small catalogs."""
    codes, residuals, codebooks = cat
    with mock.patch.object(collisions, "EXACT_LIMIT", 1):
        res = resolve_collisions(codes, residuals, codebooks)
    assert len({tuple(r) for r in res.codes.tolist()}) == len(codes)
    kept = np.setdiff1d(np.arange(len(codes)), res.moved)
    np.testing.assert_array_equal(res.codes[kept], codes[kept])


def test_greedy_path_picks_nearest_code_first() -> None:
    codebooks = np.array([[[0.0], [4.0]], [[0.0], [1.0]]])  # [2, 2, 1]
    codes = np.array([[1, 1], [1, 1]])
    residuals = _residuals_for(codes, np.array([[5.0], [4.9]]), codebooks)
    with mock.patch.object(collisions, "EXACT_LIMIT", 1):
        res = resolve_collisions(codes, residuals, codebooks)
    assert res.codes.tolist() == [[1, 1], [1, 0]]  # row 1 (residual 0.9 from 4.0) is nearer code 1: moves
