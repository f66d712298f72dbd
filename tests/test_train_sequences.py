"""Training examples, bucketed batches, collation."""

from __future__ import annotations

import torch
from test_train_fixtures import random_ids, small_tokenizer

from recsvc.bundle.prompt import IGNORE_INDEX, PromptBuilder
from recsvc.data.split import EvalUser
from training.target_lm.sequences import bucketed_batches, collate, count_tokens, eval_examples, train_examples

TOK = small_tokenizer()
BUILDER = PromptBuilder(TOK, random_ids(list(range(1, 31)), seed=2), max_history=3)


def test_bucketed_batches_cover_each_index_once() -> None:
    lengths = [(i * 37) % 23 + 1 for i in range(101)]
    for seed in (None, 0, 1):
        batches = bucketed_batches(lengths, batch_size=8, seed=seed, chunk_batches=2)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(101))
        assert all(len(b) <= 8 for b in batches)
    assert bucketed_batches(lengths, 8, seed=3) == bucketed_batches(lengths, 8, seed=3)  # deterministic
    assert bucketed_batches(lengths, 8, seed=3) != bucketed_batches(lengths, 8, seed=4)
    # eval order: sorted by length, so padding is minimal
    ordered = [lengths[i] for b in bucketed_batches(lengths, 8, seed=None) for i in b]
    assert ordered == sorted(lengths)


def test_train_examples_and_collate() -> None:
    seqs = {2: [1, 2, 3, 4, 5, 6], 1: [7, 8], 3: [9]}
    ex = train_examples(BUILDER, seqs)
    # user 1: one window (target 8); user 2: window 0 (targets 2, 3, 4) + windows for 5, 6; user 3: none
    assert len(ex) == 1 + 3
    tokens, labelled = count_tokens(ex)
    assert labelled == 4 * (1 + 5)
    batch = collate(ex, pad_id=TOK.pad_token_id)
    b, t = batch["input_ids"].shape
    assert (b, t) == (4, max(len(e) for e in ex))
    assert int(batch["attention_mask"].sum()) == tokens
    assert bool((batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all())
    assert bool((batch["input_ids"][batch["attention_mask"] == 0] == TOK.pad_token_id).all())
    assert batch["input_ids"].dtype == torch.long


def test_eval_examples_one_per_target() -> None:
    users = [EvalUser(1, [1, 2], [3, 4]), EvalUser(2, [5], [6]), EvalUser(3, [7], [99])]  # 99: no semantic id
    ex = eval_examples(BUILDER, users)
    assert len(ex) == 3
    assert ex[0].input_ids == BUILDER.prompt_ids([1, 2]) + BUILDER.item_token_ids(3)
    assert len(eval_examples(BUILDER, users, max_users=1, seed=0)) in (1, 2)
