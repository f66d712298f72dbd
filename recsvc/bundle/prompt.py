"""The prompt: LC-Rec's sequential-recommendation prompt, laid out for whole-sequence training.

Format (``render`` of a prompt with two history items; ``[BOS]`` when the tokenizer has one)::

    [BOS]### Instruction:
    The user has interacted with the following items in chronological order. Predict the next item.

    ### Response:
    <a_12><b_7><c_200><d_3>
    <a_40><b_1><c_9><d_77>
    <next item's 4 codes are generated here>

i.e. ``HEADER + for each item: [4 code token ids] + SEP`` with SEP = "\\n". The token ids are built by
concatenating pieces tokenized once (``HEADER_IDS``, ``SEP_IDS``, code ids), never by re-tokenizing a joined
string, so an inference prompt is exactly a prefix of a training sequence:

    prompt_ids(h[:t]) + item_token_ids(h[t])  ==  the start of the training window that predicts h[t]

Whole-sequence training (SASRec-style): one causal window per user holds up to
``max_history + 1`` items, and the loss covers the 4 codes of every item but the window's first, so a single
forward pass trains every next-item example of the window. A predicted item must see exactly what inference
shows it (the last ``<= max_history`` items), hence for a user with n > max_history + 1 items:

    window 0: items[0 : max_history+1]          labels on items 1 .. max_history (history 1 .. max_history)
    window j: items[j : j+max_history+1], j>=1  label on its last item only (history = max_history items)

Every item except the user's first is a target exactly once. Windows after the first cost a full context
for one target: on Beauty (436 users with > 21 train items) they are 6% of the targets but 42% of the
1.94M tokens of an epoch. ``training_windows(items, stride=s)`` trades exactness for speed: each later
window predicts its last s items (history max_history - s + 1 .. max_history); s = 5 cuts an epoch to ~1.3M
tokens. The default (s = 1) keeps the exact train / inference match.
"""

from __future__ import annotations

from collections.abc import Sequence

from recsvc.bundle.tokenizer import code_token_offset
from recsvc.errors import UserError
from tokenizer_rqvae.ids import CODEBOOK_SIZE, SemanticIds

MAX_HISTORY = 20
IGNORE_INDEX = -100
HEADER = (
    "### Instruction:\n"
    "The user has interacted with the following items in chronological order. Predict the next item.\n\n"
    "### Response:\n"
)
SEP = "\n"
TEMPLATES = (HEADER, SEP)  # texts the tokenizer is trained on (besides item texts)
# Prompt styles: "lcrec" = [BOS] + the instruction text above (LC-Rec's prompt; what a pretrained LLM expects);
# "compact" = [BOS] only. A model trained from scratch learns nothing from the fixed instruction text, and on
# Beauty it is ~35 of a window's ~65 tokens: "compact" halves the tokens of an epoch (docs/QUALITY.md).
# "packed" = [BOS] only and no SEP between items: every item has exactly ``levels`` codes, so the separator tells
# a model trained from scratch nothing, yet it is one token in five of a window (20% of an epoch's work). The
# next item's first code is predicted at the previous item's last code.
HEADER_STYLES = ("lcrec", "compact", "packed")


class PromptBuilder:
    """Token ids of prompts and training windows for one (tokenizer, semantic ids) pair."""

    def __init__(self, tokenizer, ids: SemanticIds, max_history: int = MAX_HISTORY, header: str = "lcrec") -> None:
        if max_history < 1:
            raise UserError(f"max_history must be >= 1, got {max_history}")
        if header not in HEADER_STYLES:
            raise UserError(f"prompt header must be one of {', '.join(HEADER_STYLES)}, not {header!r}")
        if ids.codebook_size > CODEBOOK_SIZE:
            raise UserError(f"semantic ids use codes up to {ids.codebook_size - 1}; the tokenizer has "
                            f"{CODEBOOK_SIZE} per level")
        self.tokenizer = tokenizer
        self.ids = ids
        self.max_history = max_history
        self.header = header
        self.code_offset: int = code_token_offset(tokenizer)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        sep = tokenizer.encode(SEP, add_special_tokens=False)
        self.sep_ids: list[int] = [] if header == "packed" else sep
        if header == "lcrec":
            self.header_ids: list[int] = bos + tokenizer.encode(HEADER, add_special_tokens=False)
        else:  # compact / packed: never empty (an empty history still needs one position to predict from)
            self.header_ids = bos or list(sep)
        # item row -> its 4 code token ids: offset + level * 256 + code
        levels = ids.levels
        self._item_ids = (ids.codes + self.code_offset + CODEBOOK_SIZE * _arange(levels)).tolist()

    @property
    def item_len(self) -> int:
        """Tokens per item in a prompt: the codes + SEP (no SEP with the "packed" style)."""
        return self.ids.levels + len(self.sep_ids)

    def item_token_ids(self, item_id: int) -> list[int]:
        """The 4 code token ids of ``item_id``; UserError for an item without a semantic id."""
        try:
            return list(self._item_ids[self.ids.index_of(item_id)])
        except KeyError:
            raise UserError(f"unknown item {item_id}: it has no semantic id") from None

    def prompt_ids(self, history: Sequence[int]) -> list[int]:
        """HEADER + the last <= max_history items (codes + SEP each); the next token is the next item's first code."""
        out = list(self.header_ids)
        for item in list(history)[-self.max_history:] if history else []:
            out += self.item_token_ids(item) + self.sep_ids
        return out

    def training_windows(self, items: Sequence[int], stride: int = 1) -> list[tuple[list[int], list[int]]]:
        """(input_ids, labels) windows over a user's chronological items (see the module docstring).

        labels == input_ids on the code tokens of each target item and IGNORE_INDEX elsewhere. A user with
        one item (or none) has nothing to predict: ``[]``. ``stride`` > 1 (a speed option) lets each window
        after the first predict its last ``stride`` items, which then see max_history - stride + 1 ..
        max_history previous items instead of exactly max_history (stride is capped at max_history).

        >>> # max_history=2, items [i0, i1, i2, i3]: window 0 = H i0 i1 i2 (targets i1, i2),
        >>> # window 1 = H i1 i2 i3 (target i3)
        """
        if stride < 1:
            raise UserError(f"window stride must be >= 1, got {stride}")
        stride = min(stride, self.max_history)  # every target keeps >= 1 item of history
        items = list(items)
        width = self.max_history + 1
        if len(items) < 2:
            return []
        windows = [self._window(items[:width], first_target=1)]
        for first in range(width, len(items), stride):  # targets first .. last of one window
            last = min(first + stride, len(items)) - 1
            start = last - self.max_history
            windows.append(self._window(items[start:last + 1], first_target=first - start))
        return windows

    def target_example(self, history: Sequence[int], target: int) -> tuple[list[int], list[int]]:
        """prompt_ids(history) + target's codes, labels on the target only (validation loss)."""
        prompt = self.prompt_ids(history)
        codes = self.item_token_ids(target)
        return prompt + codes, [IGNORE_INDEX] * len(prompt) + codes

    def _window(self, items: list[int], first_target: int) -> tuple[list[int], list[int]]:
        input_ids = list(self.header_ids)
        labels = [IGNORE_INDEX] * len(input_ids)
        for pos, item in enumerate(items):
            codes = self.item_token_ids(item)
            input_ids += codes + self.sep_ids
            labels += (codes if pos >= first_target else [IGNORE_INDEX] * len(codes))
            labels += [IGNORE_INDEX] * len(self.sep_ids)
        return input_ids, labels

    def render(self, token_ids: Sequence[int]) -> str:
        """Readable text of token ids (code tokens shown as ``<a_12>``)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)


def _arange(n: int):
    import numpy as np

    return np.arange(n, dtype=np.int64)
