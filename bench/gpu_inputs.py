"""What every GPU acceptance stage loads (``bench.gpu_accept``): the bundle's target and drafter on the
device with a forward, one prompt per measured user with its history and fused prior, and the target's own
validation figure for the labels."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:  # the engine is imported when a stage runs, not when the bench's commands are listed
    from bench.common import BenchContext
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import Decoded
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.meters.ledger import Ledger
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.engine.speculation.ports import Drafter
    from recsvc.recommender.parts import Prior

T = TypeVar("T")

DRAFTER_KINDS = ("llama", "head")  # --drafter-kind: the bundle's LLaMA drafter, or its draft head (no opener)

TARGET_INFO = "train" + "ing.json"  # what the target's training wrote beside it (a file, not a module)


def valid_recall(bundle: Path) -> dict:
    """The target's validation figure its training selected on (BUNDLE/target/training.json)."""
    path = bundle / "target" / TARGET_INFO
    info = json.loads(path.read_text()) if path.is_file() else {}
    best = info.get("best") or {}
    return {"metric": best.get("metric"), "value": best.get("value"), "best_epoch": info.get("best_epoch"),
            "preset": info.get("preset"), "params": info.get("params"), "train_seconds": info.get("seconds"),
            "train_tokens_per_s": info.get("train_tokens_per_s")}


@dataclass(frozen=True)
class Request:
    """A measured batch: its prompts, histories and fused prior ([B, num_nodes], or None)."""

    pb: PromptBatch
    histories: list[list[int]]
    prior: torch.Tensor | None


class Inputs:
    """Makes the measured requests: prompts and the fused prior (the bundle's prior as served, when it fuses one
    and ``--prior auto``; else none), made once per batch, outside every timer."""

    def __init__(self, ctx: BenchContext, fused: Prior | None, device: str) -> None:
        self.ctx, self.fused, self.device = ctx, fused, device

    def request(self, histories: list[list[int]]) -> Request:
        from recsvc.engine.caches.prompts import PromptBatch
        from recsvc.engine.scoring.prior import prior_log_mass

        pb = PromptBatch.from_lists([self.ctx.builder.prompt_ids(h) for h in histories])
        prior = None if self.fused is None else prior_log_mass(self.ctx.trie, self.fused.probs(histories),
                                                                self.fused.settings.weight).to(self.device)
        return Request(pb, [list(h) for h in histories], prior)


def plain_search(engine, req: Request, width: int, top: int, ledger: Ledger | None = None,
                 fuse: bool = True) -> Decoded:
    """Plain beam search of ``req`` through the one decoding entry (``fuse`` False: without its prior)."""
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.meters.ledger import NO_LEDGER

    return decode(engine, None, req.pb, req.histories, "plain", width, (0, 0), prior=req.prior if fuse else None,
                  top=top, ledger=ledger or NO_LEDGER)


def strict_search(engine, drafter, req: Request, width: int, speculation: tuple[int, int],
           ledger: Ledger | None = None, exit_check: int | None = None) -> Decoded:
    """Strict speculation of ``req`` with ``drafter`` at (N, gamma) ``speculation`` (``exit_check``: ``decode``'s)."""
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.meters.ledger import NO_LEDGER

    return decode(engine, drafter, req.pb, req.histories, "strict", width, speculation, prior=req.prior,
                  ledger=ledger or NO_LEDGER, exit_check=exit_check)


def timed(fn: Callable[[], T], device: str) -> tuple[T, float]:
    """``fn()`` and its milliseconds, the device's queue drained before the clock stops."""
    from bench.common import synchronize

    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, 1000 * (time.perf_counter() - start)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


@dataclass(frozen=True)
class Loaded:
    """What a GPU stage measures: the bundle's context, its target with the stage's forward and the beam search
    over it, the drafter and its label, one request per measured user and the request maker."""

    ctx: BenchContext
    target: EngineModel
    engine: BeamSearch
    drafter: Drafter
    drafter_label: str
    requests: list[Request]
    inputs: Inputs


def load(bundle: Path, cfg: dict, device: str, forward: str, dtype: str) -> Loaded:
    """The bundle's target and drafter (``cfg["drafter_kind"]``: its LLaMA drafter, the aligned one when there is
    one, with ``forward`` too; or its draft head, no opener) in ``dtype`` on ``device`` with ``forward``, and one
    request per measured user."""
    from bench.common import load_context
    from bench.speculative import load_fused_prior, make_drafter
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.search.beam_search import BeamSearch

    ctx = load_context(bundle, cfg["users"], "test", dtype, cfg.get("data"), device=device)
    target = EngineModel.build(ctx.model, "fp32", forward=forward)
    engine = BeamSearch(target, ctx.trie, ctx.builder.code_offset)
    if cfg.get("drafter_kind", "llama") == "head":
        drafter = make_drafter("head", ctx, engine, cfg["width"], dtype, None, head_opener="none", device=device)
        label = "draft head (no opener)"
    else:
        aligned = (bundle / "drafters" / "atspeed" / "config.json").is_file()
        drafter = make_drafter("llama", ctx, engine, cfg["width"], dtype, "atspeed" if aligned else None,
                               device=device)
        drafter.model.set_forward(forward)
        label = "llama (AtSpeed-S)" if aligned else "llama (SFT)"
    inputs = Inputs(ctx, load_fused_prior(bundle, cfg.get("prior", "auto")), device)
    requests = [inputs.request([u.history]) for u in ctx.users]
    return Loaded(ctx, target, engine, drafter, label, requests, inputs)


def engines(target, drafter) -> list:
    """The engine models whose graphs a warm-up captures: the target's, and the drafter's when it has a
    transformer of its own (the LLaMA drafter; the draft head has none)."""
    return [target] if drafter.model is None else [target, drafter.model]
