"""Item-transition baselines: "what came right after the user's last item(s)", backed off to popularity.

Both wrap ``recsvc.priors.transition.TransitionPrior`` (the counts the engine can also fuse into beam search),
fitted on the consecutive pairs of the fit-period sequences:

    P(j | h)   = sum_{t < W} d^t * P_1(j | h[-1-t]) / sum_{t < W} d^t
    P_1(j | i) = (count(i -> j) + beta * pop(j)) / (count(i -> *) + beta)
    pop(j)     = (count(j) + 1) / (N + n)

- ``transition``: W = 1, beta = 1 (the last item alone; an unseen last item falls back to popularity);
- ``transition-window``: W = 3, d = 0.3, beta = 0.3 (the last three items vote, the most recent the most).

Under ``deploy`` the fit sequences are train followed by valid, so a train -> valid boundary pair counts too.
"""

from __future__ import annotations

from collections.abc import Sequence

from recsvc.data.split import EvalUser, SplitData
from recsvc.priors.transition import PriorSettings, TransitionPrior
from training.baselines.base import Baseline, check_fit_on, fit_sequences
from training.baselines.prior_alone import prior_rankings

TRANSITION_SETTINGS: dict[str, PriorSettings] = {
    "transition": PriorSettings(window=1, beta=1.0),
    "transition-window": PriorSettings(window=3, decay=0.3, beta=0.3),
}


class TransitionBaseline(Baseline):
    def __init__(self, name: str, prior: TransitionPrior, fit_on: str = "train") -> None:
        super().__init__()
        self.name = name
        self.prior = prior
        self.fit_on = check_fit_on(fit_on)
        s = prior.settings
        self.info = {"window": s.window, "decay": s.decay, "beta": s.beta,
                     "transitions": int(prior.counts.sum()), "pairs": len(prior.counts)}

    @classmethod
    def fit(cls, name: str, data: SplitData, fit_on: str = "train",
            settings: PriorSettings | None = None) -> TransitionBaseline:
        settings = settings or TRANSITION_SETTINGS[name]
        seqs = fit_sequences(data, fit_on)
        prior = TransitionPrior.fit((seqs[u] for u in sorted(seqs)), sorted(data.items), settings, fitted_on=fit_on)
        return cls(name, prior, fit_on)

    def rank(self, users: Sequence[EvalUser], k: int, exclude_history: bool = False) -> dict[int, list[int]]:
        return prior_rankings(self.prior, users, k, exclude_history)
