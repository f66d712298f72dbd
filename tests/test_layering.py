"""The package layering, read from the source with ``ast`` (every import statement, also the lazy ones inside
functions and ``TYPE_CHECKING`` blocks; nothing is imported):

- the benchmarks (``bench/``) and the local process launchers of the tests and drills (``harness/``) stand
  outside the product: neither ``recsvc/``, ``tokenizer_rqvae/`` nor ``training/`` imports them (the service
  image ships without them), and the tests take their Redis launchers from ``harness/``, not from the benchmarks.
- ``recsvc/`` never imports ``training/``: a service image ships without it. Training's commands
  declare themselves as entry points in pyproject.toml (``recsvc/commands.py`` loads them and skips them when
  ``training`` is not installed); no string in ``recsvc/`` names a ``training`` module.
- ``recsvc/engine/`` (decoding) imports nothing above it: not the recommender, the service, the benches, the
  CLI, the drafters (they implement ``engine/speculation/ports.py``), the rules nor the bundle (it is handed loaded
  models). Inside it, its rooms stand in order (``ENGINE_ROOMS``, the map in ``recsvc/engine/__init__.py``): each
  imports only the rooms below it, no module stands loose beside them, strict and relaxed speculation import
  neither each other nor are imported by speculation's shared modules, and no engine module imports another
  module's private (underscore) name.
- ``recsvc/recommender/`` (the composition root: a bundle as a ``Recommender``) may import the engine, the
  drafters, the rules, the bundle and the data layer, and imports no service, bench or CLI module; the layers
  below it (engine, drafters, rules, the bundle, the data layer) never import it.
- drafters are built by name in ``recommender/drafter_registry.py``: the rest of the recommender, the service,
  the benches and the CLI import no drafter (they use the ``Drafter`` port's capabilities).
- ``recsvc_base/`` (the user's errors and the progress output) is the ground floor: it imports nothing of the
  project, and ``tokenizer_rqvae`` (which ``recsvc`` stands on) takes ``UserError`` and the progress bars from it,
  never from ``recsvc``.
- the data layer (``recsvc/data``, ``recsvc/priors``, ``recsvc/content``, ``recsvc/catalog``,
  ``recsvc/hardware.py``, ``recsvc/errors.py``, ``tokenizer_rqvae``) imports no bundle,
  engine, drafter, rule, recommender, service, client, bench or CLI module; ``recsvc/service`` imports no bench,
  CLI or client module.
- the bundle (``recsvc/bundle``: its directory, the LM presets, loading, tokenizer and prompt) stands on the
  data layer beside the engine: it imports no engine, drafter, rule, recommender, service, client, bench or CLI
  module, and the engine, the drafters and both rule rooms import no bundle module (the recommender loads the
  bundle and hands its models down).
- the rules are two rooms: the trie-level rules (``recsvc/rules``: the Rules values, item attributes,
  their compilation over the trie's leaves, the greedy cap filler) sit with the data layer and import no engine,
  drafter or decoding-level rule; the decoding-level rules (``recsvc/rule_decoding``: list-level search, look-ahead, the
  strategies) sit above the engine and below the recommender.
- ``recsvc/service/`` stands in rooms (``SERVICE_ROOMS``, the map in ``recsvc/service/__init__.py``): start-up,
  rpc, swap, stores, observability, each importing only the rooms below it and none the ``recsvc serve`` command
  (``cli.py``); beside them only the command, the flags' value types and the proto generator, which import no
  room but the stores; no folder of the service holds more than 15 modules.
- the service reads a recommender only through the ``Recommender`` protocol: no ``getattr`` / ``hasattr`` on a
  recommender in ``recsvc/service``.
- no module of the project is imported by a string (``importlib.import_module``, ``__import__``): commands and
  benches are entry points, loaded through the packaging metadata's table.
- every place named here exists and holds source, so that a renamed room cannot leave a check reading nothing.

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
    "recsvc.recommender", "recsvc.service", "bench", "recsvc.cli", "recsvc.drafters", "recsvc.rules",
    "recsvc.rule_decoding",
    "recsvc.bundle",  # the bundle and model loading: the engine is handed loaded models
    "training",
)
ABOVE_RECOMMENDER = ("recsvc.service", "bench", "recsvc.cli", "training")
# the engine's rooms, top floor first: each imports only the rooms after it
ENGINE_ROOMS = ("entry", "speculation", "search", "caches", "kernels", "scoring", "meters")
BELOW_RECOMMENDER = ("recsvc/engine", "recsvc/drafters", "recsvc/rules", "recsvc/rule_decoding")  # + bundle, data
DRAFTER_REGISTRY = "recsvc/recommender/drafter_registry.py"  # the one place above the drafters that builds them
DATA_LAYER = ("recsvc/data", "recsvc/priors", "recsvc/content", "recsvc/catalog", "recsvc/hardware.py",
              "recsvc/errors.py", "tokenizer_rqvae")
ABOVE_DATA = ("recsvc.bundle", "recsvc.engine", "recsvc.drafters", "recsvc.rules", "recsvc.rule_decoding",
              "recsvc.recommender", "recsvc.service", "recsvc.client", "bench", "recsvc.cli", "training")
BASE = ("recsvc_base",)  # the ground floor: imports nothing of the project
PROJECT = ("recsvc", "tokenizer_rqvae", "training", "bench", "harness")
# the bundle (its directory, LM presets, loading, tokenizer, prompt): on the data layer, beside the engine
BUNDLE = ("recsvc/bundle",)
ABOVE_BUNDLE = ABOVE_DATA[1:]
ABOVE_SERVICE = ("bench", "recsvc.cli", "recsvc.client", "training")
# the service's rooms, top floor first: each imports only the rooms after it; the modules beside them
SERVICE_ROOMS = ("startup", "rpc", "swap", "stores", "observability")
SERVICE_LOOSE = ("__init__.py", "arg_types.py", "cli.py", "proto_gen.py")
MAX_MODULES = 15  # a folder's modules (issue 69)
MODULE_NAME = re.compile(r"^training(\.\w+)*$")
# the rules in their two rooms: the trie-level rules (below the engine, beside the data layer) and the
# decoding-level rules (above the engine, below the recommender)
RULES_TRIE_LEVEL = ("recsvc/rules",)
RULES_DECODING = ("recsvc/rule_decoding",)
ABOVE_TRIE_RULES = ("recsvc.engine", "recsvc.drafters", "recsvc.rule_decoding", "recsvc.recommender",
                    "recsvc.service", "bench", "recsvc.cli", "recsvc.client", "training")
RECOMMENDER_NAME = re.compile(r"(^|\.|_)(rec|recommender)$")
DATA_FILE = re.compile(r"\.json$")  # a file name such as a training record's "training.json" names no module


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
    from training.drafters.api import load_setup
    import training.metrics
""")
    assert sorted(imports(mod, tmp_path)) == [
        (1, "__future__.annotations"), (2, "json"), (2, "os.path"), (3, "typing.TYPE_CHECKING"),
        (4, "pkg.sub.sibling"), (5, "pkg.other.thing"), (6, "pkg.other"), (8, "pkg.typed.T"),
        (10, "training.drafters.api.load_setup"), (11, "training.metrics"),
    ]
    assert under("training.drafters.api.load_setup", ("training",)) and not under("trainings.x", ("training",))


def test_recsvc_never_imports_training() -> None:
    assert violations(("recsvc",), ("training",)) == []


def test_recsvc_names_no_training_module() -> None:
    named = []
    for path in sources("recsvc"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value) \
                    and not DATA_FILE.search(node.value):
                named.append((rel, node.lineno, node.value))
    assert named == []


def test_engine_imports_nothing_above_it() -> None:
    assert violations(("recsvc/engine",), ABOVE_ENGINE) == []


def test_engine_rooms_stand_in_order() -> None:
    engine = ROOT / "recsvc" / "engine"
    assert sorted(p.name for p in engine.iterdir() if (p / "__init__.py").is_file()) == sorted(ENGINE_ROOMS)
    assert [p.name for p in engine.glob("*.py")] == ["__init__.py"]  # every module in a room
    for i, room in enumerate(ENGINE_ROOMS):
        assert violations((f"recsvc/engine/{room}",), tuple(f"recsvc.engine.{r}" for r in ENGINE_ROOMS[:i])) == []
    speculation = "recsvc/engine/speculation"
    strict, relaxed = "recsvc.engine.speculation.strict", "recsvc.engine.speculation.relaxed"
    assert violations((f"{speculation}/strict",), (relaxed,)) == []
    assert violations((f"{speculation}/relaxed",), (strict,)) == []
    shared = tuple(str(p.relative_to(ROOT)) for p in (ROOT / speculation).glob("*.py"))
    assert violations(shared, (strict, relaxed)) == []


def test_no_engine_module_imports_a_private_name() -> None:
    found = [(str(path.relative_to(ROOT)), line, module) for path in sources("recsvc/engine")
             for line, module in imports(path) if under(module, PROJECT) and module.rsplit(".", 1)[-1].startswith("_")]
    assert found == []


def test_recommender_imports_no_service_bench_or_cli() -> None:
    assert violations(("recsvc/recommender",), ABOVE_RECOMMENDER) == []


def test_nothing_below_the_recommender_imports_it() -> None:
    assert violations(BELOW_RECOMMENDER, ("recsvc.recommender", *ABOVE_RECOMMENDER)) == []


def test_drafters_are_built_only_by_the_registry() -> None:
    found = violations(("recsvc/recommender", "recsvc/service", "bench", "recsvc/cli"), ("recsvc.drafters",))
    assert [f for f in found if f[0] != DRAFTER_REGISTRY] == []
    assert found, "the registry builds the drafters"


def test_data_layer_imports_no_engine_service_or_cli() -> None:
    assert violations(DATA_LAYER, ABOVE_DATA) == []


def test_the_base_imports_nothing_of_the_project() -> None:
    assert sources(*BASE)
    assert violations(BASE, PROJECT) == []


def test_the_item_tokenizer_imports_no_recsvc() -> None:
    assert violations(("tokenizer_rqvae",), ("recsvc",)) == []


def test_bundle_stands_beside_the_engine() -> None:
    assert violations(BUNDLE, ABOVE_BUNDLE) == []
    assert violations(BELOW_RECOMMENDER, ("recsvc.bundle",)) == []  # the engine, drafters, rules load no bundle


def test_service_imports_no_bench_or_cli() -> None:
    assert violations(("recsvc/service",), ABOVE_SERVICE) == []


def test_service_rooms_stand_in_order() -> None:
    service = ROOT / "recsvc" / "service"
    rooms = tuple(f"recsvc.service.{r}" for r in SERVICE_ROOMS)
    assert sorted(p.name for p in service.iterdir() if (p / "__init__.py").is_file()) == sorted((*SERVICE_ROOMS, "gen"))
    assert sorted(p.name for p in service.glob("*.py")) == sorted(SERVICE_LOOSE)
    for i, room in enumerate(SERVICE_ROOMS):
        assert violations((f"recsvc/service/{room}",), (*rooms[:i], "recsvc.service.cli")) == []
    loose = tuple(f"recsvc/service/{name}" for name in SERVICE_LOOSE if name not in ("__init__.py", "cli.py"))
    assert violations(loose, tuple(r for r in rooms if r != "recsvc.service.stores") + ("recsvc.service.cli",)) == []
    folders = [service, *(p for p in service.rglob("*") if p.is_dir() and p != service / "gen")]
    assert [(str(f.relative_to(ROOT)), n) for f in folders
            if (n := len(list(f.glob("*.py")))) > MAX_MODULES] == []


def test_benchmarks_and_harness_stand_outside_the_product() -> None:
    assert sources("bench") and sources("harness")
    assert violations(("recsvc", "tokenizer_rqvae", "training"), ("bench", "harness")) == []
    assert violations(("harness",), ("bench", "training")) == []  # the launchers need nothing of the benchmarks
    defined = {node.name for p in sources("bench") for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(node, ast.ClassDef | ast.FunctionDef)}
    assert defined.isdisjoint({"RedisProcess", "RedisClusterProcesses", "free_port"})  # harness/ defines them
    assert [m for p in sources("tests") for _, m in imports(p) if m.startswith("bench.") and "redis" in m] == []



def test_every_place_named_holds_source() -> None:
    places = (*BELOW_RECOMMENDER, *DATA_LAYER, *BASE, *BUNDLE, *RULES_TRIE_LEVEL, *RULES_DECODING, DRAFTER_REGISTRY,
              "recsvc/recommender", "recsvc/service", "bench", "recsvc/cli")
    assert [place for place in places if not sources(place)] == []
    modules = {*ABOVE_ENGINE, *ABOVE_DATA, *ABOVE_TRIE_RULES, *ABOVE_SERVICE}
    path_of = {m: m.replace(".", "/") for m in modules}
    assert sorted(m for m in modules if not sources(path_of[m]) and not sources(path_of[m] + ".py")) == []


def test_rules_are_two_layers() -> None:
    assert sources(*RULES_TRIE_LEVEL) and sources(*RULES_DECODING)
    assert violations(RULES_TRIE_LEVEL, ABOVE_TRIE_RULES) == []
    assert violations(RULES_DECODING, ABOVE_RECOMMENDER + ("recsvc.recommender",)) == []


def probes_of_a_recommender(path: Path) -> list[tuple[str, int, str]]:
    """``getattr(x, ...)`` / ``hasattr(x, ...)`` where x names a recommender (``rec``, ``recommender``,
    ``self.recommender``, ``base_rec``, ...)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args and RECOMMENDER_NAME.search(ast.unparse(node.args[0]))):
            out.append((str(path), node.lineno, ast.unparse(node)))
    return out


def test_the_service_reads_a_recommender_through_its_protocol(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("getattr(self.recommender, 'states', None)\nhasattr(rec, 'x')\ngetattr(args, 'k', 1)\n")
    assert [line for _, line, _ in probes_of_a_recommender(probe)] == [1, 2]  # the reader sees them
    assert [found for path in sources("recsvc/service") for found in probes_of_a_recommender(path)] == []


def imports_by_string(path: Path, root: Path = ROOT) -> list[tuple[str, int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("importlib.import_module", "import_module", "__import__", "importlib.__import__"):
                out.append((str(path.relative_to(root)), node.lineno, ast.unparse(node)))
    return out


def test_no_module_is_imported_by_a_string(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\nfrom importlib import import_module\nimportlib.import_module('training.cli')\n"
                     "import_module(name)\n__import__('bench.' + name)\n")
    assert [line for _, line, _ in imports_by_string(probe, tmp_path)] == [3, 4, 5]  # the reader sees each form
    found = [f for path in sources("recsvc", "training", "tokenizer_rqvae") for f in imports_by_string(path)]
    assert found == []
