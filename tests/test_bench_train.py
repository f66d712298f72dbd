"""`recsvc bench train` on a tiny bundle: a row per variant with its throughput, and fused AdamW (the training
loop's optimizer) taking the same steps as the foreach one."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "bench")


def test_bench_train_reports_each_variant(tmp_path) -> None:
    root = make_tiny_bundle(tmp_path, n_users=30)
    out = tmp_path / "train.json"
    assert cli.main(["bench", "train", "--bundle", str(root), "--presets", "tiny", "--steps", "2",
                     "--optimizers", "foreach,fused", "--batch-size", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["optimizer"], r["precision"]) for r in res["rows"]] == [("foreach", "fp32"), ("fused", "fp32")]
    for row in res["rows"]:
        assert row["tokens_per_s"] > 0 and row["model_gflops_per_s"] > 0 and row["steps"] == 2
    assert res["rows"][0]["vs_first"] == 1.0 and 0 < res["labelled_share"] < 1
    assert cli.main(["bench", "train", "--bundle", str(root), "--optimizers", "sgd"]) == 2  # a clear error


def test_fused_adamw_takes_the_foreach_steps() -> None:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))
    x, y = torch.randn(64, 16), torch.randn(64, 8)
    params = []
    for fused in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=fused)
        for _ in range(5):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=1e-5)
