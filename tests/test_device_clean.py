"""Device-clean engine: every tensor factory call in the engine, drafters, rules (both rooms) and the trie names its
device.

A factory call without ``device=`` allocates on the CPU whatever the model's device is, so on a GPU the search
would mix devices (an error) or copy every step. The test walks the source with ``ast`` and fails on such a
call, unless it is listed in ``HOST_ON_PURPOSE`` below with the reason it is deliberately on the host (built
there once, then moved), or it is immediately moved (``torch.tensor(...).to(device)``). ``*_like`` and
``Tensor.new_*`` calls inherit their device and are not factories here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*(f for folder in ("engine", "drafters", "rules", "rule_decoding")
             for f in sorted((ROOT / "recsvc" / folder).rglob("*.py"))), ROOT / "tokenizer_rqvae" / "trie.py"]
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
             "randperm", "linspace", "logspace", "eye", "from_numpy"}

# "file:function:factory" -> why the call is deliberately on the host
HOST_ON_PURPOSE = {
    # the trie is built with numpy on the host once; CatalogTrie.to(device) moves its tensors once per device
    "tokenizer_rqvae/trie.py:CatalogTrie.__init__:from_numpy": "built on the host, moved once by CatalogTrie.to",
    # one CPU generator per request (seeded results do not depend on the device); its noise is moved in one copy
    "recsvc/engine/search/sampling.py:make_generators:randint": "a host seed for an unseeded request's CPU generator",
    "recsvc/engine/search/sampling.py:uniform:rand": "drawn from the request's CPU generator, moved once (uniform)",
    "recsvc/engine/search/noise.py:NoiseStream.__init__:rand":
        "drawn ahead from the requests' CPU generators, moved once",
    # module parameters are created by nn.Module.__init__ and moved with the module (.to(device))
    "recsvc/drafters/head_model.py:DraftHead.__init__:randn": "an nn.Parameter's initial value (module.to moves it)",
    "recsvc/drafters/head_model.py:DraftHead.__init__:zeros": "an nn.Parameter's initial value (module.to moves it)",
}


def _factory_calls(path: Path):
    """(qualified function name, factory, line) of every torch.<factory>(...) call without device=."""
    tree = ast.parse(path.read_text())
    moved: set[int] = set()  # calls whose result is .to(...)-ed at once
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                and isinstance(node.func.value, ast.Call)):
            moved.add(id(node.func.value))
    out = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                    and child.func.attr in FACTORIES and id(child) not in moved
                    and not any(kw.arg == "device" for kw in child.keywords)):
                out.append((".".join(scope) or "<module>", child.func.attr, child.lineno))
            visit(child, scope)

    visit(tree, [])
    return out


def test_every_tensor_factory_names_its_device() -> None:
    found, used = [], set()
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for func, factory, line in _factory_calls(path):
            key = f"{rel}:{func}:{factory}"
            if key in HOST_ON_PURPOSE:
                used.add(key)
            else:
                found.append(f"{rel}:{line} torch.{factory}(...) in {func} has no device=")
    assert not found, "tensor factories without device= (pass the model's device, or list the call in " \
                      "HOST_ON_PURPOSE with the reason):\n" + "\n".join(found)
    assert used == set(HOST_ON_PURPOSE), f"stale allow-list entries: {sorted(set(HOST_ON_PURPOSE) - used)}"


def test_the_walker_flags_a_cpu_factory_and_accepts_device_and_moved_calls(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import torch\n"
                   "def f(x):\n"
                   "    a = torch.zeros(3)\n"
                   "    b = torch.zeros(3, device=x.device)\n"
                   "    c = torch.tensor([1]).to(x.device)\n"
                   "    d = torch.zeros_like(x)\n"
                   "    return torch.full((2,), 1)\n")
    assert _factory_calls(src) == [("f", "zeros", 3), ("f", "full", 7)]

