"""`recsvc catalog add|retire|show` on a bundle whose ids came from a tiny RQ-VAE build (`recsvc build --ids`
copies the RQ-VAE into BUNDLE/ids): collision-free ids for new items with the real MiniLM embedder, a valid
cumulative file, and user mistakes as `error: ...` with exit code 2 that leave the file untouched."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cli_commands import only_commands
from test_rqvae_build import HashEmbedder, _catalog

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.catalog.file import CATALOG_FILE, read_catalog
from recsvc.cli.catalog import add_items
from tokenizer_rqvae.build import build_semantic_ids
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.rqvae import RQVAEConfig

RQVAE_FILES = ("rqvae.safetensors", "rqvae_config.json", "report.json")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """The real entry point, limited to the groups under test (others may be mid-edit)."""
    only_commands(monkeypatch, "catalog", "build")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A 60-item catalog's ids from a small RQ-VAE over the real MiniLM embeddings (cached in tmp), then a
    bundle's ids stage from them."""
    root = tmp_path_factory.mktemp("catalog-cli")
    data = root / "data"
    data.mkdir()
    (data / "items.json").write_text(json.dumps(_catalog()))
    # fp32: bf16 autocast gives batch-size dependent codes on some CPUs (a lone item may not encode as in a batch);
    # 16 codes per level: with more codes than the 60 items, k-means leaves near-duplicate codewords, and an item
    # encoded alone could pick another of them than in the build's batch (seen on an AMX CPU)
    cfg = replace(RQVAEConfig(), hidden_dims=(64,), latent_dim=8, epochs=3, batch_size=32, precision="fp32",
                  codebook_size=16)
    build_semantic_ids(data, root / "ids", cfg, cache_dir=root / "cache", progress=False)
    bundle = root / "bundle"
    assert cli.main(["build", "--data", str(data), "--out", str(bundle), "--ids", str(root / "ids" /
                     "semantic_ids.json"), "--stages", "ids"]) == 0
    return {"root": root, "data": data, "ids": root / "ids", "bundle": bundle, "cache": root / "cache"}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_ids_stage_copies_the_rqvae_into_the_bundle(built) -> None:
    ids_dir = Bundle.open(built["bundle"]).ids_dir
    for name in RQVAE_FILES:
        assert (ids_dir / name).read_bytes() == (built["ids"] / name).read_bytes(), name


def test_catalog_add_retire_show_write_a_valid_cumulative_file(built, capsys) -> None:
    bundle = built["bundle"]
    base = Bundle.open(bundle).load_ids()
    catalog = _catalog()
    new = built["root"] / "new.json"
    # 61 has item 20's text: the same raw id, so it must be moved to a free one; 62 is new text
    new.write_text(json.dumps({"61": {**catalog["20"], "asin": "N1"},
                               "62": {"asin": "N2", "title": "Vanilla body scrub", "brand": "Acme"}}))
    rc, out, err = _run(["catalog", "add", "--bundle", str(bundle), "--items", str(new), "--retire", "3",
                         "--cache-dir", str(built["cache"]), "--quiet"], capsys)  # the real MiniLM embedder
    assert rc == 0, err
    report = json.loads(out)
    assert report["version"] == 1 and report["added"] == 2 and report["retired"] == 1 and report["moved"] >= 1
    path = bundle / CATALOG_FILE
    first = read_catalog(path, base, 384)  # what the server validates
    assert first.item_ids.tolist() == [61, 62] and first.retired.tolist() == [3]
    assert first.merged_ids(base).collisions() == 0 and first.codes.max() < 256
    assert np.allclose(np.linalg.norm(first.vectors, axis=1), 1.0, atol=1e-4)  # MiniLM: unit vectors
    # a second addition: unique against the bundle and the first one, version 2, the first kept as it was
    more = built["root"] / "more.json"
    more.write_text(json.dumps({"63": {"asin": "N3", "title": "Vanilla body scrub", "brand": "Acme"}}))
    assert _run(["catalog", "add", "--bundle", str(bundle), "--items", str(more), "--cache-dir",
                 str(built["cache"]), "--quiet"], capsys)[0] == 0
    second = read_catalog(path, base, 384)
    assert second.version == 2 and second.item_ids.tolist() == [61, 62, 63]
    assert second.codes[:2].tolist() == first.codes.tolist() and second.merged_ids(base).collisions() == 0
    assert first.keys == ("N1", "N2") and second.keys == ("N1", "N2", "N3")  # each item's asin is its key
    taken = built["root"] / "taken.json"  # an asin that an added item's key already is: refused, file untouched
    taken.write_text(json.dumps({"64": {"asin": "N3", "title": "Rose soap"}}))
    rc, _, err = _run(["catalog", "add", "--bundle", str(bundle), "--items", str(taken), "--cache-dir",
                       str(built["cache"]), "--quiet"], capsys)
    assert rc == 2 and "its asin 'N3' is already item 63's key" in err
    assert read_catalog(path, base, 384).version == 2
    rc, out, _ = _run(["catalog", "retire", "--bundle", str(bundle), "--items", "62, 5"], capsys)
    assert rc == 0 and json.loads(out)["version"] == 3
    rc, out, _ = _run(["catalog", "show", "--bundle", str(bundle)], capsys)
    shown = json.loads(out)
    assert rc == 0 and shown["added"] == [61, 62, 63] and shown["retired"] == [3, 5, 62]
    assert shown["items"] == len(base) + 3 - 3 and [p.name for p in bundle.glob(".catalog_live.json.*tmp")] == []
    # the served ids for the next bundle: every item (retired ones too), the additions under their served ids
    out = built["root"] / "merged.json"
    assert _run(["catalog", "ids", "--bundle", str(bundle), "--out", str(out)], capsys)[0] == 0
    merged = SemanticIds.load(out)
    assert merged.item_ids.tolist() == base.item_ids.tolist() + [61, 62, 63]
    assert [merged.codes_of(i) for i in (61, 62, 63)] == [tuple(r) for r in second.codes.tolist()]


def test_user_mistakes_exit_2_with_a_clear_error_and_leave_the_file(built, capsys, tmp_path) -> None:
    bundle = built["bundle"]
    file = tmp_path / "live.json"
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"70": {"asin": "N70", "title": "Cedar beard oil"}}))
    add = ["catalog", "add", "--bundle", str(bundle), "--catalog", str(file), "--cache-dir", str(built["cache"]),
           "--quiet"]
    # a valid start, embedded with the hash embedder through the same function the command runs
    add_items(bundle, new, catalog_path=file, embedder=HashEmbedder(cache_dir=built["cache"], progress=False))
    text = file.read_text()
    known = tmp_path / "known.json"
    known.write_text(json.dumps({"3": _catalog()["3"], "70": {"asin": "N70", "title": "again"}}))
    cases = [
        (add + ["--items", str(known)], "item(s) of", "are already in the catalog: [3, 70]"),
        (add + ["--items", str(tmp_path / "missing.json")], "items file not found", ""),
        (add + ["--items", str(new), "--retire", "x"], "--retire: 'x' is not a positive item id", ""),
        (add + ["--items", str(new), "--ids-dir", str(tmp_path)], "holds no RQ-VAE", "--ids-dir"),
        (["catalog", "retire", "--bundle", str(bundle), "--catalog", str(file), "--items", "999"],
         "cannot retire unknown item(s) [999]", ""),
        (["catalog", "retire", "--bundle", str(bundle), "--catalog", str(file), "--items", ""],
         "no items to retire", ""),
        (["catalog", "show", "--bundle", str(tmp_path)], "not a bundle", ""),
    ]
    for argv, message, more in cases:
        rc, out, err = _run(argv, capsys)
        assert rc == 2 and err.startswith("error: ") and message in err and more in err, (argv, err)
        assert "Traceback" not in err and file.read_text() == text
    assert _run(["catalog", "retire", "--bundle", str(bundle), "--catalog", str(file), "--items", "70"],
                capsys)[0] == 0
    rc, _, err = _run(["catalog", "retire", "--bundle", str(bundle), "--catalog", str(file), "--items", "70"], capsys)
    assert rc == 2 and "item(s) [70] are retired already" in err
    file.write_text('{"version": 1, "add": [], "retire": [999]}')  # a hand edit gone wrong
    rc, _, err = _run(["catalog", "retire", "--bundle", str(bundle), "--catalog", str(file), "--items", "4"], capsys)
    assert rc == 2 and "retire[0]: item 999" in err and "fix or remove the file first" in err
