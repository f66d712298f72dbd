"""Prompt format: inference prompts are exact prefixes of training windows; labels mark the target codes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_train_fixtures import random_ids, small_tokenizer

from recsvc.bundle.prompt import HEADER, IGNORE_INDEX, MAX_HISTORY, PromptBuilder
from recsvc.errors import UserError

ITEMS = list(range(1, 41))
TOK = small_tokenizer()
IDS = random_ids(ITEMS, seed=1)


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder(TOK, IDS, max_history=MAX_HISTORY)


def test_item_token_ids(builder) -> None:
    off = builder.code_offset
    for item in (1, 17, 40):
        a, b, c, d = IDS.codes_of(item)
        assert builder.item_token_ids(item) == [off + a, off + 256 + b, off + 512 + c, off + 768 + d]
    with pytest.raises(UserError, match="unknown item 999"):
        builder.item_token_ids(999)


def test_header_is_short_and_renders(builder) -> None:
    assert len(builder.header_ids) < 40
    assert builder.header_ids[0] == TOK.bos_token_id
    text = builder.render(builder.prompt_ids([3, 5]))
    assert text == "<s>" + HEADER + "".join(IDS.tokens_of(3)) + "\n" + "".join(IDS.tokens_of(5)) + "\n"


def test_prompt_uses_last_max_history_items(builder) -> None:
    hist = ITEMS[:30]
    assert builder.prompt_ids(hist) == builder.prompt_ids(hist[-MAX_HISTORY:])
    assert len(builder.prompt_ids(hist)) == len(builder.header_ids) + MAX_HISTORY * builder.item_len
    assert builder.prompt_ids([]) == builder.header_ids


def _targets(window: tuple[list[int], list[int]], builder: PromptBuilder) -> list[tuple[int, tuple[int, ...]]]:
    """(position, codes) of each labelled item in a window."""
    ids, labels = window
    out = []
    pos = 0
    while pos < len(labels):
        if labels[pos] != IGNORE_INDEX:
            assert labels[pos:pos + 4] == ids[pos:pos + 4]
            out.append((pos, tuple(ids[pos:pos + 4])))
            pos += 4
        else:
            pos += 1
    return out


@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.sampled_from(ITEMS), min_size=0, max_size=50), max_history=st.integers(1, 6),
       header=st.sampled_from(["lcrec", "compact", "packed"]))
def test_prompt_is_prefix_of_the_window_that_predicts_each_item(items, max_history, header) -> None:
    builder = PromptBuilder(TOK, IDS, max_history=max_history, header=header)
    windows = builder.training_windows(items)
    # every item but the first is a target exactly once
    labelled = [t for w in windows for t in _targets(w, builder)]
    assert len(labelled) == max(len(items) - 1, 0)
    for t in range(1, len(items)):
        # item t is predicted in window 0 (t <= max_history) or in window t - max_history
        ids, labels = windows[max(0, t - max_history)]
        prompt = builder.prompt_ids(items[:t])
        codes = builder.item_token_ids(items[t])
        assert ids[:len(prompt) + 4] == prompt + codes
        assert labels[len(prompt):len(prompt) + 4] == codes
        assert labels[len(prompt) + 4:len(prompt) + builder.item_len] == [IGNORE_INDEX] * len(builder.sep_ids)
    for ids, labels in windows:
        assert len(ids) == len(labels) <= len(builder.header_ids) + (max_history + 1) * builder.item_len


def test_window_layout(builder) -> None:
    # max_history=2, items [i0..i3]: window 0 = H i0 i1 i2 (targets i1, i2); window 1 = H i1 i2 i3 (target i3)
    b = PromptBuilder(TOK, IDS, max_history=2)
    h, n = len(b.header_ids), b.item_len
    w0, w1 = b.training_windows([1, 2, 3, 4])
    assert [p for p, _ in _targets(w0, b)] == [h + n, h + 2 * n]
    assert [p for p, _ in _targets(w1, b)] == [h + 2 * n]
    assert w1[0] == b.prompt_ids([2, 3]) + b.item_token_ids(4) + b.sep_ids
    assert b.training_windows([7]) == [] and b.training_windows([]) == []


def test_packed_prompt_is_bos_and_codes_only() -> None:
    b = PromptBuilder(TOK, IDS, max_history=MAX_HISTORY, header="packed")
    assert b.sep_ids == [] and b.item_len == 4 and b.header_ids == [TOK.bos_token_id]
    assert b.prompt_ids([3, 5]) == [TOK.bos_token_id] + b.item_token_ids(3) + b.item_token_ids(5)
    ids, labels = b.training_windows([3, 5, 7])[0]
    assert ids == b.prompt_ids([3, 5, 7])
    assert labels == [IGNORE_INDEX] * 5 + b.item_token_ids(5) + b.item_token_ids(7)  # every token but BOS + i0


def test_target_example(builder) -> None:
    ids, labels = builder.target_example([1, 2], 9)
    prompt = builder.prompt_ids([1, 2])
    assert ids == prompt + builder.item_token_ids(9)
    assert labels == [IGNORE_INDEX] * len(prompt) + builder.item_token_ids(9)


@settings(max_examples=40, deadline=None)
@given(items=st.lists(st.sampled_from(ITEMS), min_size=0, max_size=40), max_history=st.integers(1, 6),
       stride=st.integers(1, 4), header=st.sampled_from(["lcrec", "packed"]))
def test_strided_windows_predict_each_item_once_with_enough_history(items, max_history, stride, header) -> None:
    builder = PromptBuilder(TOK, IDS, max_history=max_history, header=header)
    windows = builder.training_windows(items, stride=stride)
    h, n = len(builder.header_ids), builder.item_len
    seen = []
    for w, (ids, labels) in enumerate(windows):
        for pos, _ in _targets((ids, labels), builder):
            k = (pos - h) // n  # item index inside the window = its history length
            assert ids[:pos] == builder.header_ids + [x for it in _window_items(ids, builder)[:k] for x in it]
            if w > 0:
                assert max(1, max_history - stride + 1) <= k <= max_history
            seen.append(tuple(ids[pos:pos + 4]))
    assert sorted(seen) == sorted(tuple(builder.item_token_ids(i)) for i in items[1:])
    if stride == 1:
        assert windows == builder.training_windows(items)


def _window_items(ids: list[int], builder: PromptBuilder) -> list[list[int]]:
    """The (codes + SEP) chunks after the header."""
    body = ids[len(builder.header_ids):]
    return [body[i:i + builder.item_len] for i in range(0, len(body), builder.item_len)]


def test_bad_stride(builder) -> None:
    with pytest.raises(UserError, match="stride"):
        builder.training_windows([1, 2], stride=0)
