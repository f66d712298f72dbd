"""`recsvc tokenizer build|assign` end to end on a tiny catalog (real MiniLM, cache in tmp), plus errors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from recsvc.cli.main import main
from recsvc.errors import UserError
from tokenizer_rqvae.build import build_semantic_ids
from tokenizer_rqvae.embed import Embedder
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.rqvae import RQVAEConfig

REPORT_KEYS = {"collisions_before", "collisions_after", "codebook_usage", "recon_mse", "seconds",
               "seconds_embedding", "items", "collision_groups_before", "reference"}
WORDS = ["rose", "lavender", "argan", "matte", "glow", "repair", "volume", "silk", "citrus", "charcoal"]
KINDS = ["shampoo", "lipstick", "serum", "mascara", "soap", "lotion"]


def _catalog(n: int = 60) -> dict[str, dict]:
    items: dict[str, dict] = {}
    for i in range(1, n + 1):
        title = f"{WORDS[i % len(WORDS)].title()} {KINDS[(i // 3) % len(KINDS)]} {i % 7} oz"
        meta: dict = {"asin": f"B{i:09d}", "title": title}
        if i % 4 == 0:
            meta["brand"] = "Acme"
            meta["categories"] = [["Beauty", KINDS[i % len(KINDS)].title()]]
        items[str(i)] = meta
    items["5"]["title"] = None  # unknown title
    for dup in (10, 11, 12):  # identical texts: these must collide before resolution
        items[str(dup)] = {"asin": "BDUP", "title": "Same Exact Soap"}
    return items


class HashEmbedder(Embedder):
    """Real cache logic, fake model: a deterministic vector per text (identical texts -> identical vectors)."""

    def _encode(self, texts: list[str]) -> np.ndarray:
        rows = []
        for t in texts:
            seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
            v = np.random.default_rng(seed).normal(size=384)
            rows.append(v / np.linalg.norm(v))
        return np.asarray(rows, dtype=np.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    data = root / "data"
    data.mkdir()
    (data / "items.json").write_text(json.dumps(_catalog()))
    ref = {str(i): [f"<a_{i % 3}>", f"<b_{i % 5}>", "<c_0>", "<d_0>"] for i in range(1, 61)}
    (data / "reference_semantic_ids.json").write_text(json.dumps(ref))
    paths = {"root": root, "data": data, "out": root / "ids", "cache": root / "cache"}
    rc = main(["tokenizer", "build", "--data", str(data), "--out", str(paths["out"]), "--epochs", "3",
               "--cache-dir", str(paths["cache"]), "--quiet"])
    assert rc == 0
    return paths


def test_build_cli_writes_collision_free_ids_and_report(built: dict[str, Path]) -> None:
    out = built["out"]
    for name in ("semantic_ids.json", "rqvae.safetensors", "rqvae_config.json", "report.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["items"] == 60 and report["collisions_after"] == 0
    assert report["collisions_before"] >= 2 and report["collision_groups_before"] >= 1  # the 3 duplicates
    assert report["embeddings_computed"] == 58 and report["embeddings_cached"] == 0  # 3 identical texts
    assert len(report["codebook_usage"]) == 4 and all(0 < u <= 1 for u in report["codebook_usage"])
    assert report["reference"]["codes_used"][:2] == [3, 5] and report["reference"]["collisions"] > 0
    ids = SemanticIds.load(out / "semantic_ids.json")
    assert len(ids) == 60 and ids.collisions() == 0
    assert ids.item_ids.tolist() == list(range(1, 61))


def test_second_build_hits_the_cache(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(Embedder, "_encode", lambda self, t: pytest.fail("re-embedded a cached text"))
    out2 = built["root"] / "ids2"
    rc = main(["tokenizer", "build", "--data", str(built["data"]), "--out", str(out2), "--epochs", "3",
               "--cache-dir", str(built["cache"]), "--quiet"])
    assert rc == 0
    report = json.loads((out2 / "report.json").read_text())
    assert report["embeddings_computed"] == 0 and report["embeddings_cached"] == 60
    assert "0 embedded, 60 cached" in capsys.readouterr().out
    # same seed, same embeddings -> the same ids
    assert (out2 / "semantic_ids.json").read_text() == (built["out"] / "semantic_ids.json").read_text()


def test_assign_cli_keeps_catalog_and_uniqueness(built: dict[str, Path], tmp_path: Path) -> None:
    catalog = _catalog()
    new = {
        "61": {"asin": "N1", "title": "Same Exact Soap"},  # same text as items 10-12: same raw id
        "62": {"asin": "N2", "title": "Same Exact Soap"},
        "63": {"asin": "N3", "title": catalog["20"]["title"]},
        "64": {"asin": "N4", "title": "Brand new vanilla body scrub"},
        "3": catalog["3"],  # already in the catalog: keeps its id
    }
    (tmp_path / "new.json").write_text(json.dumps(new))
    merged_path = tmp_path / "merged.json"
    rc = main(["tokenizer", "assign", "--ids", str(built["out"]), "--items", str(tmp_path / "new.json"),
               "--out", str(merged_path), "--cache-dir", str(built["cache"]), "--quiet"])
    assert rc == 0
    before = SemanticIds.load(built["out"] / "semantic_ids.json")
    merged = SemanticIds.load(merged_path)
    assert len(merged) == 64 and merged.collisions() == 0
    for item in before.item_ids.tolist():
        assert merged.codes_of(item) == before.codes_of(item)


def test_build_function_resolves_heavy_collisions(tmp_path: Path) -> None:
    """Tiny id space (3 levels x 4 codes = 64 ids) and 60 items, a third of them identical."""
    items = {str(i): {"asin": f"A{i}", "title": f"item {i}" if i % 3 else "clone"} for i in range(1, 61)}
    (tmp_path / "items.json").write_text(json.dumps(items))
    cfg = replace(RQVAEConfig(), hidden_dims=(64,), latent_dim=8, levels=3, codebook_size=4, epochs=3,
                  batch_size=32)
    emb = HashEmbedder(cache_dir=tmp_path / "cache", progress=False)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = build_semantic_ids(tmp_path, tmp_path / "out", cfg, embedder=emb, progress=False)
        assert torch.get_num_threads() == 1  # the library ran on every core and restored the caller's setting
    finally:
        torch.set_num_threads(caller_threads)
    assert report["collisions_before"] >= 19 and report["collisions_after"] == 0
    ids = SemanticIds.load(tmp_path / "out" / "semantic_ids.json", 4)
    assert ids.collisions() == 0 and ids.levels == 3 and "reference" not in report


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse rejects bad flag values itself (exit 2)
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def test_cli_errors_exit_2_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        built: dict[str, Path]) -> None:
    out = str(tmp_path / "o")
    rc, err = _run(["tokenizer", "build", "--data", str(tmp_path / "nope"), "--out", out], capsys)
    assert rc == 2 and "data directory not found" in err
    (tmp_path / "items.json").write_text("{not json")
    rc, err = _run(["tokenizer", "build", "--data", str(tmp_path), "--out", out], capsys)
    assert rc == 2 and "not valid JSON" in err
    (tmp_path / "items.json").write_text(json.dumps({"1": ["not", "an", "object"]}))
    rc, err = _run(["tokenizer", "build", "--data", str(tmp_path), "--out", out], capsys)
    assert rc == 2 and "expected an object" in err
    rc, err = _run(["tokenizer", "build", "--data", str(tmp_path), "--out", out, "--epochs", "-1"], capsys)
    assert rc == 2 and "--epochs" in err
    rc, err = _run(["tokenizer", "build", "--data", str(tmp_path), "--out", out, "--model", "/no/model"], capsys)
    assert rc == 2 and "--model" in err
    if not torch.cuda.is_available():
        rc, err = _run(["tokenizer", "build", "--data", str(built["data"]), "--out", out, "--device", "cuda"],
                       capsys)
        assert rc == 2 and "CUDA" in err
    rc, err = _run(["tokenizer", "assign", "--ids", str(tmp_path / "none"), "--items", "x.json", "--out", out],
                   capsys)
    assert rc == 2 and "ids directory not found" in err
    rc, err = _run(["tokenizer", "assign", "--ids", str(built["out"]), "--items", str(tmp_path / "missing.json"),
                    "--out", out], capsys)
    assert rc == 2 and "items file not found" in err
    rc, err = _run(["tokenizer", "build", "--data", str(tmp_path)], capsys)
    assert rc == 2 and "--out" in err


def test_cold_start_protocol_fits_on_known_items_and_places_the_rest(tmp_path: Path) -> None:
    """--known-through train: the RQ-VAE sees only items of the train period; the others (interacted with only
    later) get collision-free ids from the fitted encoder and are listed in assigned_later.json."""
    items = {str(i): {"asin": f"A{i}", "title": f"item {i}" if i % 3 else "clone"} for i in range(1, 41)}
    (tmp_path / "items.json").write_text(json.dumps(items))
    # items 1-30 in train, 31-35 first in valid, 36-40 first in test
    (tmp_path / "sequential_train.txt").write_text("1 " + " ".join(map(str, range(1, 31))) + "\n")
    (tmp_path / "sequential_valid.txt").write_text("1 " + " ".join(map(str, range(31, 36))) + "\n")
    (tmp_path / "sequential_test.txt").write_text("1 " + " ".join(map(str, range(36, 41))) + "\n")
    cfg = replace(RQVAEConfig(), hidden_dims=(64,), latent_dim=8, levels=3, codebook_size=4, epochs=3,
                  batch_size=16)
    emb = HashEmbedder(cache_dir=tmp_path / "cache", progress=False)
    for through, later in (("train", list(range(31, 41))), ("valid", list(range(36, 41)))):
        out = tmp_path / f"out-{through}"
        report = build_semantic_ids(tmp_path, out, cfg, embedder=emb, progress=False, known_through=through)
        rec = json.loads((out / "assigned_later.json").read_text())
        assert rec == {"known_through": through, "items": later}
        assert report["fit_items"] == 40 - len(later) and report["assigned_later"] == len(later)
        ids = SemanticIds.load(out / "semantic_ids.json", 4)
        assert len(ids) == 40 and ids.collisions() == 0
    # without the protocol: no record (a stale one from an earlier run is removed)
    report = build_semantic_ids(tmp_path, tmp_path / "out-valid", cfg, embedder=emb, progress=False)
    assert report["assigned_later"] == 0 and not (tmp_path / "out-valid" / "assigned_later.json").exists()
    with pytest.raises(UserError, match="known-through"):
        build_semantic_ids(tmp_path, tmp_path / "o", cfg, embedder=emb, progress=False, known_through="test")
