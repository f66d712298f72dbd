"""Prior-aware training (`--prior-loss`): the leave-one-out log-shares per code level, where the batch's bias lands,
the fused loss, and `recsvc build --prior-loss` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_commands import only_commands
from test_train_fixtures import one_thread, small_tokenizer, tiny_build_argv  # noqa: F401

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.bundle.presets import get_preset, new_model
from recsvc.bundle.prompt import IGNORE_INDEX, PromptBuilder
from recsvc.priors.transition import PriorSettings, TransitionPrior
from tokenizer_rqvae.ids import SemanticIds
from training.target_lm.prior_loss import FLOOR, PriorFusion, PriorTerm, lifted
from training.target_lm.sequences import collate, train_examples
from training.target_lm.train import lm_loss

# items sharing prefixes, so that a level's children are several codes under one prefix
IDS = SemanticIds.from_mapping({10: (0, 0, 0, 0), 11: (0, 0, 0, 1), 12: (0, 1, 0, 0), 13: (1, 0, 0, 0),
                                14: (1, 0, 1, 0), 15: (2, 3, 4, 5)})
SEQS = [[10, 11, 12], [10, 11], [10, 13, 14], [13, 14, 10], [11, 12, 15], [15, 10]]


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "build")


def _brute_log_shares(source: int, target: int, beta: float) -> np.ndarray:
    """[L, C] log Q(c | target's prefix) from TransitionPrior.probs with the one transition source -> target
    taken out of the counts (leave-one-out), aggregated over the items by brute force."""
    prior = TransitionPrior.fit(SEQS, IDS.item_ids.tolist(), PriorSettings(window=1, beta=beta))
    src, dst = IDS.index_of(source), IDS.index_of(target)
    counts = prior.counts.copy()
    for e in range(prior.indptr[src], prior.indptr[src + 1]):
        counts[e] -= prior.indices[e] == dst
    loo = TransitionPrior(prior.item_ids, prior.indptr, prior.indices, counts, prior.item_counts, prior.settings)
    p = loo.probs([[source]])[0].astype(np.float64)
    codes = IDS.codes
    out = np.full((IDS.levels, IDS.codebook_size), FLOOR)
    for level in range(IDS.levels):
        under = (codes[:, :level] == codes[dst, :level]).all(axis=1)
        mass = np.zeros(IDS.codebook_size)
        np.add.at(mass, codes[under, level], p[under])
        out[level, mass > 0] = np.log(mass[mass > 0] / mass.sum())
    return out


@pytest.mark.parametrize("beta", [1.0, 0.25])
def test_log_shares_are_the_leave_one_out_prior_per_level(beta) -> None:
    term = PriorTerm(PromptBuilder(small_tokenizer(), IDS, header="compact"), SEQS, beta=beta)
    pairs = [(10, 11), (10, 13), (11, 12), (13, 14), (15, 10), (12, 15)]  # (12, 15): never counted
    got = term.log_shares(np.array([IDS.index_of(a) for a, _ in pairs]), np.array([IDS.index_of(b) for _, b in pairs]))
    assert got.shape == (len(pairs), IDS.levels, IDS.codebook_size)
    for k, (a, b) in enumerate(pairs):
        np.testing.assert_allclose(got[k], _brute_log_shares(a, b, beta), rtol=1e-5, atol=1e-5)
    # leave-one-out: 10 -> 11 is counted twice; predicting it, one count remains beside 10 -> 13's one, so the
    # level-0 shares of codes 0 (items 10-12) and 1 (13, 14) are nearly even (beta's back-off aside)
    assert abs(got[0, 0, 0] - got[0, 0, 1]) < 0.3
    # the last level under (0, 0, 0): item 11 (code 1) keeps its other count, item 10 (code 0) only back-off
    assert got[0, 3, 1] > got[0, 3, 0] > FLOOR


def test_batch_bias_lands_on_each_labelled_code_of_an_item_after_another() -> None:
    builder = PromptBuilder(small_tokenizer(), IDS, max_history=2, header="compact")
    term = PriorTerm(builder, SEQS)
    examples = train_examples(builder, {u: s for u, s in enumerate(SEQS)})
    batch = collate(examples, 0)
    b, t, lv, shares = term.batch_bias(batch["input_ids"], batch["labels"])
    labels = batch["labels"]
    assert len(b) == int((labels != IGNORE_INDEX).sum())  # every labelled token of these windows (all codes)
    step = IDS.levels + len(builder.sep_ids)
    for r, pos, level, row in zip(b.tolist(), t.tolist(), lv.tolist(), shares, strict=True):
        code = int(labels[r, pos]) - builder.code_offset - IDS.codebook_size * level
        assert 0 <= code < IDS.codebook_size
        start = pos - level  # the labelled item's first code; the previous item's codes one step before
        item, prev = (_item_at(builder, batch["input_ids"][r, at:at + IDS.levels]) for at in (start, start - step))
        want = lifted(_brute_log_shares(prev, item, 1.0)[level])
        np.testing.assert_allclose(row.numpy(), want, atol=1e-5)
        assert row.min() == 0 and row[code] >= 0  # level with the least likely child; nothing masked


def _item_at(builder: PromptBuilder, tokens: torch.Tensor) -> int:
    codes = tuple(int(x) - builder.code_offset - IDS.codebook_size * lv for lv, x in enumerate(tokens))
    return next(int(i) for i in IDS.item_ids if IDS.codes_of(int(i)) == codes)


def test_lifted_sets_other_tokens_level_with_the_least_likely_child() -> None:
    shares = np.array([[np.log(0.5), np.log(0.25), FLOOR, np.log(0.25)], [0.0, FLOOR, FLOOR, FLOOR]])
    np.testing.assert_allclose(lifted(shares), [[np.log(2.0), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], atol=1e-6)


def test_the_loss_is_cross_entropy_of_the_logits_plus_the_weighted_shares() -> None:
    tok = small_tokenizer()
    builder = PromptBuilder(tok, IDS, max_history=2, header="compact")
    torch.manual_seed(0)
    model = new_model(get_preset("tiny"), tok, seed=0).eval().requires_grad_(False)
    batch = collate(train_examples(builder, {u: s for u, s in enumerate(SEQS)}), tok.pad_token_id)
    fusion = PriorFusion(PriorTerm(builder, SEQS), weight=0.7)
    got, n = lm_loss(model, batch, fusion)
    # by hand: full logits, the bias added at the token each position predicts
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()  # [B, T, V]
    b, t, lv, shares = fusion.term.batch_bias(batch["input_ids"], batch["labels"])
    for r, pos, level, row in zip(b.tolist(), t.tolist(), lv.tolist(), shares, strict=True):
        start = builder.code_offset + IDS.codebook_size * level
        logits[r, pos - 1, start:start + IDS.codebook_size] += 0.7 * row
    labels = batch["labels"][:, 1:]
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)
    assert n == int((labels != IGNORE_INDEX).sum())
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    plain, _ = lm_loss(model, batch, PriorFusion(fusion.term, weight=0.0))
    strong, _ = lm_loss(model, batch, PriorFusion(fusion.term, weight=3.0))
    assert abs(plain.item() - got.item()) > 1e-4 and abs(strong.item() - plain.item()) > 0.1  # the prior counts


@pytest.mark.usefixtures("one_thread")
def test_build_with_prior_loss_records_it_and_bad_weights_exit_2(tmp_path) -> None:
    argv, out = tiny_build_argv(tmp_path)
    assert cli.main([*argv, "--prior-loss", "-1"]) == 2
    assert cli.main([*argv, "--prior-loss", "1", "--prior-loss-beta", "0"]) == 2
    assert cli.main([*argv, "--prior-loss", "1.5", "--dense-head", "1.0"]) == 0
    info = json.loads((Bundle.open(out).target_dir / "training.json").read_text())
    assert info["prior_loss"] == {"weight": 1.5, "beta": 1.0}
    assert info["refit"]["epochs"] == 1 and info["best"]["metric"] == "recall@10"
