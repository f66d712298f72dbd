"""Drafter alignment losses computed BY HAND on tiny literal distributions (C = 3 or 4 codes per level).

Conventions under test (training/drafters/losses.py): wordkd / tvdkd renormalise p and q over the level's codes;
atspeed-s renormalises q over the trie-allowed codes and uses the stored p as is; atspeed-r renormalises both
over V_c (the drafter's top-K allowed codes), or with support "trie" over every allowed code; the K-th
sequence is the last valid one.
"""

from __future__ import annotations

import math

import pytest
import torch

from training.drafters.losses import (
    atspeed_r_loss,
    atspeed_s_loss,
    constrained_topk,
    method_loss,
    rec_loss,
    seqkd_loss,
    tvdkd_loss,
    wordkd_loss,
)

L = torch.log
T = torch.tensor


def log(*probs: float) -> torch.Tensor:
    return L(T(probs))


# Two sequences (K = 2), one position (L = 1), C = 4 codes; the trie forbids code 3 at this position.
ALLOWED = T([[[[True, True, True, False]], [[True, True, True, False]]]])  # [P=1, K=2, L=1, C=4]
LQ = torch.stack([log(0.4, 0.3, 0.1, 0.2), log(0.1, 0.2, 0.6, 0.1)])[None, :, None]  # [1, 2, 1, 4]
LP = torch.stack([log(0.5, 0.2, 0.1, 0.2), log(0.3, 0.4, 0.1, 0.2)])[None, :, None]
CODES = T([[[0], [1]]])  # [1, 2, 1]: sequence 0 took code 0, sequence 1 (the K-th) code 1
BOTH = T([[True, True]])

# atspeed-s, k = 2. seq 0: q over allowed = [.5, .375, .125]; V_c = {0, 1}; p(y_K) = p(seq 1, code 1) = .4
#   .5 ln(.4/.5) + .375 ln(.4/.2) = 0.148365
# seq 1: q = [.1, .2, .6] / .9; V_c = {2, 1}: (.6/.9) ln(.4/.1) + (.2/.9) ln(.4/.4) = 0.924196
S_SEQ0 = 0.5 * math.log(0.4 / 0.5) + 0.375 * math.log(0.4 / 0.2)
S_SEQ1 = (0.6 / 0.9) * math.log(0.4 / 0.1)
# atspeed-r, k = 2. seq 0: V_c = {0, 1}: p' = [.5, .2]/.7, q' = [.4, .3]/.7 -> TVD = .1/.7
# seq 1: V_c = {2, 1}: p' = {1: .8, 2: .2}, q' = {1: .25, 2: .75} -> TVD = .55
R_SEQ0, R_SEQ1 = 0.1 / 0.7, 0.55
# atspeed-r, support "trie" (every allowed code, here {0, 1, 2}; k plays no part):
# seq 0: p' = [.5, .2, .1]/.8, q' = [.4, .3, .1]/.8 -> TVD = 1/2 (.1 + .1) / .8 = .125
# seq 1: p' = [.3, .4, .1]/.8 = [.375, .5, .125], q' = [.1, .2, .6]/.9 -> 1/2 (.375-1/9 + .5-2/9 + 2/3-.125)
RT_SEQ0 = 0.125
RT_SEQ1 = 0.5 * ((0.375 - 1 / 9) + (0.5 - 2 / 9) + (2 / 3 - 0.125))

CASES = [
    # (name, computed, by hand)
    ("wordkd: KL(p||q), p = [.5,.25,.25] (given unnormalised), q = [.25,.5,.25]",
     lambda: wordkd_loss(log(0.25, 0.125, 0.125)[None, None], log(0.25, 0.5, 0.25)[None, None]),
     0.5 * math.log(2) - 0.25 * math.log(2)),
    ("wordkd: identical distributions", lambda: wordkd_loss(log(0.2, 0.8)[None, None], log(0.2, 0.8)[None, None]),
     0.0),
    ("tvdkd: 1/2 (|.5-.25| + |.25-.5| + 0)",
     lambda: tvdkd_loss(log(0.25, 0.125, 0.125)[None, None], log(0.25, 0.5, 0.25)[None, None]), 0.25),
    ("tvdkd: two positions averaged (.3 and 0)",
     lambda: tvdkd_loss(torch.stack([log(0.8, 0.2), log(0.5, 0.5)])[None], torch.stack([log(0.5, 0.5),
                                                                                         log(0.5, 0.5)])[None]),
     0.15),
    ("rec: mean of -log q(gt) over positions", lambda: rec_loss(torch.stack([log(0.2, 0.8), log(0.5, 0.5)])[None],
                                                                T([[1, 0]])),
     -(math.log(0.8) + math.log(0.5)) / 2),
    ("seqkd: CE on valid sequences only", lambda: seqkd_loss(LQ, CODES, T([[True, False]])), -math.log(0.4)),
    ("seqkd: both sequences", lambda: seqkd_loss(LQ, CODES, BOTH), -(math.log(0.4) + math.log(0.2)) / 2),
    ("atspeed-s: k=2, two sequences", lambda: atspeed_s_loss(LQ, LP, ALLOWED, CODES, BOTH, 2),
     (S_SEQ0 + S_SEQ1) / 2),
    ("atspeed-s: k=1 (V_c = the drafter's argmax)", lambda: atspeed_s_loss(LQ, LP, ALLOWED, CODES, BOTH, 1),
     (0.5 * math.log(0.4 / 0.5) + (0.6 / 0.9) * math.log(0.4 / 0.1)) / 2),
    ("atspeed-s: K-th = last valid sequence (seq 0 alone, p(y_K) = .5)",
     lambda: atspeed_s_loss(LQ, LP, ALLOWED, CODES, T([[True, False]]), 2),
     0.5 * math.log(0.5 / 0.5) + 0.375 * math.log(0.5 / 0.2)),
    ("atspeed-r: k=2", lambda: atspeed_r_loss(LQ, LP, ALLOWED, BOTH, 2), (R_SEQ0 + R_SEQ1) / 2),
    ("atspeed-r: k=1 -> V_c has one code, TVD 0", lambda: atspeed_r_loss(LQ, LP, ALLOWED, BOTH, 1), 0.0),
    ("atspeed-r trie: all allowed codes", lambda: atspeed_r_loss(LQ, LP, ALLOWED, BOTH, 2, "trie"),
     (RT_SEQ0 + RT_SEQ1) / 2),
    ("atspeed-r trie: k does not matter", lambda: atspeed_r_loss(LQ, LP, ALLOWED, BOTH, 1, "trie"),
     (RT_SEQ0 + RT_SEQ1) / 2),
    ("mix: atspeed-r trie through method_loss",
     lambda: method_loss("atspeed-r", 0.3, LQ, LQ[:, 0], {"lp": LP, "allowed": ALLOWED, "valid": BOTH,
                                                         "gt": T([[2]]), "codes": CODES}, 2, "trie")[0],
     0.3 * (RT_SEQ0 + RT_SEQ1) / 2 + 0.7 * -math.log(0.1)),
    ("mix: alpha * atspeed-r + (1 - alpha) * rec",
     lambda: method_loss("atspeed-r", 0.3, LQ, LQ[:, 0], {"lp": LP, "allowed": ALLOWED, "valid": BOTH,
                                                         "gt": T([[2]]), "codes": CODES}, 2)[0],
     0.3 * (R_SEQ0 + R_SEQ1) / 2 + 0.7 * -math.log(0.1)),
    ("mix: sft is L_rec alone whatever alpha",
     lambda: method_loss("sft", 0.9, LQ, LQ[:, 0], {"gt": T([[0]])}, 2)[0], -math.log(0.4)),
]


@pytest.mark.parametrize("name,computed,expected", CASES, ids=[c[0].split(":")[0] + str(i) for i, c in
                                                               enumerate(CASES)])
def test_loss_by_hand(name: str, computed, expected: float) -> None:
    assert float(computed()) == pytest.approx(expected, abs=1e-5), name


def test_constrained_topk() -> None:
    lq = log(0.5, 0.3, 0.2)
    assert constrained_topk(lq, T([False, True, True]), 1).tolist() == [False, True, False]
    assert constrained_topk(lq, T([False, True, True]), 5).tolist() == [False, True, True]  # fewer than k


@pytest.mark.parametrize("which", ["atspeed-s", "atspeed-r", "atspeed-r-trie"])
def test_constrained_losses_ignore_tokens_outside_the_trie(which: str) -> None:
    """Any change of p or q on the forbidden code 3 leaves the loss and its gradient unchanged."""
    def run(lq_other: float, lp_other: float):
        lq = LQ.clone()
        lq[..., 3] = lq_other
        lp = LP.clone()
        lp[..., 3] = lp_other
        lq.requires_grad_(True)
        loss = (atspeed_s_loss(lq, lp, ALLOWED, CODES, BOTH, 2) if which == "atspeed-s"
                else atspeed_r_loss(lq, lp, ALLOWED, BOTH, 2, "trie" if which.endswith("trie") else "topk"))
        loss.backward()
        return float(loss.detach()), lq.grad[..., :3].clone(), lq.grad[..., 3].clone()

    base, grad, grad_out = run(math.log(0.2), math.log(0.2))
    for lq_other, lp_other in [(5.0, 0.0), (-20.0, 3.0), (0.0, float("-inf"))]:
        value, g, g_out = run(lq_other, lp_other)
        assert value == pytest.approx(base, abs=1e-6)
        torch.testing.assert_close(g, grad)
        assert torch.all(g_out == 0) and torch.all(grad_out == 0)
    # the unconstrained baselines do see code 3
    assert float(wordkd_loss(LP[:, 0], LQ[:, 0])) != pytest.approx(
        float(wordkd_loss(LP[:, 0], torch.cat([LQ[:, 0, :, :3], T([[[3.0]]])], -1))), abs=1e-3)


def test_atspeed_s_gradient_moves_q_towards_codes_the_target_ranks_above_the_kth() -> None:
    """In V_c, a code with p(v) > p(y_K,t) gains drafter mass, one with p(v) < p(y_K,t) loses it."""
    lq = LQ.clone().requires_grad_(True)
    atspeed_s_loss(lq, LP, ALLOWED, CODES, T([[True, True]]), 2).backward()
    g = lq.grad[0, 0, 0]  # sequence 0: p = [.5, .2, ...], threshold .4
    assert g[0] < 0 < g[1]  # descent raises code 0 (p .5 > .4), lowers code 1 (p .2 < .4)


def test_unknown_method() -> None:
    with pytest.raises(ValueError, match="unknown drafter method"):
        method_loss("nope", 0.5, LQ, LQ[:, 0], {"gt": T([[0]])}, 2)


def test_atspeed_r_support_is_checked() -> None:
    with pytest.raises(ValueError, match="support"):
        atspeed_r_loss(LQ, LP, ALLOWED, BOTH, 2, "vocab")
