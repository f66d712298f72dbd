"""`recsvc data import`: a team's own log + item table (CSV or Parquet) -> the split format; bad input exits 2
naming the file, the row and the column (training/data/importer.py, docs/DATA.md)."""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsvc.cli.main import main
from recsvc.data.split import load_split_dir, split_file
from training.data.time_split import split_leave_last_out
from training.data.times import parse_time

# (user, item, time): times in every accepted form (ISO with Z / offset / date only, epoch s, epoch ms).
# X is not in the item table (dropped and counted); u2's second A is a later duplicate (the earliest is kept);
# u4 has 2 interactions: inside the 2-core, but leave-last-out needs 2 train + valid + test, so u4 is dropped.
LOG = [
    ("u1", "A", "2024-01-01T00:00:00Z"), ("u1", "B", "1704153600"), ("u1", "C", "1704240000000"),
    ("u1", "D", "2024-01-04T00:00:00+00:00"), ("u1", "X", "2024-01-05T00:00:00Z"),
    ("u2", "B", "2024-01-01T06:00:00Z"), ("u2", "A", "2024-01-02T06:00:00Z"), ("u2", "C", "2024-01-03T06:00:00Z"),
    ("u2", "D", "2024-01-05"), ("u2", "A", "2024-02-01T00:00:00Z"),
    ("u3", "D", "2024-01-01T12:00:00Z"), ("u3", "A", "2024-01-02T12:00:00Z"), ("u3", "B", "2024-01-03T12:00:00Z"),
    ("u3", "C", "2024-01-06T12:00:00Z"),
    ("u4", "A", "2024-01-02T00:00:00Z"), ("u4", "B", "2024-01-03T00:00:00Z"),
]
ITEMS = [  # (id, title, brand, categories)
    ("A", "Alpha Soap", "Acme", ["Beauty", "Bath"]), ("B", "Beta Shampoo", "Lumina", ["Beauty", "Hair"]),
    ("C", "Gamma Cream", "", ["Beauty"]), ("D", "Delta Oil", "Acme", []), ("E", "Epsilon Mist", "Kirra", ["Scent"]),
]
EXPECTED = {  # leave-last-out, by external ids
    "train": {"u1": ["A", "B"], "u2": ["B", "A"], "u3": ["D", "A"]},
    "valid": {"u1": ["C"], "u2": ["C"], "u3": ["B"]},
    "test": {"u1": ["D"], "u2": ["D"], "u3": ["C"]},
}


def write_csv(path: Path, header: list[str], rows: list[tuple]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def csv_inputs(tmp: Path) -> tuple[Path, Path]:
    log = write_csv(tmp / "log.csv", ["user_id", "item_id", "timestamp"], LOG)
    items = write_csv(tmp / "items.csv", ["item_id", "title", "brand", "categories"],
                      [(i, t, b, "|".join(c)) for i, t, b, c in ITEMS])
    return log, items


def parquet_inputs(tmp: Path, times: str) -> tuple[Path, Path]:
    """The same tables as Parquet; times as "text" (the CSV's strings), "ms" (int64) or "timestamp" (arrow)."""
    seconds = [parse_time(t) for _, _, t in LOG]
    column = {"text": pa.array([t for _, _, t in LOG]),
              "ms": pa.array([int(s * 1000) for s in seconds], type=pa.int64()),
              "timestamp": pa.array([datetime.fromtimestamp(s, UTC) for s in seconds], type=pa.timestamp("s", "UTC"))}
    log = tmp / f"log_{times}.parquet"
    pq.write_table(pa.table({"user_id": [u for u, _, _ in LOG], "item_id": [i for _, i, _ in LOG],
                             "timestamp": column[times]}), log)
    items = tmp / "items.parquet"
    pq.write_table(pa.table({"item_id": [i[0] for i in ITEMS], "title": [i[1] for i in ITEMS],
                             "brand": [i[2] or None for i in ITEMS], "categories": [i[3] for i in ITEMS]}), items)
    return log, items


def run_import(log: Path, items: Path, out: Path, *extra: str) -> int:
    return main(["data", "import", "--log", str(log), "--items", str(items), "--out", str(out), "--kcore", "2",
                 *extra])


def by_external_ids(out: Path, users: tuple[str, ...] = ("u1", "u2", "u3", "u4")) -> dict[str, dict[str, list[str]]]:
    """The split with external ids; ``users``: the kept users (numbered in the ascending order of their ids)."""
    data = load_split_dir(out)
    asin = {iid: meta.asin for iid, meta in data.items.items()}
    return {split: {users[u - 1]: [asin[i] for i in seq] for u, seq in getattr(data, split).items()}
            for split in ("train", "valid", "test")}


def test_csv_round_trip_leave_last_out(tmp_path, capsys):
    log, items = csv_inputs(tmp_path)
    assert run_import(log, items, tmp_path / "out", "--split", "leave-last-out") == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)
    assert by_external_ids(tmp_path / "out") == EXPECTED
    assert stats["log"] == {"rows": 16, "below_min_rating": 0, "duplicates": 1, "unknown_item_rows": 1,
                            "unknown_items": 1, "after_dedupe": 14, "after_kcore": 14}
    assert (stats["users"], stats["items"], stats["dropped_users"], stats["dropped_interactions"]) == (3, 4, 1, 2)
    assert "1 rows dropped for 1 items missing from the item table" in captured.err
    data = load_split_dir(tmp_path / "out")
    metas = {m.asin: m for m in data.items.values()}
    assert set(metas) == {"A", "B", "C", "D"}  # E: nobody bought it
    assert metas["A"].text() == "Title: Alpha Soap; Brand: Acme; Categories: Beauty, Bath"
    assert metas["C"].brand is None and metas["D"].categories == ()


def test_time_split_is_prepare_amazons_and_all_items_keeps_the_catalog(tmp_path, capsys):
    log, items = csv_inputs(tmp_path)
    assert run_import(log, items, tmp_path / "out", "--split", "8:1:1", "--all-items") == 0
    stats = json.loads(capsys.readouterr().out)
    # 14 events by global time: the first 11 (14*8//10) train, then u1 D (Jan 4) valid, u2 D (Jan 5) and u3 C
    # (Jan 6) test; u4 keeps its 2 train items
    got = by_external_ids(tmp_path / "out")
    assert stats["interactions"] == {"train": 11, "valid": 1, "test": 2, "total": 14}
    assert got["valid"] == {"u1": ["D"], "u2": [], "u3": [], "u4": []}
    assert got["test"] == {"u1": [], "u2": ["D"], "u3": ["C"], "u4": []}
    assert stats["items"] == 5 and stats["items_without_interactions"] == 1  # E joins as a fresh item


@pytest.mark.parametrize("times", ["text", "ms", "timestamp"])
def test_parquet_gives_the_csv_split(tmp_path, times, capsys):
    log, items = csv_inputs(tmp_path)
    assert run_import(log, items, tmp_path / "csv", "--split", "leave-last-out") == 0
    plog, pitems = parquet_inputs(tmp_path, times)
    assert run_import(plog, pitems, tmp_path / "parquet", "--split", "leave-last-out") == 0
    capsys.readouterr()
    for name in [split_file(s) for s in ("train", "valid", "test")] + ["items.json"]:
        assert (tmp_path / "csv" / name).read_text() == (tmp_path / "parquet" / name).read_text(), name


def test_configurable_columns_and_min_rating(tmp_path, capsys):
    rows = [(u, i, t, 2 if (u, i) == ("u1", "D") else 5) for u, i, t in LOG]
    log = write_csv(tmp_path / "events.csv", ["uid", "sku", "ts", "stars"], rows)
    items = write_csv(tmp_path / "catalog.csv", ["sku", "name"], [(i, t) for i, t, _, _ in ITEMS])
    args = ("--columns", "user=uid,item=sku,time=ts,rating=stars", "--item-columns", "id=sku,title=name",
            "--split", "leave-last-out")
    assert run_import(log, items, tmp_path / "out", *args, "--min-rating", "4") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["log"]["below_min_rating"] == 1
    # u1's D (2 stars) is gone, which leaves u1 3 items: too few for leave-last-out, like u4
    assert stats["dropped_users"] == 2
    assert by_external_ids(tmp_path / "out", ("u2", "u3")) == {
        split: {u: seq for u, seq in part.items() if u != "u1"} for split, part in EXPECTED.items()}
    assert run_import(log, items, tmp_path / "out2", "--split", "leave-last-out") == 2  # default names absent
    assert "catalog.csv: no column 'item_id'" in capsys.readouterr().err


def bad(tmp: Path, rows: list[tuple], header: tuple = ("user_id", "item_id", "timestamp")) -> Path:
    return write_csv(tmp / "bad_log.csv", list(header), rows)


@pytest.mark.parametrize("case", ["missing-column", "bad-time", "empty-user", "bad-rating", "unknown-item",
                                  "duplicate-item", "missing-title-column", "ragged-row"])
def test_bad_input_exits_2_naming_the_row_and_column(tmp_path, capsys, case):
    log, items = csv_inputs(tmp_path)
    extra: list[str] = []
    if case == "missing-column":
        log = bad(tmp_path, [("u1", "A")], header=("user_id", "item_id"))
        expected = ["bad_log.csv", "no column 'timestamp'", "--columns time=NAME"]
    elif case == "bad-time":
        log = bad(tmp_path, [("u1", "A", "2024-01-01"), ("u1", "B", "2024-13-01")])
        expected = ["bad_log.csv row 2 (line 3), column 'timestamp': cannot read '2024-13-01' as a time"]
    elif case == "empty-user":
        log = bad(tmp_path, [("u1", "A", "1"), ("", "B", "2")])
        expected = ["bad_log.csv row 2 (line 3), column 'user_id': empty user id"]
    elif case == "bad-rating":
        log = bad(tmp_path, [("u1", "A", "1", "5"), ("u1", "B", "2", "five")],
                  header=("user_id", "item_id", "timestamp", "rating"))
        expected = ["bad_log.csv row 2 (line 3), column 'rating': rating 'five' is not a number"]
    elif case == "unknown-item":
        extra = ["--missing-items", "error"]
        expected = ["log.csv row 5 (line 6), column 'item_id': item 'X' is not in the item table"]
    elif case == "duplicate-item":
        items = write_csv(tmp_path / "dup_items.csv", ["item_id", "title"], [("A", "a"), ("B", "b"), ("A", "c")])
        expected = ["dup_items.csv row 3 (line 4), column 'item_id': duplicate item id 'A' (first at row 1)"]
    elif case == "missing-title-column":
        items = write_csv(tmp_path / "no_title.csv", ["item_id", "name"], [("A", "a")])
        expected = ["no_title.csv", "no column 'title'", "--item-columns title=NAME"]
    else:
        log.write_text(log.read_text() + "u9,A\n")
        expected = ["log.csv row 17 (line 18): 2 fields, the header has 3"]
    assert run_import(log, items, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for text in expected:
        assert text in err, (text, err)


def test_bad_parquet_rows_are_named(tmp_path, capsys):
    _, items = parquet_inputs(tmp_path, "text")
    log = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"user_id": ["u1", "u1", "u1"], "item_id": ["A", "B", "C"],
                             "timestamp": ["2024-01-01", "2024-01-02", "soon"]}), log)
    assert run_import(log, items, tmp_path / "out") == 2
    assert "error: bad.parquet row 3, column 'timestamp': cannot read 'soon' as a time" in capsys.readouterr().err
    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"item_id": [1, 2, 1], "title": ["a", "b", "c"]}), dup)
    assert run_import(log, dup, tmp_path / "out") == 2
    assert "dup.parquet row 3, column 'item_id': duplicate item id '1' (first at row 1)" in capsys.readouterr().err


def test_synth_log_imports_the_same_from_csv_and_parquet(tmp_path, capsys):
    assert main(["data", "synth-log", "--out", str(tmp_path / "raw"), "--interactions", "3000", "--items", "150",
                 "--seed", "3"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["interactions"] == 3000
    for kind in ("csv", "parquet"):
        assert main(["data", "import", "--log", str(tmp_path / "raw" / f"interactions.{kind}"),
                     "--items", str(tmp_path / "raw" / f"items.{kind}"), "--out", str(tmp_path / kind)]) == 0
    capsys.readouterr()
    for name in [split_file(s) for s in ("train", "valid", "test")] + ["items.json"]:
        assert (tmp_path / "csv" / name).read_text() == (tmp_path / "parquet" / name).read_text(), name
    data = load_split_dir(tmp_path / "csv")
    assert data.num_users > 150 and all(m.title and m.brand and m.categories for m in data.items.values())
    assert len(data.eval_users("test")) > 0 and len(data.eval_users("valid")) > 0


def test_leave_last_out_keeps_time_order_with_ties_by_item():
    split = split_leave_last_out([(1, "u", "b"), (1, "u", "a"), (0, "u", "z"), (2, "u", "c")], min_train=2)
    assert (split.train, split.valid, split.test) == ({"u": ["z", "a"]}, {"u": ["b"]}, {"u": ["c"]})
