"""`recsvc build` and `recsvc train target` end to end on a small synthetic data set (tiny preset)."""

from __future__ import annotations

import json

import pytest
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from recsvc.model.bundle import Bundle
from recsvc.model.prompt import PromptBuilder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """The real entry point, limited to the groups under test (others may be mid-edit)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"train": "training.cli", "build": "training.build_cli"})


def main(argv: list[str]) -> int:
    return cli.main(argv)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    d = make_data(root, n_users=40)
    return d, write_ids(d, root / "ids.json")


def test_build_then_skip_then_train_errors(data, tmp_path, capsys) -> None:
    d, ids = data
    out = tmp_path / "bundle"
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny",
            "--epochs", "1", "--batch-size", "8", "--eval-users", "10", "--bf16", "off"]
    assert main(argv) == 0
    b = Bundle.open(out)
    assert all(b.is_done(s) for s in ("ids", "tokenizer", "target"))
    meta = b.read()
    assert meta["target_preset"] == "tiny" and meta["stages"]["target"]["best"]["metric"] == "recall@10"
    model = b.load_target(dtype="fp32")
    tok = b.load_tokenizer()
    assert model.config.vocab_size == len(tok)
    builder = PromptBuilder(tok, b.load_ids())
    assert len(builder.prompt_ids([1, 2, 3])) < 60
    history = json.loads((b.target_dir / "training.json").read_text())["history"]
    assert len(history) == 1 and "valid_loss" in history[0]

    capsys.readouterr()
    assert main(argv) == 0  # everything done: skipped
    assert capsys.readouterr().out.count("done earlier, skipped") == 3

    # a checkpoint exists: train needs --resume or --force
    assert main(["train", "target", "--data", str(d), "--bundle", str(out), "--preset", "tiny"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_user_errors(data, tmp_path, capsys) -> None:
    d, ids = data
    assert main(["train", "target", "--data", str(tmp_path / "nope"), "--bundle", str(tmp_path)]) == 2
    assert "data directory not found" in capsys.readouterr().err
    assert main(["train", "target", "--data", str(d), "--bundle", str(tmp_path / "b"), "--lora"]) == 2
    assert "--lora needs --base-model" in capsys.readouterr().err
    assert main(["train", "target", "--data", str(d), "--bundle", str(tmp_path / "c"), "--preset", "tiny"]) == 2
    assert "no semantic ids" in capsys.readouterr().err
    assert main(["build", "--data", str(d), "--out", str(tmp_path / "d"), "--stages", "ids,rocket"]) == 2
    assert "unknown stage" in capsys.readouterr().err
