"""Semantic ids: item_id <-> 4 code tokens ``<a_i>, <b_j>, <c_k>, <d_l>``.

File format (``semantic_ids.json``, also the shared reference file): ``{"<item_id>": ["<a_47>", "<b_103>",
"<c_234>", "<d_99>"], ...}`` with 1-based integer item ids as keys.

In memory: ``item_ids`` [n] int64 ascending and ``codes`` [n, LEVELS] int64 in [0, codebook_size).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recsvc_base.errors import UserError

LEVELS = 4
CODEBOOK_SIZE = 256
LEVEL_NAMES = "abcd"
_TOKEN_RE = re.compile(r"^<([a-z])_(\d+)>$")


def code_token(level: int, code: int) -> str:
    """``code_token(1, 7) == "<b_7>"``."""
    return f"<{LEVEL_NAMES[level]}_{code}>"


def all_code_tokens(levels: int = LEVELS, codebook_size: int = CODEBOOK_SIZE) -> list[str]:
    """Level-major list: ``<a_0> .. <a_255>, <b_0> .., <d_255>`` (the order the tokenizer adds them in)."""
    return [code_token(lv, c) for lv in range(levels) for c in range(codebook_size)]


def parse_code_token(token: str) -> tuple[int, int]:
    """``parse_code_token("<c_12>") == (2, 12)``; raises UserError for anything else."""
    m = _TOKEN_RE.match(token) if isinstance(token, str) else None
    if not m or m.group(1) not in LEVEL_NAMES:
        raise UserError(f"not a code token: {token!r} (expected like '<a_12>')")
    return LEVEL_NAMES.index(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class SemanticIds:
    item_ids: np.ndarray  # [n] int64, ascending
    codes: np.ndarray  # [n, levels] int64
    codebook_size: int = CODEBOOK_SIZE
    _index: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    _paths: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)  # rows_of's index

    def __post_init__(self) -> None:
        if self.codes.ndim != 2 or self.codes.shape[0] != self.item_ids.shape[0]:
            raise UserError(f"codes shape {self.codes.shape} does not match {self.item_ids.shape[0]} items")
        if len(self.item_ids) and (self.codes.min() < 0 or self.codes.max() >= self.codebook_size):
            raise UserError(f"codes must lie in [0, {self.codebook_size})")
        self._index.clear()
        self._paths.clear()
        self._index.update({int(i): n for n, i in enumerate(self.item_ids)})
        if len(self._index) != len(self.item_ids):
            raise UserError("duplicate item ids")

    @property
    def levels(self) -> int:
        return int(self.codes.shape[1])

    def __len__(self) -> int:
        return int(self.item_ids.shape[0])

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._index

    def index_of(self, item_id: int) -> int:
        """Row of ``item_id`` in ``codes``; KeyError for unknown items."""
        return self._index[int(item_id)]

    def rows_of(self, paths: np.ndarray) -> np.ndarray:
        """[K, levels] code paths -> [K] int64 rows of the items with those paths (-1 where no item has one, or a
        code lies outside the codebook)."""
        paths = np.asarray(paths, dtype=np.int64).reshape(-1, self.levels)
        if "keys" not in self._paths:
            keys = self._path_keys(self.codes)
            order = np.argsort(keys, kind="stable")
            self._paths.update(keys=keys[order], rows=order)
        keys, rows = self._paths["keys"], self._paths["rows"]
        if not len(keys):
            return np.full(len(paths), -1, dtype=np.int64)
        valid = ((paths >= 0) & (paths < self.codebook_size)).all(axis=1)
        want = self._path_keys(np.where(valid[:, None], paths, 0))
        at = np.searchsorted(keys, want).clip(max=len(keys) - 1)
        return np.where(valid & (keys[at] == want), rows[at], -1)

    def _path_keys(self, paths: np.ndarray) -> np.ndarray:
        """[K, levels] codes in [0, codebook_size) -> [K] int64 keys, one per distinct path."""
        keys = np.zeros(len(paths), dtype=np.int64)
        for level in range(paths.shape[1]):
            keys = keys * self.codebook_size + paths[:, level]
        return keys

    def codes_of(self, item_id: int) -> tuple[int, ...]:
        return tuple(int(c) for c in self.codes[self._index[int(item_id)]])

    def tokens_of(self, item_id: int) -> list[str]:
        return [code_token(lv, c) for lv, c in enumerate(self.codes_of(item_id))]

    @classmethod
    def from_mapping(cls, mapping: dict[int, tuple[int, ...]], codebook_size: int = CODEBOOK_SIZE) -> SemanticIds:
        items = sorted(mapping)
        codes = np.array([list(mapping[i]) for i in items], dtype=np.int64).reshape(len(items), -1)
        return cls(np.array(items, dtype=np.int64), codes, codebook_size)

    def collision_groups(self) -> list[list[int]]:
        """Groups (item ids) of >= 2 items sharing one id."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for item, row in zip(self.item_ids.tolist(), self.codes.tolist(), strict=True):
            groups.setdefault(tuple(row), []).append(item)
        return [g for g in groups.values() if len(g) > 1]

    def collisions(self) -> int:
        """Items minus distinct ids: how many items must move for all ids to be unique (LC-Rec's count;
        the reference Beauty ids: 12, in 9 groups of 21 items)."""
        return len(self) - len({tuple(r) for r in self.codes.tolist()})

    def codebook_usage(self) -> list[float]:
        """Per level, the fraction of the codebook that some item uses."""
        return [len(Counter(self.codes[:, lv].tolist())) / self.codebook_size for lv in range(self.levels)]

    @classmethod
    def load(cls, path: str | Path, codebook_size: int = CODEBOOK_SIZE) -> SemanticIds:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"semantic ids file not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict) or not raw:
            raise UserError(f"{path}: expected a non-empty object item_id -> list of code tokens")
        mapping: dict[int, tuple[int, ...]] = {}
        known: dict[str, tuple[int, int]] = {}  # each distinct token parsed once (at most levels x codebook)
        for key, toks in raw.items():
            if not str(key).isdigit() or not isinstance(toks, list) or not toks:
                raise UserError(f"{path}: bad entry {key!r}: {toks!r}")
            parsed = [known[t] if isinstance(t, str) and t in known else known.setdefault(t, parse_code_token(t))
                      for t in toks]
            if [lv for lv, _ in parsed] != list(range(len(parsed))):
                raise UserError(f"{path}: item {key}: code levels out of order: {toks}")
            mapping[int(key)] = tuple(c for _, c in parsed)
        lengths = {len(v) for v in mapping.values()}
        if len(lengths) != 1:
            raise UserError(f"{path}: items have ids of different lengths {sorted(lengths)}")
        top = max(max(v) for v in mapping.values())
        return cls.from_mapping(mapping, max(codebook_size, top + 1))

    def save(self, path: str | Path) -> None:
        out = {str(int(i)): self.tokens_of(int(i)) for i in self.item_ids}
        Path(path).write_text(json.dumps(out))
