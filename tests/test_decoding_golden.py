"""Outputs per mode on a fixed tiny bundle, compared with the recorded ones (tests/data/decoding_golden.json).

The bundle is built deterministically (seeded synthetic data, seeded random tiny target and LLaMA drafter, a fused
transition prior, item attributes, one fresh tail slot: ``catalog_fixtures.live_bundle``); the served recommender
is built the way ``recsvc serve`` builds it (``ServeSettings`` -> ``build_recommender``) at two beam widths, with
the LLaMA and the transition drafter. Every request of the table (plain / strict / relaxed, k = 1, 3, 5, with and
without history exclusion, with filters, caps and boosts) must return the recorded items, scores (to 1e-4) and
``Decoding`` record. It guards refactors of the recommender, its construction and its decoding dispatch: a
change that alters what is served fails here.

To re-record after a change that is MEANT to alter outputs: ``RECSVC_RECORD_GOLDEN=1 python -m pytest
tests/test_decoding_golden.py`` (and say why in the commit).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
from catalog_fixtures import live_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.bundle.directory import Bundle
from recsvc.data.split import load_split_dir
from recsvc.recommender.api import RecQuery
from recsvc.rules.spec import Boost, Cap, Rules, ValueFilter
from recsvc.service.startup.settings import ServeSettings, build_recommender

pytestmark = pytest.mark.usefixtures("one_thread")
GOLDEN = Path(__file__).parent / "data" / "decoding_golden.json"
RECORD = os.environ.get("RECSVC_RECORD_GOLDEN") == "1"
# (name, serve flags): the served engine variants (fp32: the same numbers on every CPU)
VARIANTS = [
    ("llama-w8", ["--dtype", "fp32", "--beam-width", "8", "--spec", "3:2", "--drafter", "llama",
                  "--state-cache-mb", "0"]),
    ("llama-w0-excl", ["--dtype", "fp32", "--beam-width", "0", "--spec", "2:3", "--drafter", "llama",
                       "--exclude-history", "--state-cache-mb", "0"]),
    ("transition-w6", ["--dtype", "fp32", "--beam-width", "6", "--spec", "4:3", "--drafter", "transition",
                       "--state-cache-mb", "0"]),
    ("spec-off-w8-cached", ["--dtype", "fp32", "--beam-width", "8", "--spec", "off", "--no-fresh"]),
]
CAP = Rules(caps=(Cap("brand", 1),))
BOOST = Rules(boosts=(Boost("brand", "kirra", 0.7),))
ALLOW = Rules(allow=(ValueFilter("brand", frozenset({"acme"})),))


def queries(histories: list[list[int]]) -> list[tuple[str, RecQuery]]:
    """The request table: every mode at k = 1, 3, 5; relaxed seeded; rules (filters, caps, boosts) on plain and
    strict; one request that keeps its history against the served choice."""
    out = []
    for u, h in enumerate(histories):
        for mode in ("plain", "strict", "relaxed"):
            for k in (1, 3, 5):
                out.append((f"u{u}-{mode}-k{k}", RecQuery(history=h, k=k, mode=mode, seed=7 + u)))
        for mode in ("plain", "strict"):
            for name, rules in (("cap", CAP), ("boost", BOOST), ("allow", ALLOW)):
                out.append((f"u{u}-{mode}-{name}", RecQuery(history=h, k=4, mode=mode, rules=rules)))
        out.append((f"u{u}-plain-keep", RecQuery(history=h, k=3, mode="plain", exclude_history=False,
                                                 exclude=(h[0],))))
    return out


def outputs(bundle: Path) -> dict[str, dict]:
    """{variant/request: items, scores, fresh, decoding}: single requests, then the same table as one batch."""
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    histories = [u.history[-8:] for u in data.eval_users("valid")[:3]]
    table = queries(histories)
    got: dict[str, dict] = {}
    for variant, flags in VARIANTS:
        rec = build_recommender(ServeSettings.for_bundle(str(bundle), flags), step=lambda *a, **kw: None)
        batched = rec.recommend([q for _, q in table])
        for (name, query), together in zip(table, batched, strict=True):
            alone = rec.recommend([query])[0]
            for how, res in (("alone", alone), ("batch", together)):
                got[f"{variant}/{how}/{name}"] = {
                    "items": list(res.item_ids), "scores": [round(float(s), 5) for s in res.scores],
                    "fresh": res.fresh, "decoding": asdict(res.decoding) if res.decoding is not None else None}
    return got


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return live_bundle(tmp_path_factory.mktemp("golden"), n_users=40)


def test_outputs_per_mode_match_the_recorded_ones(bundle) -> None:
    got = outputs(bundle)
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    modes = {entry["decoding"]["mode"] for entry in want.values() if entry["decoding"]}
    assert modes == {"plain", "strict", "relaxed", "sampling"}  # the table reaches every decoding path
    for key, entry in want.items():
        assert got[key]["items"] == entry["items"], key
        assert got[key]["scores"] == pytest.approx(entry["scores"], abs=1e-4), key
        assert got[key]["fresh"] == entry["fresh"], key
        assert got[key]["decoding"] == entry["decoding"], key
