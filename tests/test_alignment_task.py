"""LC-Rec's item-index alignment task (text -> id): the examples, and `recsvc build --align text2id` end to end."""

from __future__ import annotations

import json

import pytest
from cli_commands import only_commands
from test_train_fixtures import N_ITEMS, make_data, one_thread, random_ids, small_tokenizer  # noqa: F401

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.bundle.prompt import IGNORE_INDEX, PromptBuilder
from recsvc.data.split import load_split_dir
from recsvc.errors import UserError
from training.target_lm.sequences import ALIGN_MODES, ALIGN_TEXT_TOKENS, alignment_examples

TOK = small_tokenizer()
TEXTS = {
    1000: "Lavender Lipstick",
    2: "Lavender Shampoo by Acme, 12 oz",
    40: "Title: Rose Soap; Brand: Acme; Categories: Beauty, Bath",  # 47 tokens: longer than ALIGN_TEXT_TOKENS
    17: "Ruby Red Lipstick by Kirra, 0.1 oz",
    99: "Ruby Shampoo by Kirra",  # a text but no semantic id
}
IDS = random_ids([2, 9, 17, 40, 1000], seed=3)  # item 9: a semantic id but no text


def _enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("header", ["lcrec", "compact", "packed"])
def test_alignment_examples_label_the_codes_after_the_text(header) -> None:
    builder = PromptBuilder(TOK, IDS, header=header)
    ex = alignment_examples(builder, TEXTS, [1000, 99, 40, 2, 9, 17, 40])  # unordered, repeated; 9, 99 skipped
    assert len(ex) == 4
    sep = builder.sep_ids or _enc("\n")  # packed: no SEP in rec prompts, a newline still ends the text
    assert sep
    for e, item in zip(ex, [2, 17, 40, 1000], strict=True):  # ordered by item id
        codes = builder.item_token_ids(item)
        assert len(codes) == 4
        assert e.input_ids == builder.header_ids + _enc(TEXTS[item])[:ALIGN_TEXT_TOKENS] + sep + codes
        assert e.labels[-4:] == codes
        assert e.labels[:-4] == [IGNORE_INDEX] * (len(e) - 4)
        assert len(e.labels) == len(e.input_ids)
        assert not set(e.input_ids[:-4]) & set(codes)  # no code token in the prompt part


def test_alignment_examples_truncate_the_text() -> None:
    builder = PromptBuilder(TOK, IDS)
    full = _enc(TEXTS[40])
    assert len(full) > ALIGN_TEXT_TOKENS > 5
    (ex,) = alignment_examples(builder, TEXTS, [40], max_text_tokens=5)
    assert ex.input_ids == builder.header_ids + full[:5] + builder.sep_ids + builder.item_token_ids(40)
    assert ex.labels == [IGNORE_INDEX] * (len(ex) - 4) + builder.item_token_ids(40)
    (default,) = alignment_examples(builder, TEXTS, [40])  # the default cap: ALIGN_TEXT_TOKENS text tokens
    assert default.input_ids[len(builder.header_ids):-4 - len(builder.sep_ids)] == full[:ALIGN_TEXT_TOKENS]
    (whole,) = alignment_examples(builder, TEXTS, [40], max_text_tokens=len(full))
    assert whole.input_ids[len(builder.header_ids):-4 - len(builder.sep_ids)] == full
    (short,) = alignment_examples(builder, TEXTS, [2], max_text_tokens=5)  # each item's text is cut alone
    assert short.input_ids == builder.header_ids + _enc(TEXTS[2])[:5] + builder.sep_ids + builder.item_token_ids(2)
    assert alignment_examples(builder, TEXTS, []) == []
    assert alignment_examples(builder, {}, [2, 17, 40]) == []  # no texts: nothing to align
    assert alignment_examples(builder, TEXTS, [9, 99]) == []  # no text / no id


def test_train_target_rejects_an_unknown_align_mode(tmp_path) -> None:
    from training.target_lm.train import train_target

    assert ALIGN_MODES == ("none", "text2id")
    with pytest.raises(UserError, match="align must be one of none, text2id"):
        train_target(tmp_path / "no-data", tmp_path / "bundle", preset="tiny", align="bogus")
    assert not (tmp_path / "bundle").exists()  # refused before anything was created


# --- `recsvc build --align text2id` end to end --------------------------------------------------------------

EXTRA_WITH_IDS = [N_ITEMS + 1, N_ITEMS + 2, N_ITEMS + 3]  # catalog items nobody interacted with, with ids
EXTRA_WITHOUT_IDS = [N_ITEMS + 4, N_ITEMS + 5]  # ... and without (no alignment example)


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """The real entry point, limited to the groups under test (others may be mid-edit)."""
    only_commands(monkeypatch, "train", "build")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The synthetic data set, its catalog grown by items nobody bought (some without a semantic id)."""
    root = tmp_path_factory.mktemp("align")
    d = make_data(root, n_users=40)
    items = json.loads((d / "items.json").read_text())
    for i in EXTRA_WITH_IDS + EXTRA_WITHOUT_IDS:
        items[str(i)] = {"asin": f"NEW{i}", "title": f"Cedar Beard Oil by Solene, {i} ml", "brand": "Solene",
                         "categories": ["Beauty", "Men", "Beard Oil"], "description": None}
    (d / "items.json").write_text(json.dumps(items))
    split = load_split_dir(d)
    interacted = {i for seq in split.sequences("train+valid").values() for i in seq}
    with_ids = sorted(set(range(1, N_ITEMS + 1)) | set(EXTRA_WITH_IDS))
    ids = root / "ids.json"
    random_ids(with_ids, seed=0).save(ids)
    assert interacted <= set(with_ids) and not interacted & set(EXTRA_WITH_IDS + EXTRA_WITHOUT_IDS)
    return d, ids, len(interacted), len(with_ids)


@pytest.mark.usefixtures("one_thread")
def test_build_deploy_with_alignment_records_its_examples(data, tmp_path) -> None:
    """Selection: the items interacted with in train + valid; the deploy refit: the whole catalog (with ids)."""
    d, ids, n_interacted, n_with_ids = data
    assert n_interacted < n_with_ids
    out = tmp_path / "bundle"
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny", "--epochs", "1",
            "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--protocol", "deploy", "--refit", "scratch",
            "--refit-epochs", "auto", "--patience", "0", "--align", "text2id"]
    assert cli.main(argv) == 0
    b = Bundle.open(out)
    info = json.loads((b.target_dir / "training.json").read_text())
    assert info["align"] == "text2id" and info["align_examples"] == n_interacted
    assert info["refit"]["mode"] == "scratch" and info["refit"]["extra_examples"] == n_with_ids
    stage = b.read()["stages"]["target"]
    assert stage["align"] == "text2id" and stage["align_examples"] == n_interacted
    assert stage["refit"]["extra_examples"] == n_with_ids


@pytest.mark.usefixtures("one_thread")
def test_build_plan_counts_the_alignment_examples(data, tmp_path) -> None:
    """--plan counts the alignment examples: 4 more labelled tokens per aligned item in each phase."""
    d, ids, n_interacted, n_with_ids = data
    plans = {}
    for align in ALIGN_MODES:
        out = tmp_path / align
        argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny",
                "--batch-size", "8", "--bf16", "off", "--protocol", "deploy", "--plan", "--plan-steps", "1",
                "--align", align]
        assert cli.main(argv) == 0
        plans[align] = json.loads((out / "plan.json").read_text())
    none, aligned = plans["none"], plans["text2id"]
    assert (none["align"], aligned["align"]) == ("none", "text2id")
    for phase, n in (("selection", n_interacted), ("refit", n_with_ids)):
        assert aligned[phase]["windows"] == none[phase]["windows"] + n
        assert aligned[phase]["labelled_tokens_per_epoch"] == none[phase]["labelled_tokens_per_epoch"] + 4 * n


def test_bad_align_value_exits_2(data, tmp_path, capsys) -> None:
    d, ids, *_ = data
    with pytest.raises(SystemExit) as exc:
        cli.main(["build", "--data", str(d), "--out", str(tmp_path / "b"), "--ids", str(ids), "--align", "bogus"])
    assert exc.value.code == 2
    assert "--align" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
