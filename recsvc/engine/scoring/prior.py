"""An item prior fused into trie-constrained beam search, exactly, one code at a time (docs/PRIOR_FUSION.md).

Beam search scores an item y = (c1, .., cL) with the target's code log-probs, sum_t log p(c_t | c_<t). A prior
P(item | history) (e.g. ``recsvc.priors.transition.TransitionPrior``) is defined on whole items, but beam search
prunes after every code, so the prior must be split into per-code terms that add up to the item's log P.
The trie does that: let the mass of a node be the prior probability of the items under it,

    m(node) = sum_{items i under node} P(i) / sum_i P(i)      (m(root) = 1; a collided leaf adds its items)

and add, when a beam steps from node n to its child c, the bias  w * (log m(c) - log m(n)).  The L biases of an
item telescope to w * log m(leaf) = w * log P(item), so a finished beam's score is exactly the fused score
sum_t log p(c_t | c_<t) + w * log P(item), and an unfinished beam's score carries w * log m(prefix): the prior
mass of everything it can still become (the prefix's share, which is what a step-wise search can rank it by).

``prior_log_mass`` returns w * log m(node) for every trie node, per request: [B, num_nodes]; the engine adds
``prior[row, child] - prior[row, node]`` to each allowed candidate (``expand_beams``, ``tempered_logp``).

Worked example (the trie of ``tokenizer_rqvae.trie``: items 7 = (1, 2), 8 = (1, 3), 9 = (2, 0); nodes 0 root,
1 = (1,), 2 = (2,), leaves 3, 4, 5) with P = [0.5, 0.3, 0.2] over items 7, 8, 9 and w = 1::

    m = [1.0, 0.8, 0.2, 0.5, 0.3, 0.2]         log m = [0, -0.223, -1.609, -0.693, -1.204, -1.609]
    item 8: root -> 1 -> 4: (log 0.8 - log 1) + (log 0.3 - log 0.8) = log 0.3        (= w * log P(8))

Nodes of zero mass get -inf: with w > 0 the prior then rules their items out (a prior with popularity
back-off, like the transition prior with beta > 0, gives every item some mass).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from tokenizer_rqvae.trie import CatalogTrie


def prior_log_mass(trie: CatalogTrie, probs: torch.Tensor | np.ndarray, weight: float) -> torch.Tensor:
    """[B, n] item probabilities (rows in the catalog's item-row order, ``trie.ids.item_ids``; need not be
    normalised) -> [B, num_nodes] float32 ``weight * log(m(node) / m(root))``; 0 at the root.

    ``weight == 0`` gives zeros (fusion off: adding it changes no score); a request whose probabilities are
    all zero gets zeros too (no information). Masses are accumulated with one ``scatter_add_`` over the items'
    root-to-leaf paths (``trie.item_path``), so items sharing a collided leaf add up. float32 throughout: a
    node's mass sums its own items only (no cancellation), ~0.4 ms per request for a 12k-item catalog on a CPU.
    The result lives on the trie's device (``CatalogTrie.to``: the model's), ``probs`` are moved there once."""
    dev = trie.device
    checked = isinstance(probs, np.ndarray)
    if checked:  # host probabilities (the priors' ``probs``): checked here, so the device is never read
        _check_host(np.asarray(probs, dtype=np.float32))
    probs = torch.as_tensor(probs, device=dev)
    if probs.ndim != 2 or probs.shape[1] != trie.item_path.shape[0]:
        raise ValueError(f"probs must be [B, {trie.item_path.shape[0]}] (one column per catalog item), "
                         f"got {tuple(probs.shape)}")
    if weight < 0 or not np.isfinite(weight):
        raise ValueError(f"prior weight must be finite and >= 0, got {weight}")
    b = probs.shape[0]
    if weight == 0:
        return torch.zeros(b, trie.num_nodes, device=dev)
    p = probs.to(torch.float32)
    mass = torch.zeros(b, trie.num_nodes, device=dev)
    # every item adds its probability to each node of its path, the root included (depth-major: [(L+1) * n])
    mass.scatter_add_(1, _path_index(trie).expand(b, -1), torch.cat([p] * trie.item_path.shape[1], 1))
    total = mass[:, :1].clone()  # [B, 1] the root's mass
    # a tensor's check is one host read: negative probabilities, or a non-finite sum (finite sums: finite p)
    if not checked and b and p.numel() and bool((p.min() < 0) | ~torch.isfinite(total.max())):
        raise ValueError(_INVALID)
    empty = total <= 0  # rows without information: no bias (no read: applied to every row)
    mass, total = torch.where(empty, 1.0, mass), torch.where(empty, 1.0, total)
    log_m = mass.div_(total).log_()
    return log_m if weight == 1 else log_m.mul_(weight)


_INVALID = "prior probabilities must be finite and >= 0"


def _check_host(p: np.ndarray) -> None:
    """``prior_log_mass``'s check of host probabilities [B, n] (float32, as on the device): no negative value, every
    row's sum finite."""
    if p.size and p.ndim == 2 and ((p.min() < 0) or not np.isfinite(p.sum(axis=1, dtype=np.float32)).all()):
        raise ValueError(_INVALID)


_PATH_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _path_index(trie: CatalogTrie) -> torch.Tensor:
    """[1, (L+1) * n] the nodes of every item's path, depth-major (cached per trie)."""
    idx = _PATH_INDEX.get(trie)
    if idx is None:
        idx = trie.item_path.T.reshape(1, -1).contiguous()
        _PATH_INDEX[trie] = idx
    return idx


def step_bias(prior: torch.Tensor, nodes: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
    """The prior's term of each candidate step: prior[row, child] - prior[row, node].

    prior [B, num_nodes]; nodes [B, m] (-1 = dead beam); child [B, m, C] (-1 = no child) -> [B, m, C]
    (values at absent children / dead beams are meaningless: the callers mask them)."""
    b, m, c = child.shape
    at_child = prior.gather(1, child.reshape(b, m * c).clamp(min=0)).view(b, m, c)
    at_node = prior.gather(1, nodes.clamp(min=0))  # [B, m]
    return at_child - at_node[..., None]
