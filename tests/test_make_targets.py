"""Every `make TARGET` that the README and the docs tell a reader to run is a target of the Makefile."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.MULTILINE)}


def cited_targets(text: str) -> set[str]:
    """The targets of every `make ...` command in ``text`` (``VAR=value`` words, ``<placeholders>`` and ``...``
    skipped).

    >>> sorted(cited_targets("`make beauty-target quality-beauty SEED=2 B=<a dir> ...` then `make test`"))
    ['beauty-target', 'quality-beauty', 'test']
    """
    found: set[str] = set()
    for cmd in re.findall(r"`make ([^`]*)`", text):
        for word in re.sub(r"<[^>]*>", " ", cmd).split():
            if re.fullmatch(r"[A-Za-z0-9_.-]+", word) and word != "..." and not word.startswith("-"):
                found.add(word)
    return found


def test_every_cited_make_target_exists() -> None:
    targets = makefile_targets()
    assert {"test", "demo", "beauty-bundle", "beauty-ids", "beauty-target"} <= targets
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {f"{doc.name}: {t}" for doc in docs for t in cited_targets(doc.read_text()) - targets}
    assert not missing, f"docs cite make targets the Makefile lacks: {sorted(missing)}"
