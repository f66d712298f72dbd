"""`recsvc bench pairing`: the launch model's counts and ratios, checked by hand."""

from __future__ import annotations

import json

import pytest

import recsvc.cli.main as cli
from bench.pairing import HEAD, LaunchCosts, estimate, plain_counts, strict_counts


def test_counts_per_request():
    assert plain_counts() == plain_counts(4)
    p = plain_counts()
    assert (p.target_forwards, p.drafter_forwards, p.graphs) == (4, 0, 4)
    head = strict_counts(HEAD, prompt_in_verify=True)  # the head needs the prompt's forward: no single pass
    assert (head.target_forwards, head.drafter_forwards, head.graphs) == (2, 0, 7)
    llama = strict_counts("llama-68m", prompt_in_verify=True)
    assert (llama.target_forwards, llama.drafter_forwards, llama.graphs) == (1, 3, 7)
    assert strict_counts("llama-68m", target_calls=2.5).target_forwards == 2.5


def test_estimates_by_hand():
    # base: 12 layers; plain 4 x 12 = 48 layer-forwards, 48 * 0.14 + 4 * 0.25 = 7.72 ms
    # base + llama-68m (2 layers), prompt with the tree: 1 x 12 + 3 x 2 = 18, 18 * 0.14 + 7 * 0.25 = 4.27 ms
    e = estimate("base", "llama-68m", LaunchCosts(0.14, 0.25), prompt_in_verify=True)
    assert (e.plain_layer_forwards, e.strict_layer_forwards) == (48, 18)
    assert e.plain_ms == pytest.approx(7.72) and e.strict_ms == pytest.approx(4.27)
    assert e.speedup == pytest.approx(7.72 / 4.27, abs=1e-3) and e.ceiling == pytest.approx(48 / 18, abs=1e-3)
    # small (4 layers) + draft head: 2 x 4 = 8 layer-forwards; 3.24 ms plain against 2.87
    s = estimate("small", HEAD)
    assert (s.plain_ms, s.strict_ms, s.ceiling) == (pytest.approx(3.24), pytest.approx(2.87), 2.0)
    # a drafter with more layers per step than it saves cannot pay: small + llama-68m, prompt apart
    assert estimate("small", "llama-68m").speedup < 1.0
    # with no graph overhead the speed-up is the layer-forward ratio
    assert estimate("base", HEAD, LaunchCosts(0.1, 0.0)).speedup == pytest.approx(2.0)


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "pairing.json"
    assert cli.main(["bench", "pairing", "--targets", "small,base", "--drafters", "head,llama-68m",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| base | llama-68m | yes | 48 / 18 | 7.72 / 4.27 | 1.81x | 2.67x |" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and {r["target"] for r in rows} == {"small", "base"}


@pytest.mark.parametrize("argv", [["--targets", "huge"], ["--drafters", "small"], ["--layer-ms", "0"],
                                  ["--target-calls", "9"]])
def test_bad_input_exits_2(argv, capsys):
    assert cli.main(["bench", "pairing", *argv]) == 2
    assert "error:" in capsys.readouterr().err
