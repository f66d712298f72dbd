"""A learned content query: where in text-embedding space a user's next item lies, from the texts of the history.

The fresh-item component (``recsvc.content.fresh``) ranks items nobody has interacted with by the similarity of
their text embedding to a query made from the user's history. The plain query is the mean embedding of the last
items; it assumes the next item reads like the last ones. ``ContentQuery`` learns the query instead, from the
fitting period's interactions (``training/tuning/content_query.py``): which positions of the history count (a softmax
over positions), and two linear maps, one for the history and one for the candidates, trained so that the next
item scores highest among the period's items. Only text goes in, never an item's identity, so it ranks items
that had no interactions when it was fitted as well as any other (what a two-tower text model does for cold
items; the idea of text-based sequential recommenders such as UniSRec and Recformer, reduced to its smallest
form).

Shapes: ``position_logits`` [L] (index L-1 = the latest history item), ``query_weight`` and ``item_weight``
[d, d] (out x in, ``y = x @ W.T``). Inference is numpy; the file is safetensors with its fit in the metadata.

Worked example (L = 2, identity maps, equal position weights): history vectors [[1, 0], [0, 1]] -> query
(0.707, 0.707); candidates [1, 0] and [0.6, 0.8] score 0.707 and 0.990.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recsvc.errors import UserError


@dataclass(frozen=True)
class ContentQuery:
    position_logits: np.ndarray  # [L] float32
    query_weight: np.ndarray  # [d, d] float32
    item_weight: np.ndarray  # [d, d] float32
    fit: dict = field(default_factory=dict)  # how it was fitted (period, epochs, pairs, ...): provenance only

    def __post_init__(self) -> None:
        d = self.query_weight.shape[0] if self.query_weight.ndim == 2 else -1
        if (self.position_logits.ndim != 1 or not len(self.position_logits)
                or self.query_weight.shape != (d, d) or self.item_weight.shape != (d, d)):
            raise UserError(f"content query: bad shapes positions {self.position_logits.shape}, "
                            f"query {self.query_weight.shape}, item {self.item_weight.shape}")

    @property
    def length(self) -> int:
        """The most history items a query reads."""
        return len(self.position_logits)

    @property
    def dim(self) -> int:
        return int(self.query_weight.shape[0])

    def query(self, history_vectors: np.ndarray) -> np.ndarray:
        """history_vectors [n, d] (chronological, n >= 1; the last ``length`` are read) -> unit query [d]."""
        h = np.asarray(history_vectors, dtype=np.float32)[-self.length:]
        logits = self.position_logits[self.length - len(h):]
        a = np.exp(logits - logits.max())
        q = (a / a.sum()) @ h @ self.query_weight.T  # [d]
        return q / max(float(np.linalg.norm(q)), 1e-12)

    def items(self, vectors: np.ndarray) -> np.ndarray:
        """Candidate vectors [f, d] -> unit rows [f, d] in the query's space."""
        v = np.asarray(vectors, dtype=np.float32) @ self.item_weight.T
        norm = np.linalg.norm(v, axis=1, keepdims=True)
        return v / np.where(norm > 0, norm, 1.0)

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        save_file({"position_logits": self.position_logits.astype(np.float32),
                   "query_weight": self.query_weight.astype(np.float32),
                   "item_weight": self.item_weight.astype(np.float32)}, str(path),
                  metadata={"fit": json.dumps(self.fit)})

    @classmethod
    def load(cls, path: Path) -> ContentQuery:
        from safetensors import SafetensorError, safe_open
        from safetensors.numpy import load_file

        try:
            t = load_file(str(path))
            with safe_open(str(path), framework="numpy") as f:
                fit = json.loads((f.metadata() or {}).get("fit", "{}"))
            return cls(t["position_logits"], t["query_weight"], t["item_weight"], fit)
        except (OSError, KeyError, ValueError, SafetensorError) as exc:
            raise UserError(f"{path}: not a content-query file ({exc})") from exc
