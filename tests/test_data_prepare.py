"""training.data.amazon_raw / split: raw Amazon reviews -> split data dir (`recsvc data prepare-amazon`)."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsvc.cli.main import main
from recsvc.data.split import ItemMeta, load_split_dir
from recsvc.errors import UserError
from training.data.amazon_raw import PrepareConfig, parse_record, prepare_amazon
from training.data.time_split import kcore, parse_ratios, split_by_global_time

# (user, asin, rating, time). After the rating filter, the dedupe and the 2-core, 10 events remain:
#   t0 u2 B | t1 u1 A | t2 u1 B | t3 u2 A | t5 u3 A | t6 u3 C | t7 u1 C | t8 u4 B || t9 u4 C || t10 u2 C
# 8:1:1 by count -> 8 train, 1 valid (u4 C), 1 test (u2 C); u4 has 1 train item and is dropped.
REVIEWS = [
    ("u1", "A", 5, 100), ("u1", "B", 5, 200), ("u2", "A", 5, 300), ("u2", "B", 4, 400),
    ("u3", "A", 5, 500), ("u3", "C", 5, 600), ("u1", "C", 4, 700), ("u4", "B", 5, 800),
    ("u4", "C", 5, 900), ("u2", "C", 5, 1000),
    ("u1", "D", 3, 1100), ("u3", "D", 2, 1200),  # below --min-rating 4 (else D would pass the 2-core)
    ("u3", "C", 1, 0),  # low-rated earlier duplicate: filtered before the dedupe, C stays at t=600
    ("u1", "A", 5, 2000),  # later duplicate: dropped
    ("u2", "B", 5, 0),  # earlier duplicate: u2's B moves to t=0 (before A)
    ("u6", "E", 5, 850), ("u1", "E", 5, 860),  # u6 has 1 review -> gone; then E has 1 -> gone (cascade)
]
MALFORMED_REVIEWS = [
    "{not json",
    json.dumps({"reviewerID": "u9", "asin": "A", "unixReviewTime": 5}),  # no rating
    json.dumps({"reviewerID": "u9", "asin": "A", "overall": "abc", "unixReviewTime": 5}),
    "[1, 2]",
]
EXPECTED_TRAIN = {"u1": ["A", "B", "C"], "u2": ["B", "A"], "u3": ["A", "C"]}
EXPECTED_TEST = {"u2": ["C"]}


def review_line(user: str, asin: str, rating: float, ts: int, fmt: str) -> str:
    rec: dict[str, object] = {"reviewerID": user, "asin": asin, "overall": float(rating), "unixReviewTime": ts}
    if fmt == "2014":
        rec.update(helpful=[0, 0], reviewText="ok", summary="fine", reviewTime="01 1, 2014")
        if user == "u3":  # a Python-literal review line: read through the literal_eval fallback
            return repr(rec)
    else:
        rec.update(verified=True, reviewText="ok", style={"Size:": " 8 oz"})
    return json.dumps(rec)


def meta_lines(fmt: str) -> list[str]:
    if fmt == "2014":  # Python dict literals, categories as a list of lists
        recs = [
            {"asin": "A", "title": "Alpha Soap", "brand": "Acme", "categories": [["Beauty", "Bath"],
                                                                                 ["Beauty", "Soap"]],
             "description": "Gentle  soap.", "price": 3.5},
            {"asin": "B", "title": "Beta &amp; Gel", "categories": [["Beauty"]]},
            {"asin": "D", "title": "Delta"},
        ]
        return [repr(r) for r in recs] + ["{'asin': }"]
    recs = [
        {"asin": "A", "title": "Alpha Soap", "brand": "Acme", "category": ["Beauty", "Bath", "Soap"],
         "description": ["Gentle", "soap."]},
        {"asin": "B", "title": "Beta &amp; Gel", "brand": "", "category": ["Beauty"], "description": []},
        {"asin": "D", "title": "Delta"},
    ]
    return [json.dumps(r) for r in recs] + ['{"title": "no asin"}']


def write_lines(path: Path, lines: list[str]) -> Path:
    text = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def write_raw(tmp_path: Path, fmt: str, gz: bool) -> tuple[Path, Path]:
    lines = [review_line(*r, fmt=fmt) for r in REVIEWS] + MALFORMED_REVIEWS + [""]
    random.Random(7).shuffle(lines)  # file order must not matter
    suffix = ".json.gz" if gz else ".json"
    return (write_lines(tmp_path / f"reviews_{fmt}{suffix}", lines),
            write_lines(tmp_path / f"meta_{fmt}{suffix}", meta_lines(fmt)))


def by_asin(data_dir: Path) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str]]]:
    """The output's sequences in raw-id space (user index order = sorted reviewerID)."""
    data = load_split_dir(data_dir)
    names = {1: "u1", 2: "u2", 3: "u3"}
    conv = lambda part: {names[u]: [data.items[i].asin for i in seq] for u, seq in part.items() if seq}  # noqa: E731
    return conv(data.train), conv(data.valid), conv(data.test)


@pytest.mark.parametrize("fmt", ["2014", "2018"])
@pytest.mark.parametrize("gz", [True, False])
def test_prepare_pipeline(tmp_path: Path, fmt: str, gz: bool) -> None:
    reviews, meta = write_raw(tmp_path, fmt, gz)
    out = tmp_path / "out"
    stats = prepare_amazon(reviews, meta, out, PrepareConfig(kcore=2), progress=False)
    train, valid, test = by_asin(out)
    assert train == EXPECTED_TRAIN and valid == {} and test == EXPECTED_TEST
    assert stats["users"] == 3 and stats["items"] == 3
    assert stats["interactions"] == {"train": 7, "valid": 0, "test": 1, "total": 8}
    assert stats["reviews"] == {"lines": 21, "malformed": 4, "below_min_rating": 3, "duplicates": 2,
                                "after_dedupe": 12, "after_kcore": 10}
    assert stats["dropped_users"] == 1 and stats["dropped_interactions"] == 2
    assert stats["meta"] == {"lines": 4, "malformed": 1, "matched": 2, "missing": 1}
    assert stats["malformed_lines_skipped"] == 5
    assert json.loads((out / "stats.json").read_text()) == stats

    data = load_split_dir(out)
    metas = {m.asin: m for m in data.items.values()}
    categories = ("Beauty", "Bath", "Soap")
    assert metas["A"] == ItemMeta(asin="A", title="Alpha Soap", brand="Acme", categories=categories,
                                  description="Gentle soap.")
    assert metas["B"] == ItemMeta(asin="B", title="Beta & Gel", categories=("Beauty",))
    assert metas["C"] == ItemMeta(asin="C")  # no metadata line: asin only
    # every user's line in each file, ascending
    for name in ("train", "valid", "test"):
        lines = (out / f"sequential_{name}.txt").read_text().splitlines()
        assert [line.split()[0] for line in lines] == ["1", "2", "3"]


def test_item_ids_follow_the_seeded_shuffle(tmp_path: Path) -> None:
    reviews, meta = write_raw(tmp_path, "2018", gz=False)
    ids = {}
    for seed in (2023, 5):
        prepare_amazon(reviews, meta, tmp_path / f"o{seed}", PrepareConfig(kcore=2, seed=seed), progress=False)
        items = load_split_dir(tmp_path / f"o{seed}").items
        ids[seed] = [items[i].asin for i in sorted(items)]
        order = ["A", "B", "C"]
        random.Random(seed).shuffle(order)
        assert ids[seed] == order
    # the same seed gives the same files
    prepare_amazon(reviews, meta, tmp_path / "again", PrepareConfig(kcore=2), progress=False)
    for name in ("sequential_train.txt", "sequential_test.txt", "items.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "o2023" / name).read_bytes()


def test_parse_record_never_evals() -> None:
    assert parse_record("{'a': (1, 2)}") == {"a": (1, 2)}
    assert parse_record("__import__('os').system('echo hacked')") is None
    assert parse_record("{'a': print('x')}") is None
    assert parse_record('"a string"') is None


def test_split_ratios_and_worked_example() -> None:
    assert parse_ratios("8:1:1") == (8, 1, 1) and parse_ratios("7:0:3") == (7, 0, 3)
    for bad in ("8:1", "a:b:c", "0:1:1", "8:-1:1"):
        with pytest.raises(ValueError):
            parse_ratios(bad)
    events = [(t, "a", f"i{t}") for t in range(8)] + [(8, "b", "x"), (9, "a", "i9")]
    split = split_by_global_time(events, (8, 1, 1))
    assert split.train == {"a": [f"i{t}" for t in range(8)]}
    assert split.valid == {"a": []} and split.test == {"a": ["i9"]}
    assert (split.dropped_users, split.dropped_interactions) == (1, 1)


# ------------------------------------------------------------------------------------------ properties


def peel_one_at_a_time(pairs: list[tuple[int, int]], k: int) -> set[tuple[int, int]]:
    """Reference k-core: remove one under-k user or item at a time (the k-core does not depend on order)."""
    kept = set(pairs)
    while True:
        users, items = Counter(u for u, _ in kept), Counter(i for _, i in kept)
        low = next((("u", u) for u, c in sorted(users.items()) if c < k), None) or next(
            (("i", i) for i, c in sorted(items.items()) if c < k), None)
        if low is None:
            return kept
        side, key = low
        kept = {p for p in kept if (p[0] if side == "u" else p[1]) != key}


pairs_st = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 9)), unique=True, max_size=80)


@settings(max_examples=150, deadline=None)
@given(pairs=pairs_st, k=st.integers(1, 5))
def test_kcore_is_the_maximal_k_core(pairs: list[tuple[int, int]], k: int) -> None:
    core = kcore(pairs, k)
    assert all(c >= k for c in Counter(u for u, _ in core).values())
    assert all(c >= k for c in Counter(i for _, i in core).values())
    assert set(core) == peel_one_at_a_time(pairs, k)
    assert core == [p for p in pairs if p in set(core)]  # input order kept


@settings(max_examples=100, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6), st.integers(0, 9)), unique=True,
                       max_size=60),
       ratios=st.tuples(st.integers(1, 9), st.integers(0, 3), st.integers(0, 3)))
def test_global_split_invariants(events: list[tuple[int, int, int]], ratios: tuple[int, int, int]) -> None:
    split = split_by_global_time(events, ratios, min_train=2)
    ordered = sorted(events)
    cut1 = len(ordered) * ratios[0] // sum(ratios)
    cut2 = len(ordered) * (ratios[0] + ratios[1]) // sum(ratios)
    kept = set(split.train)
    assert all(len(split.train[u]) >= 2 for u in kept)
    assert set(split.valid) == set(split.test) == kept
    for part, lo, hi in ((split.train, 0, cut1), (split.valid, cut1, cut2), (split.test, cut2, len(ordered))):
        expected: dict[int, list[int]] = {u: [] for u in kept}
        for _, u, i in ordered[lo:hi]:
            if u in kept:
                expected[u].append(i)
        assert part == expected
    dropped = {u for _, u, _ in events} - kept
    assert split.dropped_users == len(dropped)
    assert split.dropped_interactions == sum(1 for _, u, _ in events if u in dropped)


@settings(max_examples=25, deadline=None)
@given(reviews=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 7), st.integers(1, 5), st.integers(0, 50)),
                        min_size=1, max_size=70),
       k=st.integers(1, 3))
def test_prepare_output_invariants(tmp_path_factory: pytest.TempPathFactory,
                                   reviews: list[tuple[int, int, int, int]], k: int) -> None:
    root = tmp_path_factory.mktemp("prop")
    lines = [json.dumps({"reviewerID": f"U{u}", "asin": f"I{i}", "overall": r, "unixReviewTime": t})
             for u, i, r, t in reviews]
    write_lines(root / "r.json", lines)
    write_lines(root / "m.json", ['{"asin": "I1", "title": "one"}'])
    try:
        stats = prepare_amazon(root / "r.json", root / "m.json", root / "out", PrepareConfig(kcore=k),
                               progress=False)
    except UserError as exc:
        assert "no usable review" in str(exc) or "core" in str(exc) or "no user has" in str(exc)
        return
    # the k-core property, checked on what the pipeline kept (before the split)
    good = {}
    for u, i, r, t in reviews:
        if r >= 4:
            good[(u, i)] = min(t, good.get((u, i), t))
    core = kcore(list(good), k)
    assert stats["reviews"]["after_kcore"] == len(core)
    data = load_split_dir(root / "out")
    assert sorted(data.items) == list(range(1, data.num_items + 1))
    assert sorted(data.train) == list(range(1, len(data.train) + 1))
    used = {i for part in (data.train, data.valid, data.test) for s in part.values() for i in s}
    assert used == set(data.items)  # item set = items of the kept users' interactions
    # users are numbered in reviewerID order; each user's items are kept reviews, deduped, chronological
    kept = sorted(split_by_global_time((good[p], f"U{p[0]}", p[1]) for p in core).train)
    assert len(kept) == len(data.train)
    for user, seq in data.train.items():
        assert len(seq) >= 2
        full = seq + data.valid[user] + data.test[user]
        assert len(set(full)) == len(full)
        raw_user = int(kept[user - 1][1:])
        times = [good[(raw_user, int(data.items[i].asin[1:]))] for i in full]  # KeyError = not a kept review
        assert times == sorted(times)


# ------------------------------------------------------------------------------------------ CLI


def test_cli_prepare(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("RECSVC_PROGRESS", "bar")  # captured stderr is no terminal: ask for the bars
    reviews, meta = write_raw(tmp_path, "2018", gz=True)
    out = tmp_path / "out"
    rc = main(["data", "prepare-amazon", "--reviews", str(reviews), "--meta", str(meta), "--out", str(out),
               "--kcore", "2", "--min-rating", "4", "--split", "8:1:1", "--seed", "2023"])
    assert rc == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["users"] == 3
    assert "skipped 5 malformed lines" in captured.err
    assert f"reviews {reviews.name}" in captured.err and "meta" in captured.err  # progress bars on stderr
    assert by_asin(out)[0] == EXPECTED_TRAIN


def test_cli_prepare_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reviews, meta = write_raw(tmp_path, "2014", gz=False)
    base = ["data", "prepare-amazon", "--meta", str(meta), "--out", str(tmp_path / "o"), "--quiet"]

    assert main([*base, "--reviews", str(tmp_path / "missing.json.gz")]) == 2
    assert "error: reviews file not found" in capsys.readouterr().err

    assert main([*base, "--reviews", str(reviews), "--kcore", "10"]) == 2
    assert "error: no interaction survives the 10-core" in capsys.readouterr().err

    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress(b'{"a": 1}\n' * 1000)[:60])  # truncated gzip stream
    assert main([*base, "--reviews", str(broken)]) == 2
    assert "corrupt or truncated gzip" in capsys.readouterr().err

    for flag, value in (("--split", "8:1"), ("--kcore", "-1"), ("--min-rating", "high"), ("--seed", "x")):
        with pytest.raises(SystemExit) as exc:
            main([*base, "--reviews", str(reviews), flag, value])
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err
