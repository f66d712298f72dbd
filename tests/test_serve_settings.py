"""One served configuration: ``recsvc serve``, ``recsvc bench serve`` and ``recsvc bench processes`` resolve the
same ``ServeSettings`` (beam width, mode policy, precision) from the same flags, and bench serve measures and
records the configuration serve would serve."""

from __future__ import annotations

import json
import shutil

import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from bench.processes import serve_args
from recsvc.cli.main import build_parser, main
from recsvc.service.startup import process
from recsvc.service.startup.settings import DEFAULT_BEAM_WIDTH, ServeSettings

pytestmark = pytest.mark.usefixtures("one_thread")
CHANGED = ["--beam-width", "7", "--spec", "3:2", "--default-mode", "plain", "--dtype", "fp32", "--no-prior",
           "--rules-strategy", "postfilter", "--attention", "exact", "--startup-budget-s", "9"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("settings"), n_users=30)


def _resolved(command: list[str], bundle, flags: list[str]) -> ServeSettings:
    return ServeSettings.from_args(build_parser().parse_args([*command, "--bundle", str(bundle), *flags]))


@pytest.mark.parametrize("flags", [[], CHANGED], ids=["defaults", "changed"])
def test_serve_and_the_serving_benches_resolve_the_same_settings(bundle, flags) -> None:
    serve = _resolved(["serve"], bundle, flags)
    assert _resolved(["bench", "serve"], bundle, flags) == serve
    processes_args = build_parser().parse_args(["bench", "processes", "--bundle", str(bundle), *flags])
    processes = ServeSettings.from_args(processes_args)
    assert processes == serve
    # bench processes starts `recsvc serve` with serve_args(): they parse back to the same settings
    assert _resolved(["serve"], bundle, serve_args(processes_args, processes)) == serve
    if not flags:  # serve's defaults, which the benches cannot change on their own
        assert (serve.beam_width, serve.spec, serve.default_mode, serve.dtype) == (DEFAULT_BEAM_WIDTH, "auto",
                                                                                   "strict", "auto")
    else:
        assert (serve.beam_width, serve.spec, serve.default_mode, serve.dtype, serve.prior) == (7, "3:2", "plain",
                                                                                               "fp32", False)


def test_the_bundles_recorded_beam_width_is_everyones_default(bundle, tmp_path) -> None:
    root = tmp_path / "b"
    shutil.copytree(bundle, root)
    meta = json.loads((root / "bundle.json").read_text())
    (root / "bundle.json").write_text(json.dumps({**meta, "beam_width": 12}))
    assert _resolved(["serve"], root, []).beam_width == _resolved(["bench", "serve"], root, []).beam_width == 12


def test_bench_serve_measures_the_served_configuration(bundle, tmp_path, capsys) -> None:
    out = tmp_path / "serve.json"
    flags = ["--dtype", "fp32", "--spec", "off"]
    assert main(["bench", "serve", "--bundle", str(bundle), "--concurrency", "2", "--duration", "0.4", "--k", "5",
                 "--batching", "on", "--users", "4", "--history-len", "3", *flags, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    served = process.load_recommender(build_parser().parse_args(["serve", "--bundle", str(bundle), *flags]),
                                      step=lambda *a, **f: None)
    serving = report["serving"]
    assert {k: serving[k] for k in ServeSettings.__dataclass_fields__} == _resolved(["serve"], bundle,
                                                                                   flags).describe()
    assert serving["beam_width"] == served.beam_width == DEFAULT_BEAM_WIDTH
    assert serving["precision"] == "fp32" and serving["speculation_per_width"] == {"1": [0, 0]}
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"strict", "plain"}
    for row in rows.values():  # what the server reported doing: --spec off answers strict requests plainly
        assert row["ok"] > 0 and row["modes_used"] == {"PLAIN": row["ok"]}
        assert row["beam_widths"] == {str(DEFAULT_BEAM_WIDTH): row["ok"]}


def test_the_demo_serves_the_served_configuration(bundle, capsys) -> None:
    from recsvc.cli.demo import _serve_and_query

    _serve_and_query(bundle, startup_budget_s=5.0)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    stats = [line["stats"] for line in lines]
    assert [s["requested_mode"] for s in stats] == ["plain", "strict", "relaxed", "strict"]
    assert all(s["beam_width"] == DEFAULT_BEAM_WIDTH for s in stats[:2])  # serve's default width, not k
    assert stats[1]["mode"] in ("strict", "plain") and stats[-1]["mode"] == "popularity"  # the new user
    assert (stats[1]["mode"] == "plain") == bool(stats[1]["mode_fallback_reason"])
