"""training.data.synth: the synthetic catalog (`recsvc data synth`): determinism, format, learnable structure."""

from __future__ import annotations

import json
import re
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsvc.cli.main import main
from recsvc.data.split import SplitData, load_split_dir
from recsvc.errors import UserError
from training.data.synth import SynthConfig, write_synth

FILES = ("sequential_train.txt", "sequential_valid.txt", "sequential_test.txt", "items.json", "stats.json")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("synth") / "demo"
    start = time.perf_counter()
    write_synth(out, SynthConfig(n_items=300, n_users=600, seed=0))
    return out, time.perf_counter() - start


def test_demo_size_is_fast_and_loads(demo: tuple[Path, float]) -> None:
    out, elapsed = demo
    assert elapsed < 2.0, f"synth took {elapsed:.2f}s"
    data = load_split_dir(out)
    stats = json.loads((out / "stats.json").read_text())
    assert data.num_items == 300 and sorted(data.items) == list(range(1, 301))
    assert len(data.train) == stats["users"] and 550 <= stats["users"] <= 600
    assert sorted(data.train) == list(range(1, len(data.train) + 1))
    assert all(len(seq) >= 2 for seq in data.train.values())
    total = sum(stats["interactions"].values())
    assert stats["interactions"]["train"] / total > 0.75  # ~8:1:1 minus dropped users
    assert len(data.eval_users("valid")) > 100 and len(data.eval_users("test")) > 100
    for user in data.train:  # no item repeats in a user's history
        full = data.train[user] + data.valid[user] + data.test[user]
        assert 5 <= len(full) <= 20 and len(set(full)) == len(full)


def test_item_metadata(demo: tuple[Path, float]) -> None:
    data = load_split_dir(demo[0])
    for meta in data.items.values():
        assert meta.title and meta.brand and len(meta.categories) == 3 and meta.categories[0] == "Beauty"
        leaf = meta.categories[2]
        assert re.fullmatch(rf"[\w ]+ {re.escape(leaf)} by {re.escape(meta.brand)}, [\w. ]+", meta.title)
        assert meta.text().startswith(f"Title: {meta.title}; Brand: {meta.brand}; Categories: Beauty, ")
    assert len({m.categories[2] for m in data.items.values()}) >= 15


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    cfg = SynthConfig(n_items=80, n_users=100, seed=42)
    write_synth(tmp_path / "a", cfg)
    write_synth(tmp_path / "b", cfg)
    write_synth(tmp_path / "c", SynthConfig(n_items=80, n_users=100, seed=43))
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "sequential_train.txt").read_bytes() != (tmp_path / "c" / "sequential_train.txt"
                                                                       ).read_bytes()


def _recall_at_10(data: SplitData, predict) -> float:  # noqa: ANN001
    users = data.eval_users("valid")
    hits = 0.0
    for ev in users:
        top = predict(ev.history)[:10]
        hits += len(set(top) & set(ev.targets)) / len(ev.targets)
    return hits / len(users)


def test_sequence_structure_beats_popularity(demo: tuple[Path, float]) -> None:
    """A bigram (last item -> next item) count model must clearly beat popularity on the valid period."""
    data = load_split_dir(demo[0])
    pop = [i for i, _ in Counter(data.item_popularity("valid")).most_common()]
    follows: dict[int, Counter[int]] = defaultdict(Counter)
    for seq in data.train.values():
        for a, b in zip(seq, seq[1:], strict=False):
            follows[a][b] += 1

    def popularity(history: list[int]) -> list[int]:
        return [i for i in pop if i not in history]

    def bigram(history: list[int]) -> list[int]:
        ranked = [i for i, _ in follows[history[-1]].most_common() if i not in history]
        return ranked + [i for i in popularity(history) if i not in ranked]

    pop_recall, bigram_recall = _recall_at_10(data, popularity), _recall_at_10(data, bigram)
    assert bigram_recall > 2 * pop_recall and bigram_recall > 0.2, (bigram_recall, pop_recall)


@settings(max_examples=30, deadline=None)
@given(n_items=st.integers(2, 40), n_users=st.integers(1, 25), min_len=st.integers(2, 8),
       extra=st.integers(0, 6), seed=st.integers(0, 2**32))
def test_any_small_config_writes_valid_data_or_a_user_error(
    tmp_path_factory: pytest.TempPathFactory, n_items: int, n_users: int, min_len: int, extra: int, seed: int
) -> None:
    out = tmp_path_factory.mktemp("hyp") / "d"
    cfg = SynthConfig(n_items=n_items, n_users=n_users, seed=seed, min_len=min_len, max_len=min_len + extra)
    try:
        stats = write_synth(out, cfg)
    except UserError as exc:
        assert cfg.max_len > n_items or "no synthetic user" in str(exc)
        return
    data = load_split_dir(out)
    assert data.num_items == n_items and len(data.train) == stats["users"] <= n_users
    assert all(len(s) >= 2 for s in data.train.values())


# ------------------------------------------------------------------------------------------ CLI


def test_cli_synth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    assert main(["data", "synth", "--out", str(out), "--items", "50", "--users", "40", "--seed", "3",
                 "--min-len", "4", "--max-len", "8"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["items"] == 50 and stats["params"]["seed"] == 3
    assert main(["data", "stats", "--data", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["interactions"] == stats["interactions"]


def test_cli_synth_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "d")
    assert main(["data", "synth", "--out", out, "--min-len", "10", "--max-len", "5"]) == 2
    assert "error: need 2 <= --min-len <= --max-len" in capsys.readouterr().err
    assert main(["data", "synth", "--out", out, "--items", "10", "--max-len", "20"]) == 2
    assert "cannot exceed --items" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["data", "synth", "--out", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err
    for flag, value in (("--items", "0"), ("--users", "many"), ("--split", "1:1")):
        with pytest.raises(SystemExit) as exc:
            main(["data", "synth", "--out", out, flag, value])
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err
