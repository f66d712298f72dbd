"""The forward plan (recsvc.engine.kernels.plan): resolved once from the flags, presets per hardware, and every flag
combination that used to fall back silently is an error with a message (UserError; the CLI exits 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from cli_commands import only_commands
from engine_helpers import tiny_llama

from recsvc.cli.main import main
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.plan import FORWARD_NAMES, FORWARDS, PRESETS, ForwardPlan, check_flags, resolve
from recsvc.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
NOT_EXACT = [name for name, f in FORWARDS.items() if f is not None and f.kernel != "lean"]

# (forward, attention, device, lean_ok, fast_ok, what the message names): each of these ran something else than
# asked before the plan, silently
CONTRADICTIONS = [
    *[(name, "exact", device, True, True, "--attention exact") for name in NOT_EXACT for device in ("cpu", "cuda")],
    ("compiled", "fp32", "cuda", True, True, "compiles for a CPU"),  # ran lean
    *[(name, "fp32", "cpu", True, False, "fp32 or bf16 only") for name in NOT_EXACT],  # an fp16 model: ran lean
    *[(name, "fp32", "cpu", False, False, "plain LLaMA") for name in FORWARDS if name != "auto"],  # transformers
]


@pytest.mark.parametrize(("forward", "attention", "device", "lean_ok", "fast_ok", "message"), CONTRADICTIONS,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'lean' if c[3] else 'nolean'}-{'fast' if c[4] else 'nofast'}"
                              for c in CONTRADICTIONS])
def test_each_contradiction_is_a_user_error(forward, attention, device, lean_ok, fast_ok, message) -> None:
    with pytest.raises(UserError, match=message):
        resolve(forward, attention, device, lean_ok, fast_ok)


@pytest.mark.parametrize("forward", NOT_EXACT)
def test_exact_attention_with_a_forward_that_is_not_exact_exits_2_before_loading(forward, tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    only_commands(monkeypatch, "serve")
    code = main(["serve", "--bundle", str(tmp_path / "none"), "--attention", "exact", "--forward", forward])
    err = capsys.readouterr().err
    assert code == 2 and "error: --attention exact" in err and f"--forward {forward}" in err
    assert "Traceback" not in err


def test_an_engine_model_refuses_what_its_model_cannot_run() -> None:
    model = tiny_llama(4, 8, 0)
    with pytest.raises(UserError, match="--attention exact"):
        EngineModel.build(model, "exact", forward="fast")
    half = EngineModel.build(tiny_llama(4, 8, 0).to(torch.float16), "fp32")
    assert half.plan.kernel == "lean"  # auto: the lean forward runs any dtype
    with pytest.raises(UserError, match="fp32 or bf16"):
        half.set_forward("bucketed")
    assert half.plan.kernel == "lean"  # nothing changed


def test_auto_resolves_to_the_preset_of_the_hardware() -> None:
    assert resolve("auto", "fp32", "cpu", True, True) == PRESETS["cpu"]
    assert resolve("auto", "fp32", "cuda", True, True) == PRESETS["gpu"]
    assert resolve("auto", "exact", "cpu", True, True) == PRESETS["reference"]
    assert resolve("auto", "exact", "cuda", True, True) == ForwardPlan("lean", "lean", "exact", "cuda")
    assert resolve("compiled", "fp32", "cpu", True, True) == PRESETS["compiled-cpu"]
    assert resolve("auto", "fp32", "cpu", False, False).kernel == "transformers"  # a PEFT wrapper, say
    assert resolve("auto", "fp32", "cpu", True, False).kernel == "lean"  # fp16


def test_every_valid_flag_value_still_resolves() -> None:
    for forward in FORWARD_NAMES:
        plan = resolve(forward, "fp32", "cpu", True, True)
        assert plan.attention == "fp32" and plan.device == "cpu" and not plan.capture
    for forward in ("auto", "lean"):
        assert resolve(forward, "exact", "cpu", True, True).exact
    # graphs capture on CUDA only: elsewhere the same plan uncaptured, named for what it is
    assert resolve("graphs", "fp32", "cpu", True, True).name == "bucketed"
    assert resolve("compiled-graphs", "fp32", "cpu", True, True).name == "compiled-bucketed"
    gpu = resolve("compiled-graphs", "fp32", "cuda", True, True)
    assert gpu.capture and gpu.static and gpu.compile == "layer" and gpu.prepares and gpu.name == "compiled-graphs"
    with pytest.raises(UserError, match="--forward must be one of"):
        check_flags("eager", "fp32")


def test_plan_fields_are_the_capabilities_searches_read() -> None:
    cpu, gpu, compiled = PRESETS["cpu"], PRESETS["gpu"], PRESETS["compiled-cpu"]
    assert cpu.fast and not cpu.sync_free and not cpu.prepares and not cpu.step_graphs
    assert gpu.sync_free and gpu.step_graphs and gpu.capture and gpu.prepares
    assert compiled.compiled_scoring and compiled.prepares and not compiled.step_graphs
    assert PRESETS["reference"].exact and not PRESETS["reference"].fast


def _compares_forward_names(path: Path) -> list[int]:
    """Lines where a comparison involves ``forward_name`` or a string naming a forward."""
    names = set(FORWARDS) | {"compiled-bucketed", "transformers"}
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            for part in parts:
                items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                if any(isinstance(i, ast.Attribute) and i.attr == "forward_name" for i in items) or any(
                        isinstance(i, ast.Constant) and i.value in names - {"auto", "fast", "lean"} for i in items):
                    lines.append(node.lineno)
    return lines


def test_the_service_and_the_searches_read_the_plan_not_names() -> None:
    for rel in ("recsvc/service/startup/settings.py", "recsvc/engine/search/beam_search.py",
                "recsvc/engine/caches/tree_cache.py", "recsvc/engine/speculation/strict/speculative.py",
                "recsvc/drafters/head.py", "recsvc/engine/kernels/engine_model.py"):
        path = ROOT / rel
        assert not _compares_forward_names(path), rel
        text = path.read_text()
        assert ".is_fast" not in text and ".captures" not in text and "model.sync_free" not in text, rel


def _calls(tree: ast.AST, name: str) -> int:
    """How many calls of a function or method named ``name`` (``F.silu(...)``, ``silu(...)``)."""
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call)
               and name in (getattr(n.func, "attr", None), getattr(n.func, "id", None)))


def test_the_decoder_layer_is_defined_once() -> None:
    """The layer's MLP (SiLU(gate) * up), its rotary and its norm are written in recsvc/engine/kernels/layer.py alone;
    every forward but transformers' own calls ``decoder_layer`` from there."""
    engine = ROOT / "recsvc" / "engine"
    silu, defs = {}, {}
    for path in sorted(engine.rglob("*.py")):
        tree = ast.parse(path.read_text())
        name = path.relative_to(engine).as_posix()
        silu[name] = _calls(tree, "silu")
        defs[name] = sorted(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                            and n.name in {"decoder_layer", "rotary", "_rotary", "_rotate_half", "_rms_norm",
                                           "exact_rms_norm"})
    layer = "kernels/layer.py"
    assert {name for name, n in silu.items() if n} == {layer} and silu[layer] == 1
    assert {name: d for name, d in defs.items() if d} == {layer: ["decoder_layer", "exact_rms_norm", "rotary"]}
    users = {path.relative_to(engine).as_posix() for path in engine.rglob("*.py") if "decoder_layer(" in
             path.read_text() or "slot_layer(" in path.read_text()} - {layer}
    assert users == {"kernels/lean.py", "kernels/fast.py", "kernels/compiled_stack.py", "kernels/compiled_layer.py"}
