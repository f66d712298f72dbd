"""Drafters by name: the one place where a drafter is built (serving, the benchmarks, drafter measurements).

A name is a kind, optionally with an argument after a colon, or a LLaMA drafter's model:

- ``llama`` / ``llama:NAME``: the bundle's LLaMA drafter BUNDLE/drafter / BUNDLE/drafters/NAME;
- ``head`` / ``head:NAME``: the recurrent draft head BUNDLE/head / BUNDLE/heads/NAME on the target, opened by the
  transition drafter when there is a prior (``DraftSource.head_opener``);
- ``transition``: the training-free drafter over the transition prior (``DraftSource.prior``);
- ``retrieval``: the training-free REST-style drafter over the training sequences (``DraftSource.sequences``);
- ``oracle``: the target's own beams (benchmarks: the engine's ceiling; ``DraftSource.oracle_width``);
- any other name: a LLaMA drafter trained with ``--out-name NAME`` (BUNDLE/drafters/NAME), ``drafter``
  (BUNDLE/drafter) or a model directory (``Bundle.drafter_path``).

Every drafter is built over ``DraftSource.trie`` and returned as the engine's ``Drafter`` port: what the
recommender needs of it afterwards is a capability of the port (``engine/speculation/ports.py``), not its class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from recsvc.bundle.directory import Bundle
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.speculation.ports import Drafter
from recsvc.errors import UserError
from recsvc.priors.mixed import MixedPrior
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.drafter_names import DRAFTER_KINDS, HEAD_OPENERS, TAKES_NAME
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class DraftSource:
    """What drafters are built from: the bundle, the target they draft for and the catalog's trie."""

    bundle: Bundle
    target: EngineModel  # a LLaMA drafter's model is built in its attention mode; the oracle searches it
    trie: CatalogTrie  # the catalog's trie, on the target's device (the recommender's own)
    code_offset: int  # the first code token's id (the prompt builder's)
    dtype: str = "auto"  # a LLaMA drafter's weights
    device: str = "cpu"  # where drafter models and heads are loaded
    prior: TransitionPrior | MixedPrior | None = None  # the transition drafter's and the head opener's
    sequences: Callable[[], Iterable[Sequence[int]]] | None = None  # the retrieval datastore's (training) sequences
    oracle_width: int | None = None  # the oracle's beams (None: no oracle, it drafts the target's own top-K)
    head_opener: str = "auto"  # auto: the transition drafter when there is a prior; transition (required); none


def default_drafter(bundle: Bundle) -> str | None:
    """The drafter a bundle serves when none is named: its draft head, else its LLaMA drafter, else none."""
    if (bundle.head_path() / "config.json").is_file():
        return "head"
    if (bundle.drafter_dir / "config.json").is_file():
        return "llama"
    return None


def build_drafter(name: str, src: DraftSource) -> Drafter:
    """The drafter ``name`` (see the module's list) over ``src.trie``; UserError when what it needs is missing."""
    kind, colon, arg = name.partition(":")
    builder = DRAFTERS.get(kind)
    if builder is None or (colon and kind not in TAKES_NAME):
        return _llama(src, name)  # a trained drafter's name or a model directory
    return builder(src, arg or None)


def _llama(src: DraftSource, name: str | None) -> Drafter:
    from recsvc.drafters.llama import LlamaDrafter

    model = src.bundle.load_drafter(dtype=src.dtype, device=src.device, name=name)
    return LlamaDrafter(EngineModel.build(model, src.target.attention), src.trie, src.code_offset)


def _head(src: DraftSource, name: str | None) -> Drafter:
    from recsvc.drafters.head import HeadDrafter
    from recsvc.drafters.head_model import load_head

    if src.head_opener not in HEAD_OPENERS:
        raise UserError(f"the head drafter's opener is one of {', '.join(HEAD_OPENERS)}, got {src.head_opener!r}")
    if src.head_opener == "transition" and src.prior is None:
        raise UserError(f"the head drafter's transition opener needs a transition prior in {src.bundle.root}")
    opener = _transition(src, None) if src.head_opener != "none" and src.prior is not None else None
    return HeadDrafter(load_head(src.bundle.head_path(name), device=src.device), src.trie, opener)


def _transition(src: DraftSource, _: str | None) -> Drafter:
    from recsvc.drafters.transition import TransitionDrafter

    if src.prior is None:
        raise UserError(f"the transition drafter needs a transition prior in {src.bundle.root}: run `recsvc prior "
                        "fit` or `recsvc tune prior` first")
    return TransitionDrafter(src.prior, src.trie)


def _retrieval(src: DraftSource, _: str | None) -> Drafter:
    from recsvc.drafters.retrieval import RetrievalDatastore, RetrievalDrafter

    if src.sequences is None:
        raise UserError("the retrieval drafter needs the training sequences for its datastore: the benchmarks "
                        "build it (`recsvc bench speculative|drafters`)")
    return RetrievalDrafter(RetrievalDatastore(src.sequences()), src.trie)


def _oracle(src: DraftSource, _: str | None) -> Drafter:
    from recsvc.drafters.oracle import OracleDrafter
    from recsvc.engine.search.beam_search import BeamSearch

    if src.oracle_width is None:
        raise UserError("the oracle drafter drafts the target's own top-K: only benchmarks run it "
                        "(`recsvc bench speculative --drafter oracle`)")
    return OracleDrafter(BeamSearch(src.target, src.trie, src.code_offset), src.oracle_width)


DRAFTERS: dict[str, Callable[[DraftSource, str | None], Drafter]] = {
    "llama": _llama, "head": _head, "transition": _transition, "retrieval": _retrieval, "oracle": _oracle,
}
if tuple(DRAFTERS) != DRAFTER_KINDS:
    raise RuntimeError("recsvc.recommender.drafter_names.DRAFTER_KINDS must name the builders of DRAFTERS")


def head_alone_search(*args, **kwargs):
    """The draft head's beams without verification (``recsvc.drafters.head_alone.head_alone_search``: one target
    forward, the head beam-searches the remaining codes), for the benches: the drafters stay behind this module."""
    from recsvc.drafters.head_alone import head_alone_search as search

    return search(*args, **kwargs)
