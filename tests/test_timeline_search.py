"""The item-level target: beam search over its code decoder against exhaustive scoring of every item's code path,
exclusions and the fused prior included; the timeline's causality; its files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsvc.engine.scoring.exclusion import SparseDead
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.errors import UserError
from recsvc.timeline.forward import RotaryTables, causal_forward
from recsvc.timeline.model import TimelineConfig, TimelineModel
from recsvc.timeline.search import beam_search, exhaustive_scores, history_tensors, user_states
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


def tiny_catalog(n: int = 40, levels: int = 3, codebook: int = 6, seed: int = 0) -> CatalogTrie:
    rng = np.random.default_rng(seed)
    paths: set[tuple[int, ...]] = set()
    while len(paths) < n:
        paths.add(tuple(int(x) for x in rng.integers(0, codebook, size=levels)))
    items = rng.choice(np.arange(1, 10 * n), size=n, replace=False)
    return CatalogTrie(SemanticIds.from_mapping(dict(zip(items.tolist(), sorted(paths), strict=True)),
                                                codebook_size=codebook))


def tiny_model(trie: CatalogTrie, seed: int = 0, **kw) -> TimelineModel:
    torch.manual_seed(seed)
    cfg = TimelineConfig(levels=trie.levels, codebook_size=trie.codebook_size, hidden=16, layers=2, heads=2,
                         ffn=32, max_items=8, dropout=0.0, **kw)
    model = TimelineModel(cfg).eval()
    with torch.no_grad():  # a sharper decoder than the initialisation's, so the rankings differ between users
        model.heads.mul_(8.0)
    return model


def histories(trie: CatalogTrie, b: int = 5, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    items = trie.ids.item_ids
    return [rng.choice(items, size=int(rng.integers(0, 12))).tolist() for _ in range(b)]


def ranked_exhaustively(trie: CatalogTrie, scores: torch.Tensor, dead: torch.Tensor | None = None) -> list[list]:
    """Every item by score, best first, excluded leaves left out: [(leaf, score), ...] per request."""
    leaf = trie.item_path[:, -1]
    out = []
    for b, row in enumerate(scores):
        keep = [(int(leaf[i]), float(row[i])) for i in range(len(row))
                if dead is None or not bool(dead[b, leaf[i]])]
        out.append(sorted(keep, key=lambda x: -x[1]))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_width_search_equals_exhaustive_scoring(seed):
    trie = tiny_catalog(seed=seed)
    model = tiny_model(trie, seed)
    states = user_states(model, trie, histories(trie, seed=seed))
    out = beam_search(model, trie, states, width=len(trie.ids))
    ref = ranked_exhaustively(trie, exhaustive_scores(model, trie, states))
    for b, row in enumerate(ref):
        assert out.leaves[b].tolist() == [leaf for leaf, _ in row]
        assert torch.allclose(out.scores[b], torch.tensor([s for _, s in row]), atol=1e-5)
    assert out.decoder_calls == trie.levels


def test_exclusions_and_prior_match_exhaustive_scoring():
    trie = tiny_catalog(seed=3)
    model = tiny_model(trie, 3)
    hist = histories(trie, seed=3)
    states = user_states(model, trie, hist)
    dead = trie.dead_nodes(hist)
    rng = np.random.default_rng(0)
    probs = torch.from_numpy(rng.random((len(hist), len(trie.ids))).astype(np.float32))
    from recsvc.engine.scoring.prior import prior_log_mass  # the fusion the token target's search uses

    prior = prior_log_mass(trie, probs, 0.7)
    out = beam_search(model, trie, states, width=len(trie.ids), dead=dead, prior=prior)
    fused = exhaustive_scores(model, trie, states) + prior[:, trie.item_path[:, -1]]
    ref = ranked_exhaustively(trie, fused, dead)
    for b, row in enumerate(ref):
        got = [x for x in out.leaves[b].tolist() if x >= 0]
        assert got == [leaf for leaf, _ in row]
        assert torch.allclose(out.scores[b, : len(got)], torch.tensor([s for _, s in row]), atol=1e-5)
        assert not any(bool(dead[b, x]) for x in got)


def test_narrow_search_returns_the_best_of_what_it_kept():
    trie = tiny_catalog(seed=4)
    model = tiny_model(trie, 4)
    states = user_states(model, trie, histories(trie, seed=4))
    narrow = beam_search(model, trie, states, width=5)
    full = exhaustive_scores(model, trie, states)
    for b in range(len(states)):
        leaves = narrow.leaves[b].tolist()
        assert len(set(leaves)) == 5 and all(x >= trie.num_internal for x in leaves)
        assert torch.all(narrow.scores[b][:-1] >= narrow.scores[b][1:])  # best first
        rows = [int((trie.item_path[:, -1] == x).nonzero()[0]) for x in leaves]
        assert torch.allclose(narrow.scores[b], full[b, rows], atol=1e-5)  # the scores are the items' own


def test_timeline_is_causal_and_padding_is_inert():
    """h_t reads items 0..t only: changing later items, or padding a history on the right, leaves it unchanged."""
    trie = tiny_catalog(seed=5)
    model = tiny_model(trie, 5)
    items = trie.ids.item_ids.tolist()
    a, b = items[:6], items[:3] + items[10:13]
    ca, _, _ = history_tensors(trie, [a], 8)
    cb, _, _ = history_tensors(trie, [b], 8)
    ha, hb = model.states(ca), model.states(cb)
    assert torch.allclose(ha[0, :3], hb[0, :3], atol=1e-6)
    assert not torch.allclose(ha[0, 3:], hb[0, 3:], atol=1e-4)
    alone = user_states(model, trie, [items[:2]])
    batched = user_states(model, trie, [items[:2], items[:7]])  # the first row right-padded to 7 positions
    assert torch.allclose(alone[0], batched[0], atol=1e-6)


def test_history_keeps_the_most_recent_items_with_an_id():
    trie = tiny_catalog(seed=6)
    items = trie.ids.item_ids.tolist()
    codes, rows, lengths = history_tensors(trie, [[*items[:10], 10**9], []], max_items=4, num_item_rows=6)
    assert lengths.tolist() == [4, 1]  # the unknown item is skipped; an empty history reads one pad
    assert codes[0].tolist() == trie.ids.codes[6:10].tolist()
    assert rows[0].tolist() == [0, 0, 0, 0]  # rows 7..10 lie past the table of 6 rows: unseen
    assert codes[1, 0].tolist() == [-1] * trie.levels


def test_save_load_round_trip(tmp_path):
    trie = tiny_catalog(seed=7)
    model = tiny_model(trie, 7, num_items=len(trie.ids) + 1)
    model.save(tmp_path / "t")
    again = TimelineModel.load(tmp_path / "t")
    states = user_states(model, trie, histories(trie))
    assert torch.equal(beam_search(model, trie, states, 7).leaves, beam_search(again, trie, states, 7).leaves)
    with pytest.raises(UserError, match="no item-level target"):
        TimelineModel.load(tmp_path / "missing")


def test_the_serving_forward_equals_transformers_forward():
    """``causal_forward`` (eval mode) gives transformers' LlamaModel outputs: timeline states and code logits."""
    trie = tiny_catalog(seed=8)
    model = tiny_model(trie, 8)
    codes, _, _ = history_tensors(trie, histories(trie, seed=8), 8)
    prefix = torch.from_numpy(trie.ids.codes[:6, :2])
    state = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    lean = (model.states(codes), model.code_logits(state, prefix), model.code_logits(state, prefix[:, :0]))
    model.lean = False
    reference = (model.states(codes), model.code_logits(state, prefix), model.code_logits(state, prefix[:, :0]))
    for a, b in zip(lean, reference, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_sparse_exclusions_search_as_the_dense_rows():
    """A search over ``SparseDead`` (the served one) returns the dense rows' search, every step bit for bit: a
    narrow and a full width, with the fused prior, one request excluding its whole catalog."""
    trie = tiny_catalog(seed=9)
    model = tiny_model(trie, 9)
    hist = histories(trie, seed=9) + [trie.ids.item_ids.tolist()]
    states = user_states(model, trie, hist)
    rng = np.random.default_rng(1)
    prior = prior_log_mass(trie, torch.from_numpy(rng.random((len(hist), len(trie.ids))).astype(np.float32)), 0.5)
    sparse = SparseDead.of(trie, hist)
    assert sparse is not None
    for width, fused in ((5, None), (len(trie.ids), prior)):
        dense = beam_search(model, trie, states, width, trie.dead_nodes(hist), fused, trace=True)
        got = beam_search(model, trie, states, width, sparse, fused, trace=True)
        assert torch.equal(got.leaves, dense.leaves) and torch.equal(got.scores, dense.scores)
        for a, b in zip(got.steps, dense.steps, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert (beam_search(model, trie, states, 5, sparse).leaves[-1] == -1).all()  # nothing left to recommend


def test_rotary_tables_are_the_stacks_own_and_kept():
    """The kept cos / sin equal ``rotary_emb``'s, once per length and dtype; a forward over them reads the same
    (also outside inference mode: the tables are ordinary tensors)."""
    trie = tiny_catalog(seed=10)
    model = tiny_model(trie, 10)
    tables = RotaryTables()
    x = torch.randn(3, 5, 16)
    with torch.inference_mode():
        cos, sin = tables.of(model.timeline, x)
    want = model.timeline.rotary_emb(x, torch.arange(5)[None])
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]) and not cos.is_inference()
    assert tables.of(model.timeline, x)[0] is cos and tables.of(model.timeline, x[:, :4])[0].shape[1] == 4
    assert tables.of(model.timeline, x.double())[0].dtype == torch.float64
    with torch.no_grad():
        assert torch.equal(causal_forward(model.timeline, x, tables), causal_forward(model.timeline, x))
