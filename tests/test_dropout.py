"""Training dropout (`--dropout P`): where it acts, that it acts only in train mode and leaves no trace, and
`recsvc build --dropout` end to end (recorded, bad rates exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from cli_commands import only_commands
from test_train_fixtures import one_thread, small_tokenizer, tiny_build_argv  # noqa: F401

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.bundle.presets import get_preset, new_model
from recsvc.errors import UserError
from training.target_lm.dropout import TrainingDropout


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "build")


def _model_and_batch():
    tok = small_tokenizer()
    model = new_model(get_preset("tiny"), tok, seed=0)
    ids = torch.randint(3, len(tok), (4, 12), generator=torch.Generator().manual_seed(1))  # [B, T]
    return model, ids


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_dropout_acts_in_train_mode_only_and_leaves_no_hooks() -> None:
    model, ids = _model_and_batch()
    plain_train = model.train()(input_ids=ids).logits
    plain_eval = model.eval()(input_ids=ids).logits
    layers = len(model.model.layers)
    with TrainingDropout.attach(model, 0.3) as drop:
        assert len(drop.handles) == _hooks(model) == 1 + 2 * layers  # embeddings, each attention and MLP output
        assert torch.equal(model.eval()(input_ids=ids).logits, plain_eval)
        torch.manual_seed(5)
        a = model.train()(input_ids=ids).logits
        torch.manual_seed(5)
        b = model(input_ids=ids).logits
        assert torch.equal(a, b) and not torch.allclose(a, plain_train, atol=1e-3)
    assert _hooks(model) == 0 and torch.equal(model.train()(input_ids=ids).logits, plain_train)


def test_dropout_zeroes_a_share_p_and_scales_the_rest() -> None:
    model, ids = _model_and_batch()
    seen: list[torch.Tensor] = []
    clean = model.model.embed_tokens(ids)  # [B, T, H]
    with TrainingDropout.attach(model, 0.5):
        handle = model.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(out))  # after ours
        model.train()(input_ids=ids)
        handle.remove()
    dropped = seen[0]
    kept = dropped != 0
    assert 0.4 < 1 - kept.float().mean().item() < 0.6
    assert torch.allclose(dropped[kept], 2 * clean[kept])


def test_zero_rate_attaches_nothing_and_bad_rates_are_user_errors() -> None:
    model, _ = _model_and_batch()
    assert TrainingDropout.attach(model, 0.0).handles == [] and _hooks(model) == 0
    for p in (-0.1, 1.0):
        with pytest.raises(UserError, match="--dropout"):
            TrainingDropout.attach(model, p)


@pytest.mark.usefixtures("one_thread")
def test_build_with_dropout_records_it_and_bad_rates_exit_2(tmp_path) -> None:
    argv, out = tiny_build_argv(tmp_path)
    assert cli.main([*argv, "--dropout", "1"]) == 2
    assert cli.main([*argv, "--dropout", "-0.2"]) == 2
    assert cli.main([*argv, "--dropout", "0.2", "--dense-head", "1.0"]) == 0
    info = json.loads((Bundle.open(out).target_dir / "training.json").read_text())
    assert info["config"]["dropout"] == 0.2 and info["refit"]["mode"] == "scratch"
