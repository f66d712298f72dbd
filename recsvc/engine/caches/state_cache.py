"""The user-state cache: a returning user's prompt is not run again.

After a request, the target's KV rows of the user's prompt (every layer's keys and values), the final hidden
state of its last token and the first code's log-probs are kept, keyed by the bundle version and the prompt's
tokens. The next request:
- with the same prompt (a full hit) skips the prompt forward and starts at depth 1;
- with a prompt that extends a cached one (a new interaction appended, the history window not slid yet: a
  partial hit) loads the cached rows and runs only the new tokens;
- plain beam search also keeps each decode step's fed beams (keys / values / hidden states of those trie
  nodes under this prompt): a step whose beams are exactly a kept step's (an identical request: same k, beam
  width, exclusions and prior) loads them instead of running the forward, so a repeated request runs none;
- otherwise (a miss; also once the history is longer than the prompt window, where every new interaction
  shifts the window and so every position: the strategy is recompute) runs the whole prompt.
Keyed rows (``row`` / ``keep_row``: a tensor or a tuple of tensors under the caller's key, LRU) hold what a
recommender keeps per user besides a prompt's state: the item-level target's timeline states and search outputs
(``recsvc.recommender.stages.timeline_decode``) and a returning user's fused prior row (``prior`` /
``keep_prior``: one history alone, keyed by the prior, trie, weight and the whole history, so it is not computed
again: ~1 ms a request on Beauty; at most MAX_PRIORS rows and a quarter of the budget). Bounded by a byte budget:
over it, prior rows go first, then keyed rows, then the least recently used prompt states. One per served bundle
and process (a reload builds a new recommender and so an empty cache). Of the token target's forwards only the
fast one (``recsvc.engine.kernels.fast``) keeps prompt states; ``recsvc.engine.caches.prefill`` loads and stores
them.

Memory per entry: layers x 2 x kv_heads x head_dim x tokens x bytes per value (+ the hidden state and C
log-probs): docs/SCALING.md.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class UserState:
    tokens: tuple[int, ...]  # the prompt
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [h_kv, T, d]
    hidden: torch.Tensor  # [H] final hidden state of the prompt's last token
    logp0: torch.Tensor | None  # [C] the first code's log-probs (float32), None when not computed
    nbytes: int
    # plain beam search's decode steps: the beams fed (their code paths, in order) -> (every layer's keys and
    # values of those tokens [layers, 2, h_kv, K, d], their hidden states [K, H]); a token's key / value / hidden
    # depend only on the prompt and its trie node's ancestors, so an identical request replays them
    steps: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=OrderedDict)


MAX_STEPS = 12  # decode steps kept per prompt (3 per request of a 4-level id: the last 4 distinct requests)
MAX_PRIORS = 1024  # fused prior rows kept (``UserStateCache.prior``), also at most a quarter of the budget

Row = torch.Tensor | tuple[torch.Tensor, ...]  # a keyed row: a tensor or a tuple of tensors


def row_bytes(value: Row) -> int:
    """The bytes a row holds (every tensor of a tuple)."""
    return value.nbytes if isinstance(value, torch.Tensor) else sum(t.nbytes for t in value)


class KeyedRows:
    """An LRU of rows under hashable keys with their bytes counted (not thread-safe: the cache's lock guards it).
    The cache holds two: its keyed rows and its prior rows."""

    def __init__(self) -> None:
        self._rows: OrderedDict[Hashable, tuple[Row, int]] = OrderedDict()  # key -> (row, bytes), oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: Hashable) -> Row | None:
        """The row under ``key`` (now the most recent), or None."""
        kept = self._rows.get(key)
        if kept is None:
            return None
        self._rows.move_to_end(key)
        return kept[0]

    def put(self, key: Hashable, value: Row) -> None:
        """Keep ``value`` under ``key`` (replacing what was there) as the most recent row."""
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        nbytes = row_bytes(value)
        self._rows[key] = (value, nbytes)
        self.bytes += nbytes

    def drop_oldest(self) -> None:
        _, (_, nbytes) = self._rows.popitem(last=False)
        self.bytes -= nbytes

    def clear(self) -> None:
        self._rows.clear()
        self.bytes = 0


class UserStateCache:
    def __init__(self, budget_bytes: int, version: str = "") -> None:
        if budget_bytes < 0:
            raise ValueError(f"state cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self.version = version  # the bundle version: entries of another one never match
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], UserState] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # prompt length -> cached entries of that length
        self._lock = threading.Lock()
        self.hits = self.partial_hits = self.misses = self.evictions = 0
        self.bytes = 0  # the prompt states' (keyed rows and prior rows are counted apart, in the same budget)
        # keyed rows (``row`` / ``keep_row``): the caller's key -> a tensor or a tuple of tensors; LRU, in the
        # budget (over it they go before the prompt states, after the prior rows)
        self._rows = KeyedRows()
        self.row_hits = self.row_misses = 0
        # a returning user's fused prior row (it depends on the whole history, not the prompt window): key ->
        # [num_nodes]; LRU of at most MAX_PRIORS rows and budget / 4 bytes, counted in the budget (they only use
        # room the rest leaves: over the budget they go first; ``bytes`` and ``stats`` count the states only)
        self._priors = KeyedRows()

    @property
    def _prior_bytes(self) -> int:
        return self._priors.bytes

    # ---- keyed rows ------------------------------------------------------------------------------------------
    def row(self, key: Hashable, count: bool = True) -> Any | None:
        """The row kept under ``key`` (the caller's: everything the row depends on), or None. Counts the outcome
        (``row_hits`` / ``row_misses``) unless ``count`` is False (work ahead of a request)."""
        with self._lock:
            value = self._rows.get((self.version, key))
            if count:
                if value is None:
                    self.row_misses += 1
                else:
                    self.row_hits += 1
            return value

    def keep_row(self, key: Hashable, value: Row) -> None:
        """Keep ``value`` (a tensor or a tuple of tensors the caller does not change afterwards) under ``key``; a
        row larger than the whole budget is not kept."""
        if row_bytes(value) > self.budget:
            return
        with self._lock:
            self._rows.put((self.version, key), value)
            self._evict()

    # ---- prior rows ------------------------------------------------------------------------------------------
    def prior(self, key: tuple) -> torch.Tensor | None:
        """The prior row kept under ``key`` (the caller's: the prior, its weight and the history), or None."""
        with self._lock:
            row = self._priors.get((self.version, key))
            assert row is None or isinstance(row, torch.Tensor)
            return row

    def keep_prior(self, key: tuple, row: torch.Tensor) -> None:
        """Keep ``row`` [num_nodes] (the caller does not change it afterwards) under ``key``."""
        with self._lock:
            self._priors.put((self.version, key), row)
            while len(self._priors) and (len(self._priors) > MAX_PRIORS or self._priors.bytes > self.budget // 4):
                self._priors.drop_oldest()
            self._evict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], count: bool = True) -> tuple[UserState | None, int]:
        """(entry, cached tokens): a full hit (n == len(tokens)), the longest cached prefix (partial), or
        (None, 0). Counts the outcome (unless ``count`` is False: work ahead of a request)."""
        key = tuple(tokens)
        inc = 1 if count else 0
        with self._lock:
            entry = self._entries.get((self.version, key))
            if entry is not None:
                self._entries.move_to_end((self.version, key))
                self.hits += inc
                return entry, len(key)
            for n in sorted((n for n in self._lengths if n < len(key)), reverse=True):
                entry = self._entries.get((self.version, key[:n]))
                if entry is not None:
                    self._entries.move_to_end((self.version, key[:n]))
                    self.partial_hits += inc
                    return entry, n
            self.misses += inc
            return None, 0

    def store(self, tokens: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]], hidden: torch.Tensor,
              logp0: torch.Tensor | None) -> UserState | None:
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + hidden.nbytes + (logp0.nbytes if logp0 is not None else 0)
        if nbytes > self.budget:
            return None
        key = (self.version, tuple(tokens))
        entry = UserState(key[1], kv, hidden, logp0, nbytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(old)
            self._entries[key] = entry
            self._lengths[len(key[1])] += 1
            self.bytes += nbytes
            self._evict()
        return entry

    def add_step(self, entry: UserState, nodes: tuple[int, ...], kv: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep a decode step of ``entry``'s prompt (at most MAX_STEPS per entry, the oldest dropped)."""
        nbytes = kv.nbytes + hidden.nbytes
        with self._lock:
            if (self.version, entry.tokens) not in self._entries or nodes in entry.steps:
                return  # evicted meanwhile, or already kept
            entry.steps[nodes] = (kv, hidden)
            entry.nbytes += nbytes
            self.bytes += nbytes
            while len(entry.steps) > MAX_STEPS:
                _, (k_old, h_old) = entry.steps.popitem(last=False)
                entry.nbytes -= k_old.nbytes + h_old.nbytes
                self.bytes -= k_old.nbytes + h_old.nbytes
            self._evict()

    def _evict(self) -> None:
        """Over the budget, prior rows go first (recomputing one costs ~1 ms; a user's prompt state and decode
        steps save a forward each), then the least recently used keyed rows, then the least recently used
        states."""
        while self.bytes + self._rows.bytes + self._priors.bytes > self.budget and len(self._priors):
            self._priors.drop_oldest()
        while self.bytes + self._rows.bytes > self.budget and len(self._rows):
            self._rows.drop_oldest()
        while self.bytes > self.budget and self._entries:
            _, victim = self._entries.popitem(last=False)
            self._forget(victim)
            self.evictions += 1

    def _forget(self, entry: UserState) -> None:
        self.bytes -= entry.nbytes
        self._lengths[len(entry.tokens)] -= 1
        if not self._lengths[len(entry.tokens)]:
            del self._lengths[len(entry.tokens)]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self.bytes = 0
            self._rows.clear()
            self._priors.clear()

    def stats(self) -> dict[str, int]:
        """The prompt states' counters (``hits`` .. ``entries``) and the keyed rows' (``row_*``)."""
        return {"hits": self.hits, "partial_hits": self.partial_hits, "misses": self.misses,
                "evictions": self.evictions, "bytes": self.bytes, "entries": len(self._entries),
                "row_hits": self.row_hits, "row_misses": self.row_misses, "row_bytes": self._rows.bytes,
                "rows": len(self._rows)}
