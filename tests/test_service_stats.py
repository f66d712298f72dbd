"""What a response's stats say is what the server did: the decoding mode used beside the one requested (with
the reason when they differ), the beam width, N and gamma when it speculated; the Prometheus count by mode
used. A tiny bundle (random tiny target + LLaMA drafter) served by a real gRPC server on localhost, built the
way ``recsvc serve`` builds it."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.cli.main import build_parser
from recsvc.client.client import RecClient
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.startup import calibration, process
from recsvc.service.startup.calibration_cache import calibration_key, save_choice
from recsvc.service.startup.settings import ServeSettings

pytestmark = pytest.mark.usefixtures("one_thread")
# The choice a previous `--spec auto` start stored for this host, models and settings (BUNDLE/calibration.json):
# speculate at beam width 5 with N = 5, gamma = 2; plain decoding at every other width.
STORED = {1: (0, 0), 5: (5, 2), 10: (0, 0), 20: (0, 0)}
# beam width 0: each K searches K beams (its own calibration); no user-state cache: the forward counts asserted
# are those of a decode from scratch (a cached prompt or repeated request runs fewer)
FLAGS = ["--dtype", "fp32", "--beam-width", "0", "--state-cache-mb", "0"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("stats"), n_users=40)


def _serve_args(bundle, *flags: str):
    return build_parser().parse_args(["serve", "--bundle", str(bundle), "--port", "0", *FLAGS, *flags])


def _recommender(args):
    events: list[str] = []
    rec = process.load_recommender(args, step=lambda event, *a, **f: events.append(event))
    return rec, events


def _store_calibration(bundle, tmp_path):
    """A copy of the bundle whose stored calibration (made under this host's key: hardware, torch threads,
    models, serving settings) chose STORED."""
    root = tmp_path / "b"
    shutil.copytree(bundle, root)
    settings = ServeSettings.from_args(_serve_args(root))
    key = calibration_key(root, {**settings.calibration_settings(settings.beam_width, torch.get_num_threads()),
                                 "widths": list(calibration.CALIBRATION_KS)})  # width 0: the widths are the Ks
    assert save_choice(root, key, STORED)
    return root


def test_strict_request_reports_the_mode_the_calibration_chose(bundle, tmp_path, make_server) -> None:
    calibrated = _store_calibration(bundle, tmp_path)
    rec, events = _recommender(_serve_args(calibrated))
    assert "calibration_reused" in events and rec.spec.per_width == STORED  # serve's --spec auto took the stored choice
    server = make_server(rec)
    history = rec.popular_items(6)[1:5]
    with RecClient(server.address) as client:
        spec5 = client.recommend("u", history=history, k=5, mode="strict")
        plain5 = client.recommend("u", history=history, k=5, mode="plain")
        strict10 = client.recommend("u", history=history, k=10, mode="strict")
        default10 = client.recommend("u", history=history, k=10)  # UNSPECIFIED: the server's default (strict)
    # K = 5: it speculated, with the stored N and gamma
    s = spec5.stats
    assert (s.mode, s.requested_mode, s.draft_beams, s.gamma, s.beam_width) == (
        pb.STRICT_SPECULATIVE, pb.STRICT_SPECULATIVE, 5, 2, 5)
    assert s.mode_fallback_reason == "" and s.draft_forward_calls > 0
    assert [i.item_id for i in spec5.items] == [i.item_id for i in plain5.items]  # lossless
    p = plain5.stats
    assert (p.mode, p.requested_mode, p.draft_beams, p.gamma, p.mode_fallback_reason) == (
        pb.PLAIN, pb.PLAIN, 0, 0, "")
    # K = 10: calibration chose plain decoding, and the response says so
    for reply in (strict10, default10):
        t = reply.stats
        assert (t.mode, t.requested_mode, t.draft_beams, t.gamma, t.beam_width) == (
            pb.PLAIN, pb.STRICT_SPECULATIVE, 0, 0, 10)
        assert t.mode_fallback_reason == "calibration: speculation does not pay at beam width 10"
        assert t.draft_forward_calls == 0 and t.target_forward_calls == 4
    counted = server.metrics.registry.get_sample_value
    assert counted("recsvc_recommend_modes_total", {"mode": "strict", "requested": "strict"}) == 1
    assert counted("recsvc_recommend_modes_total", {"mode": "plain", "requested": "strict"}) == 2
    assert counted("recsvc_recommend_modes_total", {"mode": "plain", "requested": "plain"}) == 1


def test_speculation_off_and_no_drafter_are_reported(bundle, make_server) -> None:
    rec, _ = _recommender(_serve_args(bundle, "--spec", "off"))
    server = make_server(rec)
    history = rec.popular_items(6)[1:5]
    with RecClient(server.address) as client:
        strict = client.recommend("u", history=history, k=5, mode="strict").stats
        relaxed = client.recommend("u", history=history, k=5, mode="relaxed", seed=1).stats
        cold = client.recommend("nobody", k=5, mode="strict").stats
    assert (strict.mode, strict.mode_fallback_reason) == (pb.PLAIN, "speculation off (--spec off)")
    # relaxed without speculation: the target's own sampling beam search answered
    assert (relaxed.mode, relaxed.requested_mode, relaxed.draft_beams) == (pb.SAMPLING, pb.RELAXED_SPECULATIVE, 0)
    assert relaxed.mode_fallback_reason == "speculation off (--spec off)"
    assert (cold.mode, cold.requested_mode, cold.beam_width) == (pb.POPULARITY, pb.STRICT_SPECULATIVE, 0)
    assert cold.mode_fallback_reason == "no_history: popular items"

    rec, _ = _recommender(_serve_args(bundle, "--spec", "2:1"))  # fixed N:gamma; relaxed speculates too
    server = make_server(rec)
    with RecClient(server.address) as client:
        relaxed = client.recommend("u", history=history, k=5, mode="relaxed", seed=1).stats
        strict = client.recommend("u", history=history, k=5, mode="strict").stats
    assert (relaxed.mode, relaxed.draft_beams, relaxed.gamma) == (pb.RELAXED_SPECULATIVE, 5, 1)  # N >= K
    assert (strict.mode, strict.draft_beams, strict.gamma, strict.mode_fallback_reason) == (
        pb.STRICT_SPECULATIVE, 2, 1, "")

    nodrafter = tmp_copy_without_drafter(bundle)
    rec, _ = _recommender(_serve_args(nodrafter))
    server = make_server(rec)
    with RecClient(server.address) as client:
        strict = client.recommend("u", history=history, k=5, mode="strict").stats
    assert (strict.mode, strict.mode_fallback_reason) == (pb.PLAIN, "no drafter")


def tmp_copy_without_drafter(bundle):
    root = bundle.parent / "no-drafter"
    if not root.exists():
        shutil.copytree(bundle, root)
        shutil.rmtree(root / "drafter")
    return root
