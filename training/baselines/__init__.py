"""Baselines for ``recsvc eval``, fitted and scored with the model's protocol, users and metric code.

- ``popularity``: interaction counts of the fit period (``popularity.py``);
- ``transition`` / ``transition-window``: last-item(s) transition counts with popularity back-off
  (``transition.py``, over ``recsvc.priors.transition.TransitionPrior``);
- ``sasrec``: a self-attentive sequential recommender trained with full-softmax cross-entropy
  (``recsvc/priors/sasrec.py`` the network, ``sasrec_train.py`` the loop, ``sasrec.py`` fit / rank / cache).

Protocols and fit periods: ``base.py``; by name: ``registry.py``; the report beside the model: ``report.py``.
"""

from training.baselines.base import FIT_PERIODS, PROTOCOLS, Baseline, fit_period, fit_sequences
from training.baselines.registry import BASELINES, DEFAULT_BASELINES, fit_baseline, parse_baselines
from training.baselines.report import evaluate_baselines, format_table

__all__ = ["BASELINES", "DEFAULT_BASELINES", "FIT_PERIODS", "PROTOCOLS", "Baseline", "evaluate_baselines",
           "fit_baseline", "fit_period", "fit_sequences", "format_table", "parse_baselines"]
