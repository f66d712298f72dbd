"""Collaborative signal in the semantic ids (LETTER-style regularisation of the RQ-VAE).

"Learnable Item Tokenization for Generative Recommendation" (LETTER) observes that ids made from text alone put
items that read alike under one prefix even when users never buy them together, so the generative model must
learn every collaborative link code by code. It adds to the RQ-VAE's loss a contrastive term that pulls an
item's quantized latent (the sum of its codewords) towards its collaborative-filtering embedding and away from
the other items of the batch:

    L_cf = - 1/|B_cf| sum_{i in B_cf} log softmax_j( <zq_i, c_j> / tau )_i       (j over B_cf)

with zq_i and c_i unit-normalised, B_cf the batch's items that have a CF embedding, tau a temperature. The
total loss is recon + quant + cf_weight * L_cf; the codebooks (the forward value is the codeword sum) and,
through the straight-through estimator, the encoder receive its gradient. Items without interactions have no
CF embedding and contribute only to the text terms; they (and later catalog additions) get their ids from
their text, through the encoder that the CF term shaped.

The CF embeddings come from a fitted SASRec in recsvc's format (``item_ids`` [m], its item table
``model.item_emb.weight`` [m + 1, d] with row 0 padding, and ``item_counts`` [m], the interactions of its
period: what ``recsvc train sasrec``, ``recsvc eval``'s SASRec cache and BUNDLE/prior/sequence hold). A SASRec
has a row for every catalog item, but only the items of its period learnt theirs; the others count as
without a CF embedding. The rows are reduced to the RQ-VAE's latent size by PCA (fixed, no trainable
projection: checkpoints stay the RQ-VAE's own tensors), so the contrastive term compares like with like. Fit
the SASRec on the same period as the ids' ``--known-through`` or earlier: its embeddings must not know a
period the target is selected on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recsvc_base.errors import UserError


def load_cf_embeddings(path: str | Path, item_ids: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A SASRec file -> (embeddings [n, dim] float32 in ``item_ids``' order, unit rows; has [n] bool: the items
    the SASRec saw in its period). Rows of the others are zero. PCA to ``dim`` components (centred on the
    known items)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--cf-embeddings: file not found: {p}")
    try:
        t = load_file(str(p))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"--cf-embeddings: {p} is not a safetensors file ({exc})") from exc
    if "item_ids" not in t or "model.item_emb.weight" not in t:
        raise UserError(f"--cf-embeddings: {p} holds no SASRec item table (needs item_ids and "
                        "model.item_emb.weight, the format of recsvc's SASRec fits)")
    ids, table = t["item_ids"].astype(np.int64), t["model.item_emb.weight"].astype(np.float32)
    if table.ndim != 2 or table.shape[0] != len(ids) + 1:
        raise UserError(f"--cf-embeddings: {p}: item table {table.shape} does not match {len(ids)} item ids")
    # a SASRec has a row for every catalog item, but only items it saw in its period learnt theirs (the others
    # were only pushed down as negatives of the full softmax): they count as unknown
    counts = t.get("item_counts")
    seen = np.ones(len(ids), dtype=bool) if counts is None else np.asarray(counts).reshape(-1) > 0
    if seen.shape != (len(ids),):
        raise UserError(f"--cf-embeddings: {p}: item_counts does not match {len(ids)} item ids")
    row = {int(i): r + 1 for r, (i, ok) in enumerate(zip(ids.tolist(), seen.tolist(), strict=True)) if ok}
    has = np.array([int(i) in row for i in item_ids], dtype=bool)  # [n]
    if has.sum() < 2:
        raise UserError(f"--cf-embeddings: {p} knows {int(has.sum())} of the catalog's items; need at least 2")
    known = table[[row[int(i)] for i in np.asarray(item_ids)[has]]]  # [k, d]
    known = known - known.mean(0, keepdims=True)
    _, _, vt = np.linalg.svd(known, full_matrices=False)  # principal axes [min(k, d), d]
    reduced = known @ vt[:dim].T  # [k, <= dim]
    reduced /= np.maximum(np.linalg.norm(reduced, axis=1, keepdims=True), 1e-12)
    out = np.zeros((len(item_ids), dim), dtype=np.float32)
    out[has, : reduced.shape[1]] = reduced
    return out, has


def cf_alignment_loss(zq: torch.Tensor, cf: torch.Tensor, has: torch.Tensor, temperature: float) -> torch.Tensor:
    """zq [B, D] quantized latents, cf [B, D] unit CF embeddings, has [B] bool -> scalar InfoNCE over the batch's
    items with a CF embedding (0 when fewer than 2)."""
    if int(has.sum()) < 2:
        return zq.new_zeros(())
    a = F.normalize(zq[has], dim=1)  # [b, D]
    logits = a @ cf[has].T / temperature  # [b, b]
    return F.cross_entropy(logits, torch.arange(logits.shape[0], device=zq.device))
