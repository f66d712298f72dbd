"""Shared helpers for the live-catalog tests (no tests here): a tiny real bundle with a fused transition prior,
item attributes and a fresh-item component (BUNDLE/fresh, one tail slot), and live-catalog documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from test_drafter_fixtures import tiny_bundle

from recsvc.bundle.directory import Bundle
from recsvc.content.fresh import FreshItems, FreshSettings, ItemVectors
from recsvc.data.split import load_split_dir
from recsvc.priors.transition import PriorSettings, TransitionPrior
from recsvc.rules.attributes import ItemAttributes
from tokenizer_rqvae.ids import SemanticIds

DIM = 8  # the fresh component's vector length
NEW = 1001  # the id of the first added item (above the synthetic catalog's 1..60)


def live_bundle(root: Path, n_users: int = 40, mixed: bool = False) -> Path:
    """tiny_bundle + BUNDLE/prior (weight 0.5) + BUNDLE/attributes.json (brand) + BUNDLE/fresh (random
    unit vectors per item, no fresh items yet, 1 tail slot at cosine >= 0.9 to the last history item).
    ``mixed``: the prior mixed with a (random, tiny) SASRec, as the recipe's bundles are (``recsvc tune mix``)."""
    path = tiny_bundle(root, n_users=n_users)
    bundle = Bundle.open(path)
    data = load_split_dir(bundle.resolve_data_dir())
    items = bundle.load_ids().item_ids.tolist()
    transition = TransitionPrior.fit(data.train.values(), items, PriorSettings(weight=0.5))
    if mixed:
        import torch

        from recsvc.priors.mixed import MixedPrior, MixSettings, SequenceModel
        from recsvc.priors.sasrec import SASRec
        from training.baselines.sasrec import SASRecBaseline
        from training.baselines.sasrec_train import SASRecSettings

        torch.manual_seed(0)
        arch = SASRecSettings(hidden=8, blocks=1, heads=1, max_len=10)
        seq_dir = SASRecBaseline(SASRec(len(items), hidden=8, blocks=1, heads=1, max_len=10),
                                 torch.tensor(items), torch.ones(len(items)), arch).save(root / "sasrec")
        MixedPrior(transition, SequenceModel.load(seq_dir), MixSettings(0.5, 1.0)).save(bundle.prior_dir, seq_dir)
    else:
        transition.save(bundle.prior_dir)
    ItemAttributes.from_items({i: {"brand": "acme" if i % 2 else "kirra"} for i in items}).save(
        path / "attributes.json")
    vecs = ItemVectors.from_arrays(items, np.random.default_rng(0).normal(size=(len(items), DIM)))
    FreshItems(vecs, [], FreshSettings(slots=1, window=1, min_similarity=0.9)).save(bundle.fresh_dir)
    return path


def vector_of(bundle: Path, item: int) -> list[float]:
    """The stored text vector of a bundle item (BUNDLE/fresh)."""
    fresh = FreshItems.load(Bundle.open(bundle).fresh_dir)
    return fresh.vectors.vectors[fresh.vectors.rows([item])][0].tolist()


def free_codes(ids: SemanticIds, n: int, seed: int = 1) -> list[list[int]]:
    """n distinct 4-code ids no item of ``ids`` has."""
    taken = {tuple(r) for r in ids.codes.tolist()}
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    while len(out) < n:
        row = tuple(int(c) for c in rng.integers(0, 256, size=4))
        if row not in taken:
            taken.add(row)
            out.append(list(row))
    return out


def add_entry(item: int, codes: list[int], vector: list[float]) -> dict[str, Any]:
    return {"item_id": item, "codes": codes, "vector": vector}
