"""Training the item-level target: its windows, the loss's pairing of h_t with item t+1 (no leakage, padding inert),
and `recsvc train items` end to end (files, the epoch chosen on valid, resume, bad flags)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from test_timeline_search import tiny_catalog, tiny_model
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401

import recsvc.cli.main as cli
from recsvc.timeline.model import TimelineModel
from training.item_target.examples import collate, crop, epoch_batches, windows
from training.item_target.train import batch_loss


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out + err


def test_windows_train_every_transition_once():
    trie = tiny_catalog(n=40, seed=0)
    items = trie.ids.item_ids.tolist()
    seq = items[:23]
    parts = windows({7: seq, 8: items[:1]}, trie.ids, max_items=5)  # user 8's one item: no transition
    rows = [trie.ids.index_of(i) for i in seq]
    pairs = [(int(p[t]), int(p[t + 1])) for p in parts for t in range(len(p) - 1)]
    assert sorted(pairs) == sorted(zip(rows[:-1], rows[1:], strict=True))
    assert all(2 <= len(p) <= 6 for p in parts)
    assert parts[0].tolist() == rows[-6:]  # cut from the end: the newest window is whole


def test_crop_is_a_contiguous_part_of_at_least_two():
    rng = random.Random(0)
    w = np.arange(10)
    for _ in range(50):
        c = crop(w, rng)
        assert len(c) >= 2 and c.tolist() == list(range(int(c[0]), int(c[0]) + len(c)))


def test_loss_pairs_each_state_with_the_next_item_and_ignores_padding():
    trie = tiny_catalog(n=40, seed=1)
    model = tiny_model(trie, 1)
    codes = torch.from_numpy(trie.ids.codes)
    parts = [np.array([3, 9, 1, 7, 20]), np.array([5, 2])]  # catalog rows; the second is right-padded
    batch = collate(parts, codes)
    loss = batch_loss(model, batch)
    terms = []
    for p in parts:  # by hand: h_t (items 0..t) scored on item t+1's path, one window at a time
        h = model.states(codes[torch.from_numpy(p[:-1])][None])[0]
        terms.append(model.path_logprobs(h, codes[torch.from_numpy(p[1:])]))
    by_hand = -torch.cat(terms).sum() / (sum(len(p) - 1 for p in parts) * trie.levels)
    assert torch.allclose(loss, by_hand, atol=1e-5)


def test_epoch_batches_cover_every_window_and_are_seeded():
    codes = torch.zeros(30, 3, dtype=torch.long)
    parts = [np.arange(i % 7 + 2) for i in range(50)]
    a = epoch_batches(parts, 8, seed=3, crop_rate=0.0, codes=codes)
    b = epoch_batches(parts, 8, seed=3, crop_rate=0.0, codes=codes)
    assert sum(x.codes.shape[0] for x in a) == 50
    assert all(torch.equal(x.rows, y.rows) for x, y in zip(a, b, strict=True))
    cropped = epoch_batches(parts, 8, seed=3, crop_rate=1.0, codes=codes)
    assert sum(int((x.targets[..., 0] >= 0).sum()) for x in cropped) < sum(
        int((x.targets[..., 0] >= 0).sum()) for x in a)


@pytest.mark.usefixtures("one_thread")
def test_train_items_end_to_end(tmp_path, capsys):
    data = make_data(tmp_path, n_users=60)
    ids = write_ids(data, tmp_path / "ids.json")
    out = tmp_path / "items"
    argv = ["train", "items", "--data", str(data), "--ids", str(ids), "--out", str(out), "--epochs", "3",
            "--hidden", "16", "--heads", "2", "--batch-size", "16", "--bf16", "off", "--threads", "1",
            "--patience", "0"]
    code, text = run_cli(argv, capsys)
    assert code == 0, text
    record = json.loads((out / "training.json").read_text())
    assert [e["epoch"] for e in record["epochs"]] == [1, 2, 3]
    best = max(record["epochs"], key=lambda e: e["valid"]["ndcg@10"])
    assert record["chosen_epoch"] == best["epoch"]
    assert record["epochs"][-1]["loss"] < record["epochs"][0]["loss"]
    model = TimelineModel.load(out)
    assert model.config.hidden == 16 and not model.training
    code, text = run_cli(argv, capsys)  # a re-run resumes from the checkpoint: nothing left to train
    assert code == 0 and json.loads((out / "training.json").read_text())["epochs"] == record["epochs"]


def test_train_items_bad_flags_exit_2(tmp_path, capsys):
    data = make_data(tmp_path, n_users=10)
    ids = write_ids(data, tmp_path / "ids.json")
    base = ["train", "items", "--data", str(data), "--ids", str(ids), "--out", str(tmp_path / "o")]
    for extra, message in ((["--dropout", "1"], "--dropout"), (["--hidden", "30", "--heads", "4"], "multiple"),
                           (["--epochs", "0"], "--epochs")):
        code, text = run_cli(base + extra, capsys)
        assert code == 2 and message in text and "Traceback" not in text
    missing = ["train", "items", "--data", str(data), "--ids", str(tmp_path / "none.json"), "--out", "x"]
    code, text = run_cli(missing, capsys)
    assert code == 2 and "semantic ids not found" in text
