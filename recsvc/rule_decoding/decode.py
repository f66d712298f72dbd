"""The list-level strategies behind one setting (``RuleSettings.strategy``; docs/RULES.md compares them):

- ``beam``: list-level beam search (``search.list_search``) ranked by score + reachable boost, no look-ahead;
- ``cdsl``: the same search with speculative look-aheads (the draft head completes the candidates, the rules
  score the drafted items, the target verifies the beams kept);
- ``cdlh``: the same search with full target look-aheads (every candidate rolled out by the target);
- ``postfilter``: a plain beam search of ``factor * k`` beams, then caps and boosts on its list.
The first three return exactly k items whenever the catalog holds k that fit the caps; post-filtering does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recsvc.drafters.head_model import DraftHead
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.errors import UserError
from recsvc.rule_decoding.lookahead import DraftLookahead, Lookahead, TargetLookahead
from recsvc.rule_decoding.search import list_search, rank_list
from recsvc.rules.catalog import BatchRules, RuleCatalog
from recsvc.rules.spec import DEFAULT_STRATEGY, LOOKAHEAD_WHEN, STRATEGIES, VERIFY_MODES


@dataclass(frozen=True)
class RuleSettings:
    strategy: str = DEFAULT_STRATEGY
    lookahead: int = 0  # M: candidates completed per depth by cdsl / cdlh (0: 2 * the beam width)
    verify: str = "beams"  # cdsl: "beams" (the target scores the kept beams) or "paths" (every drafted path)
    corrections: int | None = 0  # cdsl "paths": target forwards that may follow the target off a drafted path
    factor: int = 4  # postfilter: beams searched per item returned
    lookahead_when: str = "needed"  # cdsl / cdlh: "needed" (where caps keep extra beams) or "always" (every depth)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UserError(f"rules strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if (self.lookahead < 0 or self.factor < 1 or self.verify not in VERIFY_MODES
                or self.lookahead_when not in LOOKAHEAD_WHEN
                or (self.corrections is not None and self.corrections < 0)):
            raise UserError(f"invalid rules settings {self}")


@dataclass(frozen=True)
class RulesOutput:
    rows: torch.Tensor  # [B, k] catalog rows best first (catalog.n: fewer items)
    scores: torch.Tensor  # [B, k] target score + boosts
    target_calls: list[int]  # per request
    draft_steps: int  # draft-head steps (cdsl)


# (width) -> (leaves [B, width], scores [B, width], target calls per request): the recommender's own decoding
WideSearch = Callable[[int], tuple[torch.Tensor, torch.Tensor, list[int]]]


def decode_rules(settings: RuleSettings, target: EngineModel, catalog: RuleCatalog, code_offset: int,
                 prompts: PromptBatch, k: int, width: int, rules: BatchRules, prior: torch.Tensor | None,
                 head: DraftHead | None, wide: WideSearch, ledger: Ledger = NO_LEDGER) -> RulesOutput:
    """One batch of requests with list-level rules, decoded by ``settings.strategy``."""
    if settings.strategy == "postfilter":
        leaves, scores, calls = wide(settings.factor * k)
        rows, adj = rank_list(leaves, scores, k, rules, catalog)
        return RulesOutput(rows, adj, calls, 0)
    m = settings.lookahead or 2 * width
    lookahead: Lookahead | None = None
    if settings.strategy == "cdlh":
        lookahead = TargetLookahead(target, rules, prior, m)
    elif settings.strategy == "cdsl":
        if head is None:
            raise UserError("rules strategy cdsl needs a recurrent draft head (BUNDLE/head: `recsvc train head`)")
        lookahead = DraftLookahead(target, head, rules, prior, m, settings.verify, settings.corrections)
    out = list_search(target, catalog, code_offset, prompts, k, width, rules, prior, lookahead, ledger,
                      lookahead_always=settings.lookahead_when == "always")
    steps = lookahead.head_steps if isinstance(lookahead, DraftLookahead) else 0
    return RulesOutput(out.rows, out.scores, out.target_calls.tolist(), steps)
