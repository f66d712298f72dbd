"""The `--spec auto` choice kept in the bundle, so a restart on the same hardware skips the calibration.

A calibration times plain and speculative decoding on the running machine; its result depends on the machine
(CPU model and vector flags, torch threads, device, precision), the models (target, drafter / head, prior) and
the serving settings (attention, beam width, exclusion, the beam widths calibrated). All of these form the key. BUNDLE/
calibration.json holds the last complete calibration and its key; a start whose key is equal reuses the
choice, any difference calibrates again (and overwrites it). A read-only bundle (a mounted volume) simply
calibrates at every start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE = "calibration.json"
MODEL_DIRS = ("target", "head", "drafter", "drafters", "heads", "prior", "prior-excl")


def model_fingerprint(bundle: str | Path) -> list[list[Any]]:
    """(path, size, mtime_ns) of every file of the bundle's models: changes whenever a model is retrained."""
    root = Path(bundle)
    out: list[list[Any]] = []
    for name in MODEL_DIRS:
        base = root / name
        if base.is_dir():
            for f in sorted(p for p in base.rglob("*") if p.is_file()):
                st = f.stat()
                out.append([str(f.relative_to(root)), st.st_size, st.st_mtime_ns])
    return out


def calibration_key(bundle: str | Path, settings: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """The machine, the models and the serving settings a calibration's result depends on."""
    from recsvc.hardware import describe

    return {"hardware": describe(device, str(settings.get("dtype", "auto"))), "models": model_fingerprint(bundle),
            "settings": settings}


def load_choice(bundle: str | Path, key: dict[str, Any]) -> dict[int, tuple[int, int]] | None:
    """The stored choice per beam width when it was made under exactly ``key``, else None."""
    path = Path(bundle) / FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != json.loads(json.dumps(key)):
        return None
    try:
        return {int(k): (int(v[0]), int(v[1])) for k, v in stored["choice"].items()}
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def save_choice(bundle: str | Path, key: dict[str, Any], choice: dict[int, tuple[int, int]]) -> bool:
    """Write BUNDLE/calibration.json atomically; False when the bundle is not writable."""
    path = Path(bundle) / FILE
    tmp = path.with_name(FILE + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"key": key, "choice": {str(k): list(v) for k, v in choice.items()}}, indent=1))
        os.replace(tmp, path)
        return True
    except OSError:
        try:  # on a read-only bundle (a read-only volume) the temp file was never made and unlink fails too
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
