"""recsvc.data.split: the split format loader, the evaluation protocol, format errors, the real Beauty split."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsvc.cli.main import main
from recsvc.data.split import EvalUser, ItemMeta, load_split_dir, split_stats, write_split_dir
from recsvc.errors import UserError


def beauty_dir() -> Path | None:
    """The Amazon Beauty split directory when RECSVC_BEAUTY_DIR names one (the real-data check), else None."""
    env = os.environ.get("RECSVC_BEAUTY_DIR")
    return Path(env) if env else None


def write_dir(root: Path, train: str, valid: str, test: str, items: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "sequential_train.txt").write_text(train)
    (root / "sequential_valid.txt").write_text(valid)
    (root / "sequential_test.txt").write_text(test)
    (root / "items.json").write_text(items if isinstance(items, str) else json.dumps(items))
    return root


ITEMS = {
    "1": {"asin": "A1", "title": "Rose Soap"},
    "2": {"asin": "A2", "title": None},
    "3": {"asin": "A3", "title": "Mascara", "brand": "Acme", "categories": ["Beauty", "Makeup"],
          "description": ["Long", "lasting."]},
    "4": {"asin": "A4"},
    "5": {"asin": "A5", "title": "Serum"},
}


@pytest.fixture
def small(tmp_path: Path) -> Path:
    # user 1: valid + test items; user 2: nothing after train; user 3: test only; user 4 missing in valid/test
    return write_dir(
        tmp_path / "d",
        train="1 1 2 3\n2 2 3\n3 5 4\n4 1 5\n",
        valid="1 4\n2\n3\n",
        test="1 5 1\n2\n3 2\n",
        items=ITEMS,
    )


def test_loads_small_dir(small: Path) -> None:
    data = load_split_dir(small)
    assert data.root == small
    assert data.train == {1: [1, 2, 3], 2: [2, 3], 3: [5, 4], 4: [1, 5]}
    assert data.valid == {1: [4], 2: [], 3: [], 4: []}  # a user without a line gets []
    assert data.test == {1: [5, 1], 2: [], 3: [2], 4: []}
    assert data.num_items == 5
    assert data.items[3] == ItemMeta(asin="A3", title="Mascara", brand="Acme", categories=("Beauty", "Makeup"),
                                     description="Long lasting.")
    assert data.items[2] == ItemMeta(asin="A2")


def test_eval_protocol(small: Path) -> None:
    data = load_split_dir(small)
    assert data.eval_users("valid") == [EvalUser(1, [1, 2, 3], [4])]
    assert data.eval_users("test") == [EvalUser(1, [1, 2, 3, 4], [5, 1]), EvalUser(3, [5, 4], [2])]
    # history lists are copies: mutating one must not change the data
    data.eval_users("test")[0].history.append(99)
    assert data.train[1] == [1, 2, 3]


def test_item_popularity_sees_only_the_past(small: Path) -> None:
    data = load_split_dir(small)
    assert data.item_popularity("valid") == {1: 2, 2: 2, 3: 2, 5: 2, 4: 1}
    assert data.item_popularity("test") == {1: 2, 2: 2, 3: 2, 5: 2, 4: 2}


@pytest.mark.parametrize("split", ["train", "TEST", ""])
def test_unknown_split_is_user_error(small: Path, split: str) -> None:
    data = load_split_dir(small)
    with pytest.raises(UserError, match="unknown split"):
        data.eval_users(split)
    with pytest.raises(UserError, match="unknown split"):
        data.item_popularity(split)


def test_item_text() -> None:
    meta = ItemMeta(asin="B1", title="Rose  Soap", brand="Acme", categories=("Beauty", "Bath"),
                    description="Gentle soap.")
    assert meta.text() == "Title: Rose Soap; Brand: Acme; Categories: Beauty, Bath; Description: Gentle soap."
    assert ItemMeta(asin="B1", brand="Acme").text() == "Brand: Acme"
    assert ItemMeta(asin="B1").text() == "item B1"
    assert ItemMeta().text() == "unknown item"
    long = ItemMeta(title="T", description="word " * 200).text()
    desc = long.split("Description: ")[1]
    assert desc.endswith("...") and len(desc) <= 303


# ------------------------------------------------------------------------------------------ errors


def test_missing_dir_and_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data directory not found"):
        load_split_dir(tmp_path / "nope")
    root = write_dir(tmp_path / "d", "1 1\n", "1\n", "1\n", ITEMS)
    (root / "sequential_test.txt").unlink()
    with pytest.raises(UserError, match="sequential_test.txt"):
        load_split_dir(root)
    (root / "items.json").unlink()
    with pytest.raises(UserError, match="items.json"):
        load_split_dir(root)


@pytest.mark.parametrize(
    ("train", "valid", "message"),
    [
        ("1 1 2\n2 3 x4\n", "", r"sequential_train.txt line 2: not an integer: 'x4'"),
        ("1 1 2\n\n2 3 9\n", "", r"sequential_train.txt line 3: item 9 is not in items.json"),
        ("1 1 2\n", "1\n1 3\n", r"sequential_valid.txt line 2: user 1 appears twice"),
        ("1 1 2\n", "7 3\n", r"sequential_valid.txt: user 7 has no line in sequential_train.txt"),
        ("0 1 2\n", "", r"sequential_train.txt line 1: user id must be >= 1"),
        ("1 1 2.5\n", "", r"sequential_train.txt line 1: not an integer: '2.5'"),
    ],
)
def test_bad_sequence_files(tmp_path: Path, train: str, valid: str, message: str) -> None:
    root = write_dir(tmp_path / "d", train, valid, "", ITEMS)
    with pytest.raises(UserError, match=message):
        load_split_dir(root)


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ('{"1": {"asin": "A"},\n "2": {oops}}', r"items.json line 2 column \d+: invalid JSON"),
        ('[{"asin": "A"}]', r"items.json: expected a JSON object"),
        ('{"one": {"asin": "A"}}', r"items.json: item key 'one' is not an integer id"),
        ('{"1": "A"}', r"items.json: item 1: expected an object"),
        ('{"1": {"title": {"x": 1}}}', r"items.json: item 1: field 'title' must be a string"),
        ('{"1": {"categories": [1, 2]}}', r"items.json: item 1: field 'categories'"),
    ],
)
def test_bad_items_json(tmp_path: Path, items: str, message: str) -> None:
    root = write_dir(tmp_path / "d", "1 1\n", "", "", items)
    with pytest.raises(UserError, match=message):
        load_split_dir(root)


# ------------------------------------------------------------------------------------------ round trip

seqs = st.lists(st.integers(1, 8), max_size=6)


@settings(max_examples=40, deadline=None)
@given(users=st.dictionaries(st.integers(1, 30), st.tuples(seqs, seqs, seqs), min_size=1, max_size=8))
def test_write_then_load_round_trip(tmp_path_factory: pytest.TempPathFactory,
                                    users: dict[int, tuple[list[int], list[int], list[int]]]) -> None:
    root = tmp_path_factory.mktemp("rt")
    items = {i: ItemMeta(asin=f"A{i}", title=f"t{i}" if i % 2 else None, categories=("c",) * (i % 3))
             for i in range(1, 9)}
    train, valid, test = ({u: parts[k] for u, parts in users.items()} for k in range(3))
    write_split_dir(root, train, valid, test, items)
    data = load_split_dir(root)
    assert (data.train, data.valid, data.test, data.items) == (train, valid, test, items)
    lines = (root / "sequential_valid.txt").read_text().splitlines()
    assert [int(line.split()[0]) for line in lines] == sorted(users)  # every user, ascending
    for ev in data.eval_users("test"):
        assert ev.history == train[ev.user_id] + valid[ev.user_id] and ev.targets == test[ev.user_id]


# ------------------------------------------------------------------------------------------ CLI


def test_cli_stats(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "stats", "--data", str(small)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["users"] == 4 and stats["items"] == 5
    assert stats["interactions"] == {"train": 9, "valid": 1, "test": 3}
    assert stats["users_with_items"] == {"train": 4, "valid": 1, "test": 2}


def test_cli_stats_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "stats", "--data", str(tmp_path / "missing")]) == 2
    assert "error: data directory not found" in capsys.readouterr().err
    root = write_dir(tmp_path / "d", "1 1\n2 1 zz\n", "", "", ITEMS)
    assert main(["data", "stats", "--data", str(root)]) == 2
    assert "error: sequential_train.txt line 2: not an integer: 'zz'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["data", "stats"])  # --data is required
    assert exc.value.code == 2
    assert "--data" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ real data


@pytest.mark.skipif(beauty_dir() is None, reason="set RECSVC_BEAUTY_DIR to the Amazon Beauty split directory to "
                                                  "check its counts (the synthetic splits above check the loader)")
def test_real_beauty_counts() -> None:
    path = beauty_dir()
    assert path is not None
    start = time.perf_counter()
    data = load_split_dir(path)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"loading took {elapsed:.2f}s"
    stats = split_stats(data)
    assert stats["users"] == 19_383 and data.num_items == 12_035
    assert stats["interactions"] == {"train": 122_241, "valid": 9_316, "test": 7_313}
    assert stats["users_with_items"]["valid"] == 4_295 and stats["users_with_items"]["test"] == 3_553
    assert stats["items_without_title"] == 7
    valid_users, test_users = data.eval_users("valid"), data.eval_users("test")
    assert len(valid_users) == 4_295 and len(test_users) == 3_553
    assert sum(len(u.targets) for u in test_users) == 7_313
    user = test_users[0]
    assert user.history == data.train[user.user_id] + data.valid[user.user_id]
    assert sum(data.item_popularity("valid").values()) == 122_241
    assert sum(data.item_popularity("test").values()) == 122_241 + 9_316
    assert data.items[1].asin == "B000P1S0NI"
