"""Drafter alignment losses (AtSpeed sections 3.1-3.2; docs/DRAFTER_ALIGNMENT.md) on code-token log-probabilities.

Every method trains ``alpha * L_align + (1 - alpha) * L_rec``; L_rec is the next-item cross-entropy on the
ground-truth codes (``sft`` is L_rec alone). Shapes at the boundaries (P prefixes, S sequences, L = 4 positions,
C = 256 codes of the position's level)::

    lq       [P, S, L, C]  drafter log-probs: full-vocabulary log_softmax sliced to the level's C code tokens
    lp       [P, S, L, C]  target log-probs, same convention (the teacher data, ``training/drafters/teacher.py``)
    allowed  [P, S, L, C]  bool, codes the catalog trie allows after the sequence's first t codes
    codes    [P, S, L]     the sequence's codes; valid [P, S] bool (a catalog smaller than K has fewer beams)

Distributions per method (p: target, q: drafter), all per token and averaged over valid (prefix, sequence,
position) triples:

- ``wordkd``: KL(p || q) on the ground-truth prefixes, p and q renormalised over the level's 256 codes.
- ``tvdkd``: TVD(p, q) = 1/2 sum |p - q| on the ground-truth prefixes, same support.
- ``seqkd``: cross-entropy of q on the target's top-K sequences (L_rec on D').
- ``atspeed-s`` (constrained): V_c = the drafter's top-K codes among those the trie allows; per token
  ``sum_{v in V_c} q(v) [log q(v)/p(v) - log q(v)/p(y_K,t)] = sum_{v in V_c} q(v) log(p(y_K,t) / p(v))``
  with q renormalised over the trie-allowed codes (tokens outside the trie cannot lower the loss) and p the
  target's stored log-probs (the engine's beam-score convention, so ``p(y_K,t)``, the K-th sequence's token
  probability, compares like the verifier's scores). The paper sums over the K sequences; we average (a
  constant factor K, absorbed by alpha).
- ``atspeed-r`` (constrained): TVD between p and q both renormalised over V_c, on each of the top-K sequences.
  ``support="trie"`` is the paper's "w/o CA" ablation (Table 3): the TVD over every code the trie allows, which
  is the support relaxed verification samples from (its acceptance is 1 - TVD of the trie-masked distributions).

``code_logprobs_tree`` runs the drafter on a tree batch (``training.drafters.teacher.collate_tree``) and returns the
``lq`` of every (sequence, position) in one forward.
"""

from __future__ import annotations

import torch

from training.choices import METHODS, SUPPORTS

NEG_INF = float("-inf")
LOGP_FLOOR = -1.0e4  # stands in for log 0 where a finite number is needed


# ----------------------------------------------------------------------------------------- small helpers


def renormalise(logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[..., C] log-probs -> log-probs renormalised over ``mask`` (all C when None); -inf outside the mask."""
    if mask is not None:
        logp = torch.where(mask, logp, NEG_INF)
    lse = torch.logsumexp(logp, dim=-1, keepdim=True)
    return torch.where(torch.isfinite(logp), logp - lse, NEG_INF)


def masked_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``weight`` (same shape, bool or float) is set."""
    w = weight.to(values.dtype)
    return (torch.where(w > 0, values, 0.0) * w).sum() / w.sum().clamp(min=1.0)


def constrained_topk(lq: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """V_c: [..., C] bool mask of the drafter's ``k`` most likely codes among the allowed ones (all allowed
    codes when fewer than ``k``). Example: lq = log[.5, .3, .2], allowed = [F, T, T], k = 1 -> [F, T, F]."""
    scores = torch.where(allowed, lq, NEG_INF)
    top = torch.topk(scores, min(k, scores.shape[-1]), dim=-1).indices
    vc = torch.zeros_like(allowed).scatter_(-1, top, True)
    return vc & allowed


def _token_logprob(logp: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[..., C] log-probs, [...] codes (-1 = none) -> [...] log-prob of each code (0 where none)."""
    got = logp.gather(-1, codes.clamp(min=0).long()[..., None])[..., 0]
    return torch.where(codes >= 0, got, 0.0)


# ----------------------------------------------------------------------------------------- the losses


def rec_loss(lq_gt: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """L_rec: mean over prefixes and positions of -log q(gt code). lq_gt [P, L, C], gt [P, L]."""
    return -_token_logprob(lq_gt, gt).mean()


def wordkd_loss(lp_gt: torch.Tensor, lq_gt: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per token over the level's codes (both renormalised). [P, L, C] each -> scalar."""
    lp, lq = renormalise(lp_gt.float()), renormalise(lq_gt)
    p = lp.exp()
    kl = torch.where(p > 0, p * (lp - lq), 0.0).sum(-1)  # [P, L]
    return kl.mean()


def tvdkd_loss(lp_gt: torch.Tensor, lq_gt: torch.Tensor) -> torch.Tensor:
    """TVD(p, q) = 1/2 sum |p - q| per token over the level's codes (both renormalised) -> scalar."""
    p, q = renormalise(lp_gt.float()).exp(), renormalise(lq_gt).exp()
    return 0.5 * (p - q).abs().sum(-1).mean()


def seqkd_loss(lq: torch.Tensor, codes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the drafter on the target's top-K sequences. lq [P, K, L, C], codes [P, K, L]."""
    nll = -_token_logprob(lq, codes)  # [P, K, L]
    return masked_mean(nll, valid[..., None].expand_as(nll))


def kth_token_logprob(lp: torch.Tensor, codes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log p(y_K,t): the token log-prob of each prefix's K-th (= last valid) sequence. -> [P, L]."""
    last = (valid.long().sum(1) - 1).clamp(min=0)  # [P]
    rows = torch.arange(lp.shape[0], device=lp.device)
    return _token_logprob(lp[rows, last].float(), codes[rows, last])


def atspeed_s_loss(lq: torch.Tensor, lp: torch.Tensor, allowed: torch.Tensor, codes: torch.Tensor,
                   valid: torch.Tensor, k: int) -> torch.Tensor:
    """AtSpeed-S: reverse KL minus density regulariser over V_c = sum_{V_c} q(v) (log p(y_K,t) - log p(v))."""
    q_log = renormalise(lq, allowed)  # q restricted to the trie
    vc = constrained_topk(q_log, allowed, k)
    lp = lp.float().clamp(min=LOGP_FLOOR)  # fp16 may store -inf for vanishing probabilities
    thr = kth_token_logprob(lp, codes, valid)[:, None, :, None]  # [P, 1, L, 1]
    gap = thr - lp  # log p(y_K,t) - log p(v)
    per_token = torch.where(vc, q_log.exp() * torch.where(vc, gap, 0.0), 0.0).sum(-1)  # [P, K, L]
    return masked_mean(per_token, valid[..., None].expand_as(per_token))


def atspeed_r_loss(lq: torch.Tensor, lp: torch.Tensor, allowed: torch.Tensor, valid: torch.Tensor,
                   k: int, support: str = "topk") -> torch.Tensor:
    """AtSpeed-R: TVD(p', q') with p', q' renormalised over V_c (``support="topk"``) or over every trie-allowed
    code (``"trie"``), on each of the target's top-K sequences."""
    if support not in SUPPORTS:
        raise ValueError(f"unknown atspeed-r support {support!r}: expected one of {', '.join(SUPPORTS)}")
    vc = constrained_topk(lq, allowed, k) if support == "topk" else allowed
    p, q = renormalise(lp.float(), vc).exp(), renormalise(lq, vc).exp()
    per_token = 0.5 * (p - q).abs().sum(-1)  # [P, K, L]
    return masked_mean(per_token, valid[..., None].expand_as(per_token))


def method_loss(method: str, alpha: float, lq: torch.Tensor, lq_gt: torch.Tensor, batch: dict[str, torch.Tensor],
                k: int, support: str = "topk") -> tuple[torch.Tensor, dict[str, float]]:
    """alpha * L_align + (1 - alpha) * L_rec for ``method``. batch: the teacher tensors of ``collate_tree``
    (``lp`` [P, K, L, C], ``lp_gt`` [P, L, C], ``codes`` [P, K, L], ``gt`` [P, L], ``allowed`` [P, K, L, C],
    ``valid`` [P, K]). ``support``: atspeed-r's TVD support. Returns (loss, {"rec": .., "align": ..})."""
    rec = rec_loss(lq_gt, batch["gt"])
    if method == "sft":
        return rec, {"rec": float(rec.detach()), "align": 0.0}
    if method == "wordkd":
        align = wordkd_loss(batch["lp_gt"], lq_gt)
    elif method == "tvdkd":
        align = tvdkd_loss(batch["lp_gt"], lq_gt)
    elif method == "seqkd":
        align = seqkd_loss(lq, batch["codes"], batch["valid"])
    elif method == "atspeed-s":
        align = atspeed_s_loss(lq, batch["lp"], batch["allowed"], batch["codes"], batch["valid"], k)
    elif method == "atspeed-r":
        align = atspeed_r_loss(lq, batch["lp"], batch["allowed"], batch["valid"], k, support)
    else:
        raise ValueError(f"unknown drafter method {method!r}: expected one of {', '.join(METHODS)}")
    loss = alpha * align + (1.0 - alpha) * rec
    return loss, {"rec": float(rec.detach()), "align": float(align.detach())}


# ----------------------------------------------------------------------------------------- the drafter forward


def code_logprobs_tree(model, batch: dict[str, torch.Tensor], code_offset: int,
                       codebook: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter forward over a tree batch -> (lq [P, K, L, C] on the beams, lq_gt [P, L, C] on the truth).

    The batch lays every row out as [the prompt's last token, the tree's nodes, the rest of the prompt]
    with an explicit attention mask and position ids, so the outputs needed (the first 1 + n slots) are a
    prefix of the sequence: ``logits_to_keep`` computes the LM head only there. ``slot`` [P, K + 1, L] says
    which kept output predicts position t of sequence s (s = K: the ground truth); ``slot_level`` [P, n + 1]
    is the code level each kept output predicts."""
    keep = torch.arange(batch["slot_level"].shape[1], device=batch["input_ids"].device)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=keep)
    logp = torch.log_softmax(out.logits.float(), dim=-1)  # [P, n + 1, V]
    cols = code_offset + batch["slot_level"][..., None] * codebook + torch.arange(codebook, device=keep.device)
    per_slot = logp.gather(2, cols)  # [P, n + 1, C]
    p, s, length = batch["slot"].shape
    lq_all = per_slot.gather(1, batch["slot"].reshape(p, -1, 1).expand(-1, -1, codebook)).view(p, s, length, -1)
    return lq_all[:, :-1], lq_all[:, -1]
