"""`recsvc tune prior` / `tune mix` trials re-score cached candidates: equal to the full decode where the candidates
cover the beam, the cache resumes part by part, and the chosen settings are checked with one full decode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.bundle.loading import load_causal_lm
from recsvc.data.metrics import evaluate_rankings
from recsvc.data.split import load_split_dir
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.priors.mixed import MixedPrior, MixSettings, SequenceModel
from recsvc.priors.transition import PriorSettings, TransitionPrior
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation import token_passes
from training.evaluation.rankers import TokenRanker
from training.evaluation.ranking import rank_users, serving_model
from training.evaluation.token_passes import leaf_logprobs, wide_beam
from training.tuning import rescore_cache
from training.tuning.rescore import DenseMasses, PriorTables, Rescorer, SearchTables, coverage
from training.tuning.rescore_cache import BeamStore, CandidateCache, Widths
from training.tuning.rescore_cache import build_candidates as build_over


def build_candidates(model, builder, trie, *args, **kwargs):
    """The candidates of the token target (``TokenRanker``), as the tunings build them."""
    return build_over(TokenRanker(model, builder, trie), trie, *args, **kwargs)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny bundle's train-only model, trie, validation users, train-period prior and a SASRec that lacks some
    catalog items (so the mix's "SASRec lacks it" branch runs)."""
    from recsvc.priors.sasrec import SASRec
    from training.baselines.sasrec import SASRecBaseline
    from training.baselines.sasrec_train import SASRecSettings

    root = tiny_bundle(tmp_path_factory.mktemp("rescore"), n_users=60)
    b = Bundle.open(root)
    data = load_split_dir(b.data_dir())
    ids = b.load_ids()
    items = ids.item_ids.tolist()
    torch.manual_seed(0)
    known = items[:-8]
    seq_dir = SASRecBaseline(SASRec(len(known), hidden=8, blocks=1, heads=1, max_len=10), torch.tensor(known),
                             torch.ones(len(known)), SASRecSettings(hidden=8, blocks=1, heads=1, max_len=10)
                             ).save(root / "sasrec")
    return {"root": root, "model": serving_model(load_causal_lm(b.target_dir, dtype="fp32")),
            "builder": b.prompt_builder(ids=ids), "trie": CatalogTrie(ids), "users": data.eval_users("valid"),
            "prior": TransitionPrior.fit(data.train.values(), items, fitted_on="train"),
            "sequence": SequenceModel.load(seq_dir), "n": len(items)}


def test_forced_log_probs_equal_the_beam_scores(world) -> None:
    """A candidate's log-prob computed by the forced pass is the score the engine's unfused search gives the same
    leaf, and the candidates' own wide beam finds the same leaves with the same partial sums."""
    from recsvc.engine.search.beam_search import BeamSearch

    model, builder, trie, users = world["model"], world["builder"], world["trie"], world["users"][:6]
    prompts = PromptBatch.from_lists([builder.prompt_ids(u.history) for u in users])
    beam = BeamSearch(model, trie, builder.code_offset).search(prompts, 12)
    leaves = beam.leaves.flip(1).clone()  # another order, and a padded column
    leaves[0, 0] = -1
    forced = leaf_logprobs(model, trie, builder.code_offset, prompts, leaves)  # [B, n, L]
    assert forced.shape == (*leaves.shape, trie.levels) and bool((forced[0, 0] == float("-inf")).all())
    ok = leaves >= 0
    assert torch.allclose(forced[..., -1][ok], beam.scores.flip(1)[ok], atol=1e-5)
    mine, partial = wide_beam(model, trie, builder.code_offset, prompts, 12, None)[-1]
    assert torch.equal(mine, beam.leaves)
    again = leaf_logprobs(model, trie, builder.code_offset, prompts, mine)
    assert torch.allclose(partial, again, atol=1e-5) and torch.allclose(partial[..., -1], beam.scores, atol=1e-5)


@pytest.mark.parametrize("exclude", [False, True])
def test_rescored_objective_equals_the_full_decode_when_the_candidates_cover_the_beam(world, exclude) -> None:
    """Candidates = the whole catalog and a search as wide as the catalog (so it prunes nothing): every trial's
    re-scored lists and NDCG@10 / Recall@10 are the full decode's, for the transition prior and the SASRec mix."""
    model, builder, trie, users, prior, seq = (world[k] for k in ("model", "builder", "trie", "users", "prior",
                                                                  "sequence"))
    n = world["n"]
    cands = build_candidates(model, builder, trie, users, prior, Widths(beam=n, prior=0), exclude)
    assert int((cands.leaves >= 0).sum(1).max()) <= n
    scorer = Rescorer(cands, PriorTables.build(prior, trie, users, cands, seq), users)
    trials = [(PriorSettings(weight=0.0), None), (PriorSettings(window=1, decay=0.5, beta=1.0, weight=0.7), None),
              (PriorSettings(window=4, decay=0.3, beta=0.05, weight=2.5), None),
              (PriorSettings(window=2, decay=0.8, beta=3.0, weight=1.5), MixSettings(0.4, 0.5, 0.0)),
              (PriorSettings(window=3, decay=0.5, beta=0.5, weight=1.0), MixSettings(0.3, 2.0, 0.7))]
    for st, mix in trials:
        fused = prior.with_settings(st) if mix is None else MixedPrior(prior.with_settings(st), seq, mix)
        decoded = rank_users(model, builder, trie, users, 10, 64, exclude_history=exclude, progress=False,
                             prior=fused, beam_width=n)
        assert scorer.lists(st, mix) == decoded, (st, mix)
        assert coverage(scorer, decoded) == 1.0
        full = evaluate_rankings(decoded, users, (10,))
        mine = scorer.evaluate(st, mix)
        assert mine["ndcg@10"] == pytest.approx(full["ndcg@10"], abs=1e-12)
        assert mine["recall@10"] == pytest.approx(full["recall@10"], abs=1e-12)


@pytest.mark.parametrize("exclude", [False, True])
def test_the_replayed_search_equals_a_narrow_full_decode(world, exclude) -> None:
    """Every item a candidate and the served search narrower than the catalog (it prunes): replaying its pruning
    on the candidates (``SearchTables``) gives the decoded lists user for user, for every transition setting."""
    model, builder, trie, users, prior, seq = (world[k] for k in ("model", "builder", "trie", "users", "prior",
                                                                  "sequence"))
    cands = build_candidates(model, builder, trie, users, prior, Widths(beam=world["n"], prior=0), exclude)
    tables = PriorTables.build(prior, trie, users, cands)
    search = SearchTables.build(prior, trie, users, cands)
    dense = DenseMasses(prior, seq, trie, users, cands)
    for width in (4, 12):
        scorer = Rescorer(cands, tables, users, k=3, search=search, width=width, dense=dense)
        for st, mix in ((PriorSettings(weight=0.0), None),
                        (PriorSettings(window=1, decay=0.5, beta=1.0, weight=0.7), None),
                        (PriorSettings(window=4, decay=0.3, beta=0.05, weight=2.5), None),
                        (PriorSettings(window=2, decay=0.8, beta=3.0, weight=1.5), MixSettings(0.4, 0.5, 0.0)),
                        (PriorSettings(window=3, decay=0.5, beta=0.5, weight=1.0), MixSettings(0.3, 2.0, 0.7))):
            fused = prior.with_settings(st) if mix is None else MixedPrior(prior.with_settings(st), seq, mix)
            decoded = rank_users(model, builder, trie, users, 3, 64, exclude_history=exclude, progress=False,
                                 prior=fused, beam_width=width)
            assert scorer.lists(st, mix) == decoded, (width, st, mix)
    without = Rescorer(cands, tables, users, k=3, search=search, width=4)
    with pytest.raises(ValueError, match="transition prior alone"):
        without.lists(PriorSettings(weight=1.0), MixSettings(0.5, 1.0, 0.0))


def test_the_tables_give_the_engines_leaf_masses(world) -> None:
    """log m(leaf) from the tables equals the engine's ``prior_log_mass`` up to one constant per user (its root)."""
    trie, users, prior, seq = world["trie"], world["users"], world["prior"], world["sequence"]
    cands = build_candidates(world["model"], world["builder"], trie, users, prior, Widths(beam=5, prior=3), False)
    tables = PriorTables.build(prior, trie, users, cands, seq)
    st, mix = PriorSettings(window=5, decay=0.4, beta=0.2), MixSettings(0.6, 0.7, 0.4)
    full = MixedPrior(prior.with_settings(st), seq, mix).probs([u.history for u in users])
    ref = prior_log_mass(trie, torch.from_numpy(full), 1.0).gather(1, cands.leaves.clamp(min=0))
    mine = tables.log_mass(st, mix)
    ok = cands.leaves >= 0
    shift = torch.where(ok, mine - ref, 0.0)
    per_user = shift.sum(1) / ok.sum(1)  # the constant of each user
    assert torch.allclose(shift[ok], per_user[:, None].expand_as(shift)[ok], atol=1e-4)


def test_the_cache_resumes_part_by_part(world, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(rescore_cache, "PART_USERS", 8)
    model, builder, trie, users, prior = (world[k] for k in ("model", "builder", "trie", "users", "prior"))
    widths = Widths(beam=6, prior=4)
    built: list[int] = []

    def build(chunk):
        built.append(len(chunk))
        return build_candidates(model, builder, trie, chunk, prior, widths, False)

    key = {"users": len(users)}
    cache = CandidateCache(rescore_cache.cache_dir(tmp_path, "prior", key, widths), key, widths, users)
    first, info = cache.load_or_build(build)
    parts = (len(users) + 7) // 8
    assert info["parts_built"] == parts and len(built) == parts and cache.built() == parts
    (cache.directory / "part-00001.safetensors").unlink()  # an interrupted build
    again, info = cache.load_or_build(build)
    assert info == {**info, "parts_built": 1, "parts_reused": parts - 1} and built[-1] == 8
    assert np.array_equal(again.user_ids, first.user_ids) and torch.equal(again.leaves, first.leaves)
    assert torch.equal(again.target, first.target)
    # other widths or another key: another directory, never the stale parts
    assert rescore_cache.cache_dir(tmp_path, "prior", key, Widths(beam=7, prior=4)) != cache.directory
    assert rescore_cache.cache_dir(tmp_path, "prior", {"users": 3}, widths) != cache.directory
    stale = CandidateCache(cache.directory, key, widths, list(reversed(users)))
    with pytest.raises(RuntimeError, match="other users"):
        stale.load_or_build(build)


def test_a_second_study_reads_the_first_ones_wide_beams(world, tmp_path, monkeypatch) -> None:
    """`tune mix` after `tune prior` (one history rule): the mix's candidates come from the wide beams the prior's
    study stored, with no search of their own, and equal the candidates it builds without them."""
    monkeypatch.setattr(rescore_cache, "PART_USERS", 16)
    model, builder, trie, users, prior = (world[k] for k in ("model", "builder", "trie", "users", "prior"))
    searched: list[int] = []
    real = token_passes.wide_beam

    def counted(*a, **kw):
        out = real(*a, **kw)
        searched.append(len(out[0][0]))
        return out

    monkeypatch.setattr(token_passes, "wide_beam", counted)
    for exclude in (False, True):
        store = BeamStore(tmp_path, {"exclude_history": exclude}, 6, users)
        for widths in (Widths(beam=6, prior=0), Widths(beam=6, prior=4, sequence=3)):  # prior's, then mix's
            top = [np.arange(i % 5, i % 5 + 3) for i in range(len(users))] if widths.sequence else None
            parts = []
            for lo in range(0, len(users), 16):
                chunk = users[lo: lo + 16]
                mine = top[lo: lo + 16] if top is not None else None
                found = store.load(chunk)
                before = len(searched)
                parts.append(build_candidates(model, builder, trie, chunk, prior, widths, exclude, mine, beams=found))
                store.save(chunk, found)
                if widths.sequence:  # the mix's study: no search, the same candidates as its own search gives
                    assert len(searched) == before
                    alone = build_candidates(model, builder, trie, chunk, prior, widths, exclude, mine)
                    assert torch.equal(parts[-1].leaves, alone.leaves) and torch.equal(parts[-1].items, alone.items)
                    assert torch.equal(parts[-1].partial, alone.partial)
        assert store.stored == store.reused == (len(users) + 15) // 16
    dirs = {BeamStore(tmp_path, key, width, users).directory
            for key, width in (({"exclude_history": False}, 6), ({"exclude_history": True}, 6), ({}, 7))}
    assert len(dirs) == 3  # another rule or width: another store
    with pytest.raises(RuntimeError, match="other users"):
        BeamStore(tmp_path, {"exclude_history": False}, 6, list(reversed(users))).load(list(reversed(users))[:16])


def test_tune_prior_rescores_resumes_its_cache_and_checks_the_choice(tmp_path, monkeypatch, capsys) -> None:
    """The CLI: re-scored trials, the check of the chosen settings with a full decode (both figures printed and
    recorded), the headline figure in bundle.json and in `recsvc eval`'s output; a second run reuses the cache;
    ``--full-decode`` decodes every trial (its own study)."""
    only_commands(monkeypatch, "tune", "eval")
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["tune", "prior", "--bundle", str(root), "--users", "all", "--dtype", "fp32", "--budget-minutes", "5"]
    assert cli.main([*base, "--trials", "4"]) == 0
    out = capsys.readouterr().out
    assert "check of the chosen settings" in out and "the fused target over the prior alone" in out
    meta = Bundle.open(root).read()
    record = meta["tuning"]["prior"]
    assert record["objective"] == "rescored" and record["candidates"]["parts_built"] >= 1
    check = record["check"]
    assert set(check) >= {"rescored", "full_decode", "same_top10_lists", "within_one_se", "diff_ndcg@10_se"}
    assert check["rescored"]["ndcg@10"] == pytest.approx(record["valid"]["ndcg@10"])
    assert 0.0 <= check["same_top10_lists"] <= 1.0 and check["users"] == record["valid_users"]
    assert 0.0 <= check["decoded_in_candidates"] <= 1.0 and check["full_decode_seconds"] > 0
    head = meta["target_over_prior"]
    assert head == record["target_over_prior"] and head["source"] == "tune prior" and head["split"] == "valid"
    assert head["ndcg@10"]["fused"] == pytest.approx(check["full_decode"]["ndcg@10"])
    assert cli.main([*base, "--trials", "6"]) == 0  # the same study and cache: two more trials, no part built
    record = Bundle.open(root).read()["tuning"]["prior"]
    assert record["trials_this_run"] == 2 and record["candidates"]["parts_built"] == 0
    assert record["candidates"]["parts_reused"] >= 1
    assert cli.main([*base, "--trials", "2", "--full-decode"]) == 0
    record = Bundle.open(root).read()["tuning"]["prior"]
    assert record["objective"] == "full decode" and record["check"] is None and record["trials_this_run"] == 2
    capsys.readouterr()
    res = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                     "--baselines", "none", "--json", str(res)]) == 0
    printed = capsys.readouterr().out
    assert "the fused target over the prior alone (valid" in printed
    assert json.loads(res.read_text())["headline"]["target_over_prior"]["source"] == "tune prior"


def test_tune_mix_rescores_and_writes_the_headline(tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "tune")
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["--bundle", str(root), "--users", "all", "--dtype", "fp32", "--budget-minutes", "5"]
    assert cli.main(["tune", "prior", *base, "--trials", "2"]) == 0
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2"]) == 0
    assert "check of the chosen settings" in capsys.readouterr().out
    meta = Bundle.open(root).read()
    record = meta["tuning"]["mix"]
    assert record["objective"] == "rescored" and record["candidates"]["widths"]["sequence"] > 0
    assert record["check"]["rescored"]["ndcg@10"] == pytest.approx(record["valid"]["ndcg@10"])
    head = meta["target_over_prior"]
    assert head["source"] == "tune mix" and head["ndcg@10"]["prior_alone"] == pytest.approx(
        record["valid_prior_alone"]["ndcg@10"])


def test_candidate_widths_are_checked(tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "tune")
    root = Path(tiny_bundle(tmp_path, n_users=30))
    assert cli.main(["tune", "prior", "--bundle", str(root), "--candidates", "0", "--trials", "1"]) == 2
    assert "candidate widths" in capsys.readouterr().err
