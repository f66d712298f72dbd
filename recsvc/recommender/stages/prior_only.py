"""A bundle whose prior ranks alone (``recsvc tune mix`` found the fused target worse on validation): every
query of every mode gets the prior's ranking (``recsvc.recommender.prior_ranked``), no target forward."""

from __future__ import annotations

from collections.abc import Sequence

from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.recommender.api import RecQuery, RecResult
from recsvc.recommender.prior_ranked import prior_ranked, ranks_alone
from recsvc.recommender.stages.scope import Scope


class PriorOnly:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    @staticmethod
    def applies(scope: Scope) -> bool:
        return ranks_alone(scope.parts.prior)

    def __call__(self, queries: Sequence[RecQuery], ledger: Ledger = NO_LEDGER) -> list[RecResult]:
        prior = self.scope.parts.prior
        assert prior is not None
        return prior_ranked(prior, queries, self.scope.excluded(queries), self.scope.catalog)
