"""Baselines for ``recsvc eval``, fitted and scored with the model's protocol, users and metric code.

- ``popularity``: interaction counts of the fit period (``popularity.py``);
- ``transition`` / ``transition-window``: last-item(s) transition counts with popularity back-off
  (``transition.py``, over ``recsvc.priors.transition.TransitionPrior``);
- ``sasrec``: a self-attentive sequential recommender trained with full-softmax cross-entropy
  (``recsvc/priors/sasrec.py`` the network, ``sasrec_train.py`` the loop, ``sasrec.py`` fit / rank / cache);
- the served prior alone as a ranker (``prior_alone.py``: the transition baselines rank with it too).

Protocols and fit periods: ``base.py``; by name: ``registry.py``. Evaluation fits and scores them beside the model
(``training/evaluation/baselines.py``).
"""

from training.baselines.base import FIT_PERIODS, PROTOCOLS, Baseline, fit_period, fit_sequences
from training.baselines.registry import BASELINES, DEFAULT_BASELINES, fit_baseline, parse_baselines

__all__ = ["BASELINES", "DEFAULT_BASELINES", "FIT_PERIODS", "PROTOCOLS", "Baseline", "fit_baseline", "fit_period",
           "fit_sequences", "parse_baselines"]
