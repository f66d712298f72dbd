"""A bundle: one directory with everything the service needs (docs/ARCHITECTURE.md, "Bundle").

::

    BUNDLE/bundle.json     {"version": 1, "data": "<data dir>", "stages": {"ids": {"done": true, "seconds": 12.3},
                            ...}, "target_preset": "small", "drafter": null | {"preset": ..., ...}}
    BUNDLE/ids/            semantic_ids.json (+ the RQ-VAE files)
    BUNDLE/tokenizer/      HF fast tokenizer with the 1024 code tokens
    BUNDLE/target/         LlamaForCausalLM (safetensors); an item-level target instead when bundle.json
                           "architecture" is "items" (timeline.json + timeline.safetensors, recsvc.timeline)
    BUNDLE/target-train/   deploy protocol only: the target before its refit on train + valid
    BUNDLE/prior/          item-transition prior fused into beam search (optional; recsvc.priors.transition)
    BUNDLE/drafter/        drafter LlamaForCausalLM (optional)
    BUNDLE/checkpoints/    training checkpoints (resume); not needed to serve
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from tokenizer_rqvae.ids import SemanticIds

VERSION = 1
META_FILE = "bundle.json"
DEFAULT_BEAM_WIDTH = 20  # LC-Rec's evaluation width: the served top-k are the offline evaluation's top-k
ARCHITECTURES = ("tokens", "items")  # the target: a LLaMA over code tokens, or a timeline over items (recsvc.timeline)


class Bundle:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # ------------------------------------------------------------------ paths
    @property
    def meta_path(self) -> Path:
        return self.root / META_FILE

    @property
    def ids_dir(self) -> Path:
        return self.root / "ids"

    @property
    def semantic_ids_path(self) -> Path:
        return self.ids_dir / "semantic_ids.json"

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    @property
    def train_only_target_dir(self) -> Path:
        """Deploy-protocol bundles: the target before its refit on train + valid (trained on train only)."""
        return self.root / "target-train"

    @property
    def drafter_dir(self) -> Path:
        return self.root / "drafter"

    @property
    def prior_dir(self) -> Path:
        """The item-transition prior fused into decoding (``recsvc prior fit``; optional)."""
        return self.root / "prior"

    def has_prior(self, exclude_history: bool = False) -> bool:
        from recsvc.priors.transition import TENSORS_FILE

        return (self.prior_dir_for(exclude_history) / TENSORS_FILE).is_file()

    @property
    def excluded_prior_dir(self) -> Path:
        """The prior tuned for ranking with the history excluded (``recsvc tune prior --exclude-history``)."""
        return self.root / "prior-excl"

    def prior_dir_for(self, exclude_history: bool) -> Path:
        """The prior a service that excludes (or keeps) history items fuses: BUNDLE/prior-excl when excluding
        and the bundle has one, else BUNDLE/prior."""
        from recsvc.priors.transition import TENSORS_FILE

        if exclude_history and (self.excluded_prior_dir / TENSORS_FILE).is_file():
            return self.excluded_prior_dir
        return self.prior_dir

    @property
    def fresh_dir(self) -> Path:
        """Fresh items (``recsvc.content.fresh``): item embeddings, the fresh set and the slot settings."""
        return self.root / "fresh"

    def has_fresh(self) -> bool:
        return (self.fresh_dir / "fresh.json").is_file()

    def checkpoint_dir(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def head_path(self, name: str | None = None) -> Path:
        """The recurrent draft head: BUNDLE/head (the served one, None) or BUNDLE/heads/NAME (``--out-name``)."""
        if name is None:
            return self.root / "head"
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"a head name must be a plain directory name, got {name!r}")
        return self.root / "heads" / name

    # ------------------------------------------------------------------ bundle.json
    @classmethod
    def create(cls, root: str | Path, data: str | Path | None = None) -> Bundle:
        """Open ``root`` as a bundle, creating the directory and bundle.json when missing.

        An existing bundle built from another data directory is a UserError (its ids would not match).
        """
        bundle = cls(root)
        if bundle.meta_path.is_file():
            meta = bundle.read()
            if data is not None and meta.get("data") and Path(meta["data"]).resolve() != Path(data).resolve():
                raise UserError(f"bundle {bundle.root} was built from {meta['data']}, not {data}")
            if data is not None and not meta.get("data"):
                meta["data"] = str(Path(data).resolve())
                bundle.write(meta)
            return bundle
        if bundle.root.exists() and not bundle.root.is_dir():
            raise UserError(f"bundle path {bundle.root} exists and is not a directory")
        bundle.root.mkdir(parents=True, exist_ok=True)
        data_path = str(Path(data).resolve()) if data is not None else None
        bundle.write({"version": VERSION, "data": data_path, "stages": {},
                      "target_preset": None, "drafter": None})
        return bundle

    @classmethod
    def open(cls, root: str | Path) -> Bundle:
        """An existing bundle (UserError if ``root`` has no bundle.json)."""
        bundle = cls(root)
        bundle.read()
        return bundle

    def served_beam_width(self) -> int:
        """The beams a server of this bundle searches per request unless told otherwise (bundle.json
        "beam_width", else ``DEFAULT_BEAM_WIDTH``; 0 = k): evaluations and tunings rank with it, so that what
        they measure is what is served."""
        return int(self.read().get("beam_width", DEFAULT_BEAM_WIDTH))

    def serves_excluding_history(self) -> bool:
        """Whether a server of this bundle leaves each user's history items out of every list unless told
        otherwise (bundle.json "exclude_history", chosen on validation by ``recsvc tune history``; absent: keep
        them). ``recsvc serve`` and ``recsvc eval`` follow it (``--exclude-history`` / ``--keep-history``
        override it), so that what an evaluation measures is what is served."""
        value = self.read().get("exclude_history", False)
        if not isinstance(value, bool):
            raise UserError(f"{self.meta_path}: 'exclude_history' must be true or false, got {value!r}")
        return value

    def excludes_history(self, flag: bool | None) -> bool:
        """``flag`` (``--exclude-history`` True, ``--keep-history`` False) when given, else the bundle's choice."""
        return flag if flag is not None else self.serves_excluding_history()

    def read(self) -> dict[str, Any]:
        if not self.meta_path.is_file():
            raise UserError(f"not a bundle: {self.root} has no {META_FILE}")
        try:
            meta = json.loads(self.meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{self.meta_path} is not valid JSON: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            raise UserError(f"{self.meta_path}: unsupported bundle version {meta.get('version')!r} "
                            f"(expected {VERSION})" if isinstance(meta, dict) else f"{self.meta_path}: not an object")
        meta.setdefault("stages", {})
        return meta

    def write(self, meta: dict[str, Any]) -> None:
        """Atomic write (temp file + rename): a crash never leaves a half-written bundle.json."""
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.meta_path)

    def update(self, **fields: Any) -> dict[str, Any]:
        meta = self.read()
        meta.update(fields)
        self.write(meta)
        return meta

    def data_dir(self) -> Path | None:
        """The data directory recorded at creation (None if unknown)."""
        data = self.read().get("data")
        return Path(data) if data else None

    def resolve_data_dir(self, data_dir: str | Path | None = None) -> Path:
        """``data_dir`` if given, else the recorded one; UserError when neither is known."""
        path = data_dir or self.data_dir()
        if path is None:
            raise UserError(f"bundle {self.root} records no data directory: pass --data DIR")
        return Path(path)

    # ------------------------------------------------------------------ stages
    def mark_done(self, stage: str, **info: Any) -> None:
        """Record a finished stage: ``stages[stage] = {"done": true, "finished_at": ..., **info}``."""
        meta = self.read()
        meta["stages"][stage] = {"done": True, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}
        self.write(meta)

    def clear_stage(self, stage: str) -> None:
        meta = self.read()
        meta["stages"].pop(stage, None)
        self.write(meta)

    def is_done(self, stage: str) -> bool:
        if not self.meta_path.is_file():
            return False
        return bool(self.read()["stages"].get(stage, {}).get("done"))

    def stage_info(self, stage: str) -> dict[str, Any]:
        return dict(self.read()["stages"].get(stage, {}))

    @property
    def architecture(self) -> str:
        """The target's architecture, bundle.json "architecture": "tokens" (a LLaMA over four code tokens per
        history item; bundles made before the field existed) or "items" (the item-level target)."""
        if not self.meta_path.is_file():
            return "tokens"
        arch = self.read().get("architecture", "tokens")
        if arch not in ARCHITECTURES:
            raise UserError(f"{self.meta_path}: unknown architecture {arch!r} (expected one of {ARCHITECTURES})")
        return str(arch)

    # ------------------------------------------------------------------ artifacts
    def assigned_later(self) -> dict[str, Any] | None:
        """The cold-start protocol's record (``ids/assigned_later.json``): ``{"known_through": split, "items":
        [item ids whose ids came from the fitted encoder, not from fitting]}``; None when ids were fitted on all
        items."""
        path = self.ids_dir / "assigned_later.json"
        if not path.is_file():
            return None
        try:
            rec = json.loads(path.read_text())
            return {"known_through": str(rec["known_through"]), "items": [int(i) for i in rec["items"]]}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}: not a cold-start record ({exc})") from exc

    def load_ids(self) -> SemanticIds:
        if not self.semantic_ids_path.is_file():
            raise UserError(f"bundle {self.root} has no semantic ids yet ({self.semantic_ids_path}); "
                            "run `recsvc build` (or the ids stage) first")
        return SemanticIds.load(self.semantic_ids_path)

    def load_tokenizer(self):
        from recsvc.bundle.tokenizer import load_tokenizer

        if not self.tokenizer_dir.is_dir():
            raise UserError(f"bundle {self.root} has no tokenizer yet ({self.tokenizer_dir})")
        return load_tokenizer(self.tokenizer_dir)

    def prompt_settings(self) -> dict[str, Any]:
        """{"header": "lcrec" | "compact" | "packed", "max_history": n}: recorded by target training (bundles made
        before the setting existed used the LC-Rec header and 20 items)."""
        from recsvc.bundle.prompt import MAX_HISTORY

        rec = self.read().get("prompt") or {}
        return {"header": rec.get("header", "lcrec"), "max_history": int(rec.get("max_history", MAX_HISTORY))}

    def prompt_builder(self, tokenizer=None, ids: SemanticIds | None = None):
        """The ``PromptBuilder`` the bundle's models were trained with (one place builds it for every caller)."""
        from recsvc.bundle.prompt import PromptBuilder

        settings = self.prompt_settings()
        return PromptBuilder(tokenizer if tokenizer is not None else self.load_tokenizer(),
                             ids if ids is not None else self.load_ids(),
                             max_history=settings["max_history"], header=settings["header"])

    def load_target(self, dtype: str = "auto", device: str = "cpu"):
        from recsvc.bundle.loading import load_causal_lm

        return load_causal_lm(self.target_dir, dtype=dtype, device=device)

    def drafter_path(self, name: str | Path | None = None) -> Path:
        """The served drafter (None or "drafter": BUNDLE/drafter), a drafter trained with ``--out-name NAME``
        (BUNDLE/drafters/NAME), or a model directory; UserError when there is no model there."""
        if name in (None, "drafter"):
            looked = [self.drafter_dir]
        else:  # a trained drafter's name first, then a directory of that name
            looked = [self.root / "drafters" / str(name), Path(name)]
        for path in looked:
            if (path / "config.json").is_file():
                return path
        where = " or ".join(str(p) for p in looked)
        raise UserError(f"no drafter {str(name or 'drafter')!r} (no config.json in {where}): train it with `recsvc "
                        f"train drafter --bundle {self.root} --method METHOD --out-name {name or 'NAME'}`")

    def load_drafter(self, dtype: str = "auto", device: str = "cpu", name: str | Path | None = None):
        from recsvc.bundle.loading import load_causal_lm

        return load_causal_lm(self.drafter_path(name), dtype=dtype, device=device)
