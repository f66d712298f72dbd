"""The package layering, read from the source with ``ast`` (every import statement, also the lazy ones inside
functions and ``TYPE_CHECKING`` blocks; nothing is imported):

- ``recsvc/`` never imports ``training/``: a service image ships without it. The ``recsvc`` console script's
  command tables name training's commands by module path and skip them when ``training`` is not installed; no
  other string in ``recsvc/`` names a ``training`` module.
- ``recsvc/engine/`` (decoding) imports nothing above it: not the service, the benches, the CLI, the drafters
  (they implement ``engine/ports.py``), the list-level rule decoders (only the trie-level rules: the ``Rules``
  values, item attributes over the trie's leaf ranges, the greedy caps) nor model loading.
- the data layer (``recsvc/data``, ``recsvc/model``, ``recsvc/errors.py``, ``tokenizer_rqvae``) imports no
  engine, service, bench or CLI module; ``recsvc/service`` imports no bench or CLI module.

A new import that breaks one of these fails here with the file, line and module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "recsvc" / "service" / "gen"

# what recsvc/engine/ may not import: the layers above decoding
ABOVE_ENGINE = (
    "recsvc.service", "recsvc.bench", "recsvc.cli", "recsvc.drafters",
    "recsvc.rules.search", "recsvc.rules.lookahead", "recsvc.rules.decode",  # list-level decoding over the engine
    "recsvc.rules.source", "recsvc.rules.build", "recsvc.rules.derive",  # attribute files: read, built, derived
    "recsvc.model.bundle", "recsvc.model.loading",  # model loading
    "training",
)
# Known exceptions, (file, imported module), each imported today and to be removed, never added to: the
# composition root moves out of engine/ (recsvc/recommender/). recommender.py builds a bundle's recommender (its
# drafters, rule decoding, attribute source, the bundle on disk); live_catalog.py rebuilds it over added items.
KNOWN_ENGINE_EXCEPTIONS = {
    ("recsvc/engine/recommender.py", "recsvc.drafters.llama"),
    ("recsvc/engine/recommender.py", "recsvc.drafters.head"),
    ("recsvc/engine/recommender.py", "recsvc.drafters.head_model"),
    ("recsvc/engine/recommender.py", "recsvc.drafters.transition"),
    ("recsvc/engine/recommender.py", "recsvc.rules.decode"),
    ("recsvc/engine/recommender.py", "recsvc.rules.search"),
    ("recsvc/engine/recommender.py", "recsvc.rules.source"),
    ("recsvc/engine/recommender.py", "recsvc.model.bundle"),
    ("recsvc/engine/live_catalog.py", "recsvc.drafters.head"),
    ("recsvc/engine/live_catalog.py", "recsvc.drafters.llama"),
    ("recsvc/engine/live_catalog.py", "recsvc.drafters.transition"),
    ("recsvc/engine/live_catalog.py", "recsvc.rules.source"),
}
DATA_LAYER = ("recsvc/data", "recsvc/model", "recsvc/errors.py", "tokenizer_rqvae")
ABOVE_DATA = ("recsvc.engine", "recsvc.drafters", "recsvc.rules", "recsvc.service", "recsvc.bench", "recsvc.cli",
              "training")
ABOVE_SERVICE = ("recsvc.bench", "recsvc.cli", "training")
# the console script's command tables: module paths of commands, imported only when the package is installed
COMMAND_TABLES = {"recsvc/cli/main.py", "recsvc/bench/cli.py"}
MODULE_NAME = re.compile(r"^training(\.\w+)*$")


def sources(*places: str) -> list[Path]:
    out: list[Path] = []
    for place in places:
        path = ROOT / place
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        out += [f for f in files if GENERATED not in f.parents]
    return out


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every import in the file: ``from a.b import c`` gives ``a.b.c`` (c may be a module),
    relative imports resolved against the file's package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_of(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(places: tuple[str, ...], forbidden: tuple[str, ...]) -> list[tuple[str, int, str]]:
    return [(str(path.relative_to(ROOT)), line, module) for path in sources(*places)
            for line, module in imports(path) if under(module, forbidden)]


def test_the_reader_sees_every_kind_of_import(tmp_path) -> None:
    mod = tmp_path / "pkg" / "sub" / "mod.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("""from __future__ import annotations
import os.path, json
from typing import TYPE_CHECKING
from . import sibling
from ..other import thing
from .. import other as alias
if TYPE_CHECKING:
    from pkg.typed import T
def f():
    from training.api import load_setup
    import training.metrics
""")
    assert sorted(imports(mod, tmp_path)) == [
        (1, "__future__.annotations"), (2, "json"), (2, "os.path"), (3, "typing.TYPE_CHECKING"),
        (4, "pkg.sub.sibling"), (5, "pkg.other.thing"), (6, "pkg.other"), (8, "pkg.typed.T"),
        (10, "training.api.load_setup"), (11, "training.metrics"),
    ]
    assert under("training.api.load_setup", ("training",)) and not under("trainings.x", ("training",))


def test_recsvc_never_imports_training() -> None:
    assert violations(("recsvc",), ("training",)) == []


def test_recsvc_names_training_modules_only_in_the_command_tables() -> None:
    named = []
    for path in sources("recsvc"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
                named.append((rel, node.lineno, node.value))
    assert [n for n in named if n[0] not in COMMAND_TABLES] == []


def test_engine_imports_nothing_above_it() -> None:
    found = violations(("recsvc/engine",), ABOVE_ENGINE)
    pairs = {(path, _module_file(module)) for path, _, module in found}
    new = sorted((path, line, module) for path, line, module in found
                 if (path, _module_file(module)) not in KNOWN_ENGINE_EXCEPTIONS)
    assert new == [], "recsvc/engine/ imports a layer above it (see ABOVE_ENGINE)"
    gone = KNOWN_ENGINE_EXCEPTIONS - pairs
    assert gone == set(), "a known exception is gone: remove it from KNOWN_ENGINE_EXCEPTIONS"


def test_data_layer_imports_no_engine_service_or_cli() -> None:
    assert violations(DATA_LAYER, ABOVE_DATA) == []


def test_service_imports_no_bench_or_cli() -> None:
    assert violations(("recsvc/service",), ABOVE_SERVICE) == []


def _module_file(module: str) -> str:
    """``recsvc.drafters.llama.LlamaDrafter`` -> ``recsvc.drafters.llama`` (the module part of an imported name)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ROOT.joinpath(*parts[:n])
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts[:n])
    return module
