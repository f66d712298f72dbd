"""Training examples for causal-LM recommenders: windows, validation examples, bucketed padded batches.

Protocol (data/amazon-beauty/README.md): the model is trained on each user's TRAIN items only. Validation
(early stopping) asks it for the valid items given history = train items; the final test evaluation uses the
same model with history = train + valid items (the valid period is never trained on, as in the paper).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from recsvc.bundle.prompt import IGNORE_INDEX, PromptBuilder
from recsvc.data.sampling import sample_users
from recsvc.data.split import EvalUser
from training.choices import ALIGN_MODES as ALIGN_MODES  # the alignment task's modes (re-exported)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX except on predicted code tokens

    def __len__(self) -> int:
        return len(self.input_ids)


def train_examples(
    builder: PromptBuilder, sequences: Mapping[int, Sequence[int]], stride: int = 1
) -> list[Example]:
    """Whole-sequence windows (``PromptBuilder.training_windows``) of every user, ordered by user id."""
    out: list[Example] = []
    for user in sorted(sequences):
        out += [Example(i, lab) for i, lab in builder.training_windows(sequences[user], stride=stride)]
    return out


ALIGN_TEXT_TOKENS = 32


def alignment_examples(builder: PromptBuilder, texts: Mapping[int, str], items: Iterable[int],
                       max_text_tokens: int = ALIGN_TEXT_TOKENS) -> list[Example]:
    """LC-Rec's item-index alignment task, text -> id: ``header + the item's text + SEP + its codes``, labelled
    on the codes only; one example per item of ``items`` that has a semantic id, ordered by item id.

    Sequences teach the model the code paths of items that people bought; this teaches it the path of every
    catalog item from its text, so that items without interactions have learnt paths too. A rec prompt after
    the header holds code tokens only, so the text tells the model which task it is in (the compact prompt's
    header is [BOS] alone).
    """
    tok = builder.tokenizer
    out: list[Example] = []
    for item in sorted(set(items)):
        if item not in builder.ids or item not in texts:
            continue
        text = tok.encode(texts[item], add_special_tokens=False)[:max_text_tokens]
        prompt = builder.header_ids + text + (builder.sep_ids or tok.encode("\n", add_special_tokens=False))
        codes = builder.item_token_ids(item)
        out.append(Example(prompt + codes, [IGNORE_INDEX] * len(prompt) + codes))
    return out


def eval_examples(
    builder: PromptBuilder, users: Sequence[EvalUser], max_users: int | None = None, seed: int = 0
) -> list[Example]:
    """One example per (user, target): prompt(history) + target codes, labelled on the target only.

    ``max_users`` takes a fixed random sample of users (validation loss is a cheap early-stopping signal).
    """
    return [Example(*builder.target_example(u.history, t)) for u in sample_users(users, max_users, seed)
            for t in u.targets if t in builder.ids]


def bucketed_batches(
    lengths: Sequence[int], batch_size: int, seed: int | None, chunk_batches: int = 64
) -> list[list[int]]:
    """Index batches of similar lengths (little padding), in random order when ``seed`` is given.

    Shuffle, cut into chunks of ``chunk_batches * batch_size``, sort each chunk by length, slice batches,
    shuffle the batches. ``seed=None``: sorted by length, no shuffling (evaluation).

    >>> bucketed_batches([5, 1, 4, 2], batch_size=2, seed=None)
    [[1, 3], [2, 0]]
    """
    idx = list(range(len(lengths)))
    if seed is None:
        idx.sort(key=lambda i: lengths[i])
        return [idx[s:s + batch_size] for s in range(0, len(idx), batch_size)]
    rng = random.Random(seed)
    rng.shuffle(idx)
    chunk = batch_size * chunk_batches
    batches: list[list[int]] = []
    for s in range(0, len(idx), chunk):
        part = sorted(idx[s:s + chunk], key=lambda i: lengths[i])
        batches += [part[b:b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: input_ids [B, T], attention_mask [B, T], labels [B, T] (IGNORE_INDEX on pads)."""
    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def count_tokens(examples: Sequence[Example]) -> tuple[int, int]:
    """(tokens, labelled tokens) over examples."""
    return sum(len(e) for e in examples), sum(sum(1 for x in e.labels if x != IGNORE_INDEX) for e in examples)
