"""The served engine configuration: one set of flags, one frozen ``ServeSettings``, one constructor.

``recsvc serve`` and every bench that claims to measure the server (``recsvc bench serve``, ``recsvc bench
processes``) register the engine flags with :func:`add_engine_args`, resolve them with
:meth:`ServeSettings.from_args` and build the recommender with :func:`build_recommender` (``bench processes``
passes :meth:`ServeSettings.argv` to the ``recsvc serve`` it starts). Their defaults therefore cannot drift: a
bench measures the beam width, speculation policy and precision that the server serves, and records them
(:meth:`ServeSettings.describe`, :func:`engine_fields`).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from recsvc.bundle.directory import DEFAULT_BEAM_WIDTH  # the service's default width (re-exported)
from recsvc.engine.kernels.plan import ATTENTIONS, FORWARD_NAMES, check_flags, forward_help
from recsvc.errors import UserError
from recsvc.recommender.api import MODES, Mode, Recommender
from recsvc.rules.spec import DEFAULT_STRATEGY, STRATEGIES
from recsvc.service.arg_types import add_history_flags, positive_float
from recsvc.service.observability.logs import Step, log_step

from .calibration import calibrate_speculation, calibration_clock, torch_threads

if TYPE_CHECKING:
    from recsvc.recommender.bundle_recommender import BundleRecommender

MAX_BEAM_WIDTH = 100


def spec_policy(text: str) -> str:
    """argparse type of --spec: 'auto', 'off' or N:gamma (N >= 1, gamma 1..5)."""
    n, sep, gamma = text.partition(":")
    if text in ("auto", "off") or (sep and n.isdigit() and gamma.isdigit() and int(n) >= 1 and 1 <= int(gamma) <= 5):
        return text
    raise argparse.ArgumentTypeError(f"'auto', 'off' or N:gamma (N >= 1, gamma 1..5) expected, got {text!r}")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags that decide what the served engine computes (``--bundle`` is the caller's)."""
    p.add_argument("--dtype", default="auto",
                   help="engine dtype: auto (bf16 where the hardware has it, else fp32), bf16, fp32")
    p.add_argument("--attention", choices=ATTENTIONS, default="fp32",
                   help="engine attention: fp32 (fast) or exact (bit-identical to transformers generate)")
    p.add_argument("--forward", default="auto", choices=FORWARD_NAMES, help=forward_help())
    p.add_argument("--count-host-reads", type=int, default=0, metavar="N",
                   help="count the device-to-host reads of every N-th engine call (0: off; the count costs a "
                        "Python call per torch call): RecStats.host_reads, metric recsvc_host_reads")
    p.add_argument("--state-cache-mb", type=int, default=256,
                   help="user-state cache budget in MiB: a returning user's prompt KV is reused (fast forward "
                        "only; 0 = off; docs/SCALING.md)")
    p.add_argument("--prefill-ahead", action="store_true",
                   help="after a RecordInteractions, compute the user's next plain request (prompt and decode "
                        "steps at the served --beam-width; the prompt only without one) when the engine is idle "
                        "(needs the state cache; the write is acknowledged first)")
    p.add_argument("--drafter", dest="drafter_name", default=None,
                   help="drafter to speculate with: a name under BUNDLE/drafters/ (`recsvc train drafter "
                        "--out-name NAME`), a model directory, `llama` (BUNDLE/drafter), `transition` "
                        "(training-free, from BUNDLE/prior) or "
                        "`head` / `head:NAME` (the recurrent draft head BUNDLE/head or BUNDLE/heads/NAME, "
                        "`recsvc train head`); default: BUNDLE/head, else BUNDLE/drafter)")
    add_history_flags(p, "never recommend a user's history items, on every request (default: what validation "
                         "chose for the bundle, bundle.json 'exclude_history' from `recsvc tune history`, else only "
                         "requests that ask)",
                      "history items may be recommended unless a request asks otherwise (overrides the bundle's "
                      "choice)")
    p.add_argument("--beam-width", type=int, default=None,
                   help="beams searched per plain / strict request, B >= k; the first k are returned, so top-5 is "
                        f"the head of top-10 (default: bundle.json 'beam_width', else {DEFAULT_BEAM_WIDTH}; "
                        "0 = k beams)")
    p.add_argument("--no-prior", action="store_true",
                   help="do not fuse the bundle's transition prior (BUNDLE/prior) into decoding")
    p.add_argument("--no-fresh", action="store_true",
                   help="do not give fresh items (no interactions yet) the tail slots chosen by `recsvc tune fresh` "
                        "(BUNDLE/fresh)")
    p.add_argument("--attributes", default=None,
                   help="item attributes for request rules (default: BUNDLE/attributes.json when present, made by "
                        "`recsvc bundle attributes`); re-read while serving whenever the file changes")
    p.add_argument("--rules-strategy", choices=STRATEGIES, default=DEFAULT_STRATEGY,
                   help="how caps and boosts are decoded (docs/RULES.md; default: %(default)s)")
    p.add_argument("--default-mode", choices=MODES, default="strict", help="mode for UNSPECIFIED requests")
    p.add_argument("--spec", type=spec_policy, default="auto",
                   help="speculation settings: 'auto' (measure (N, gamma) per K at start-up), N:gamma, or 'off' "
                        "(no calibration; strict requests are decoded plainly)")
    p.add_argument("--recalibrate", action="store_true",
                   help="--spec auto: calibrate even when BUNDLE/calibration.json holds a choice made on this "
                        "hardware with these models and settings (it is reused otherwise)")
    p.add_argument("--startup-budget-s", type=positive_float, default=60.0,
                   help="longest --spec auto calibration; K values not tuned in time are served with plain "
                        "decoding (default: %(default)s)")


def check_beam_width(width: int) -> int:
    if not 0 <= width <= MAX_BEAM_WIDTH:
        raise UserError(f"--beam-width must lie in 0..{MAX_BEAM_WIDTH} (0 = k), got {width}")
    return width


@dataclass(frozen=True)
class ServeSettings:
    """What the served engine is: built by :func:`build_recommender`, recorded by benches. Construct it with
    :meth:`from_args` (or :meth:`for_bundle`), never field by field: the flags hold the defaults."""

    bundle: str
    beam_width: int  # resolved: --beam-width, else bundle.json "beam_width", else DEFAULT_BEAM_WIDTH (0 = k)
    default_mode: Mode  # the mode of UNSPECIFIED requests
    spec: str  # speculation policy: auto (calibrated per K at start-up), off, or N:gamma
    dtype: str  # as asked ("auto" resolves per host: ``engine_fields`` reports the precision used)
    attention: str
    drafter: str | None  # None: BUNDLE/head, else BUNDLE/drafter
    prior: bool
    exclude_history: bool  # resolved: the flags, else the bundle's choice (``Bundle.serves_excluding_history``)
    attributes: str | None
    rules_strategy: str
    startup_budget_s: float
    recalibrate: bool
    fresh: bool = True  # BUNDLE/fresh's tail slots (when the bundle has them)
    forward: str = "auto"  # the engine forward, a --forward value (recsvc.engine.kernels.plan.FORWARDS)
    state_cache_mb: int = 256  # the user-state cache budget (0: off)
    prefill_ahead: bool = False  # a user's prefill after a write, when the engine is idle
    count_host_reads: int = 0  # every N-th engine call's device-to-host reads counted (0: off)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        """From the flags of :func:`add_engine_args` and ``args.bundle``; UserError for a bad beam width or
        contradictory forward flags (``recsvc.engine.kernels.plan.check_flags``; the rest of the plan is resolved for
        the loaded model's device)."""
        from recsvc.bundle.directory import Bundle

        check_flags(args.forward, args.attention)
        bundle = Bundle.open(args.bundle)
        width = args.beam_width if args.beam_width is not None else bundle.served_beam_width()
        exclude = bundle.excludes_history(args.exclude_history)
        return cls(bundle=str(args.bundle), beam_width=check_beam_width(width), default_mode=args.default_mode,
                   spec=args.spec, dtype=args.dtype, attention=args.attention, drafter=args.drafter_name,
                   prior=not args.no_prior, exclude_history=exclude, attributes=args.attributes,
                   rules_strategy=args.rules_strategy, startup_budget_s=args.startup_budget_s,
                   recalibrate=args.recalibrate, fresh=not args.no_fresh, forward=args.forward,
                   state_cache_mb=args.state_cache_mb, prefill_ahead=args.prefill_ahead,
                   count_host_reads=args.count_host_reads)

    @classmethod
    def for_bundle(cls, bundle: str, flags: list[str] | None = None) -> ServeSettings:
        """``recsvc serve --bundle BUNDLE [flags]``'s settings (``flags``: engine flags only)."""
        parser = argparse.ArgumentParser(prog="recsvc serve", add_help=False)
        add_engine_args(parser)
        args = parser.parse_args(flags or [])
        args.bundle = bundle
        return cls.from_args(args)

    def argv(self) -> list[str]:
        """The ``recsvc serve`` flags that give these settings (the beam width explicit, as resolved)."""
        out = ["--dtype", self.dtype, "--attention", self.attention, "--beam-width", str(self.beam_width),
               "--rules-strategy", self.rules_strategy, "--default-mode", self.default_mode, "--spec", self.spec,
               "--startup-budget-s", str(self.startup_budget_s)]
        if self.drafter:
            out += ["--drafter", self.drafter]
        if not self.prior:
            out.append("--no-prior")
        out.append("--exclude-history" if self.exclude_history else "--keep-history")
        if self.attributes:
            out += ["--attributes", self.attributes]
        if self.recalibrate:
            out.append("--recalibrate")
        if not self.fresh:
            out.append("--no-fresh")
        out += ["--forward", self.forward, "--state-cache-mb", str(self.state_cache_mb)]
        if self.prefill_ahead:
            out.append("--prefill-ahead")
        if self.count_host_reads:
            out += ["--count-host-reads", str(self.count_host_reads)]
        return out

    def describe(self) -> dict[str, Any]:
        """JSON for a report: every setting (beam width, mode policy: default mode and spec, precision asked)."""
        return asdict(self)

    def calibration_settings(self, beam_width: int, torch_threads: int) -> dict[str, Any]:
        """What a stored --spec auto calibration depends on besides hardware and model files (the key of
        ``recsvc.service.startup.calibration_cache``; with the beam widths calibrated)."""
        return {"dtype": self.dtype, "attention": self.attention, "drafter": self.drafter, "prior": self.prior,
                "beam_width": beam_width, "exclude_history": self.exclude_history, "torch_threads": torch_threads}


def engine_fields(rec: Recommender) -> dict[str, Any]:
    """What the loaded engine resolved (``Recommender.facts``) as JSON: precision, beam width, drafter loaded,
    prior weight, fresh slots and the speculation choice per beam width ({width: [N, gamma]}, [0, 0] = plain
    decoding; None: fixed N:gamma or no drafter)."""
    facts = rec.facts
    per_width = facts.speculation_per_width
    return {"precision": facts.precision, "beam_width": facts.beam_width, "drafter_loaded": facts.drafter_loaded,
            "prior_weight": facts.prior_weight, "fresh_slots": facts.fresh_slots,
            "speculation_per_width": {str(w): list(v) for w, v in sorted((per_width or {}).items())} or None}


def warn_missing_serving_files(bundle: str, step: Step) -> list[str]:
    """The one warning at load for a bundle made before it held its serving files
    (``recsvc.bundle.serving_files``): what is missing and what serves instead. Returns the missing names."""
    from recsvc.bundle.serving_files import CALIBRATION_FILE, POPULARITY_FILE, missing_serving_files

    missing = missing_serving_files(bundle)
    if missing:
        instead = {POPULARITY_FILE: "popular items (no-history requests) in item-id order",
                   CALIBRATION_FILE: "--spec auto calibrated on popular items"}
        step("bundle_without_serving_files", logging.WARNING, bundle=bundle, missing=missing,
             reason="the bundle was made before bundles held what serving reads; its training data is not read",
             serving="; ".join(instead[m] for m in missing),
             fix=f"recsvc bundle serving-files --bundle {bundle} --data DATA_DIR")
    return missing


def timeline_steps(settings: ServeSettings, step: Step) -> None:
    """What start-up does not do for an items bundle, said: no forward to compile and no speculation to calibrate
    (its item-level target runs its own forward and has no drafter: every mode is decoded plainly, whatever
    ``--spec`` asks); ``--forward`` / ``--attention`` values other than the defaults are named as not applied."""
    from recsvc.recommender.stages.timeline_decode import NO_DRAFTER

    ignored = ([f"--forward {settings.forward}"] if settings.forward != "auto" else []) + (
        [f"--attention {settings.attention}"] if settings.attention != "fp32" else [])
    fields: dict[str, Any] = {"flags_not_applied": ignored} if ignored else {}
    step("speculation_off", reason=f"{NO_DRAFTER}: speculation off (--spec {settings.spec})",
         serving="plain decoding for every K", forward_compiled=False, speculation_calibrated=False, **fields)


def build_recommender(settings: ServeSettings, *, step: Step | None = None,
                      should_stop: Callable[[], bool] | None = None) -> BundleRecommender:
    """The served ``BundleRecommender``, built once from ``settings``: loaded with its forward, its speculation
    chosen (--spec: ``calibrate_speculation``), then the served one built with that choice, its user-state cache
    and prefill-ahead; nobody changes it afterwards. Each step is reported through ``step(event, level=INFO,
    **fields)`` (default: the JSON log)."""
    from recsvc.rule_decoding.decode import RuleSettings

    step = step or log_step
    try:
        from recsvc.recommender.bundle_recommender import BundleRecommender
        from recsvc.recommender.settings import read_sampler_for, state_cache_for
    except ImportError as exc:
        raise UserError(f"the model engine is not available (recsvc.recommender.bundle_recommender): {exc}") from exc
    if settings.state_cache_mb < 0:
        raise UserError(f"--state-cache-mb must be >= 0, got {settings.state_cache_mb}")
    started = time.monotonic()
    step("loading_models", bundle=settings.bundle, dtype=settings.dtype, attention=settings.attention,
         drafter=settings.drafter or "default", prior=settings.prior)
    loaded = BundleRecommender.from_bundle(settings.bundle, dtype=settings.dtype, attention=settings.attention,
                                           drafter_name=settings.drafter, use_prior=settings.prior,
                                           exclude_history=settings.exclude_history, beam_width=settings.beam_width,
                                           attributes=settings.attributes,
                                           rules=RuleSettings(strategy=settings.rules_strategy),
                                           use_fresh=settings.fresh, forward=settings.forward)
    facts = loaded.facts
    warn_missing_serving_files(settings.bundle, step)
    step("models_loaded", seconds=round(time.monotonic() - started, 3), drafter=facts.drafter_loaded,
         prior_weight=facts.prior_weight, precision=facts.precision)
    if loaded.prior is not None and facts.prior_weight > 0:
        print(f"{'ranking by' if loaded.prior_ranks else 'fusing'} the transition prior {loaded.prior.settings}",
              flush=True)
    cache = None if settings.recalibrate else settings.calibration_settings(loaded.beam_width, torch_threads())
    spec = loaded.spec
    if loaded.prior_ranks:  # every request is the prior's ranking: nothing to compile, no speculation to time
        from recsvc.recommender.prior_ranked import PRIOR_RANKED

        step("target_unused", reason=PRIOR_RANKED, forward_compiled=False, speculation_calibrated=False)
    elif loaded.timeline is not None:  # the item-level target: its own eager forward, no drafter to speculate with
        timeline_steps(settings, step)
    else:
        # compile / capture before calibration times anything
        if loaded.target.plan.prepares:
            step("compiling_forward")
            step("forward_compiled", seconds=round(loaded.warm_up(), 3))
        spec = calibrate_speculation(loaded, settings.spec, settings.bundle, budget_s=settings.startup_budget_s,
                                     step=step, should_stop=should_stop, cache_settings=cache,
                                     clock=calibration_clock(loaded.target.device.type, torch_threads()))
    # the cache is new here, after calibration (its users are not the served ones); a reload builds a new
    # recommender: an empty cache
    states = state_cache_for(loaded.target, settings.state_cache_mb << 20, f"{settings.bundle}@{time.time_ns()}")
    return BundleRecommender(loaded.parts, replace(loaded.settings, spec=spec, states=states,
                                                   prefill_ahead=settings.prefill_ahead,
                                                   read_sampler=read_sampler_for(settings.count_host_reads)))
