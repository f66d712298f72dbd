"""The service with the real engine: a tiny bundle (random tiny LLaMA target + drafter, real tokenizer, real
trie) served by a real gRPC server on localhost."""

from __future__ import annotations

import threading

import grpc
import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle

from recsvc.client.client import RecClient
from recsvc.recommender.bundle_recommender import BundleRecommender


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"), n_users=80)


@pytest.fixture(scope="module")
def recommender(tiny_bundle):
    return BundleRecommender.from_bundle(tiny_bundle, dtype="fp32")


def test_modes_over_grpc(make_server, recommender) -> None:
    server = make_server(recommender)
    items = recommender.popular_items(8)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        client.record("u1", items[:4])
        plain = client.recommend("u1", k=5, mode="plain")
        strict = client.recommend("u1", k=5, mode="strict")
        relaxed = client.recommend("u1", k=5, mode="relaxed", seed=3, temperature=0.8)
        relaxed_again = client.recommend("u1", k=5, mode="relaxed", seed=3, temperature=0.8)
    ids = lambda r: [i.item_id for i in r.items]  # noqa: E731
    assert len(ids(plain)) == 5 and ids(strict) == ids(plain)  # lossless
    assert [round(i.score, 4) for i in strict.items] == [round(i.score, 4) for i in plain.items]
    assert plain.stats.target_forward_calls == 4 and 1 <= strict.stats.target_forward_calls <= 4
    assert ids(relaxed) == ids(relaxed_again)  # seeded
    assert all(len(i.semantic_id) == 4 for i in plain.items)


def test_exclusions_and_history_exclusion(make_server, recommender) -> None:
    server = make_server(recommender)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        first = [i.item_id for i in client.recommend("u2", history=[1, 2, 3], k=5, mode="plain").items]
        out = client.recommend("u2", history=[1, 2, 3] + first[:2], k=5, mode="strict", exclude_history=True,
                               exclude_items=[first[2]])
    got = [i.item_id for i in out.items]
    assert not set(got) & {1, 2, 3, *first[:3]}


def test_a_request_overrides_the_servers_history_exclusion(make_server, tiny_bundle) -> None:
    """A server that leaves history out (as a bundle tuned so is served) still lets a request ask for it back."""
    excluding = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32", exclude_history=True)
    server = make_server(excluding)
    ids = lambda r: [i.item_id for i in r.items]  # noqa: E731
    with RecClient(f"127.0.0.1:{server.port}") as client:
        top = ids(client.recommend("u4", history=[1, 2, 3], k=5, mode="plain", exclude_history=False))
        history = [1, 2, 3] + top[:2]  # the user's own best items, bought
        served = ids(client.recommend("u4", history=history, k=5, mode="plain"))
        kept = ids(client.recommend("u4", history=history, k=5, mode="plain", exclude_history=False))
        asked = ids(client.recommend("u4", history=history, k=5, mode="plain", exclude_history=True))
    assert not set(served) & set(history) and served == asked  # unset: as the server is configured
    assert set(kept) & set(history)  # the history's items are back in the list


def test_unknown_item_is_invalid_argument(make_server, recommender) -> None:
    server = make_server(recommender)
    with RecClient(f"127.0.0.1:{server.port}") as client, pytest.raises(grpc.RpcError) as err:
        client.recommend("u3", history=[1, 999_999], k=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "999999" in err.value.details()


def test_concurrent_clients_are_batched(make_server, recommender) -> None:
    server = make_server(recommender, max_batch=8, max_wait_ms=20)
    results, errors = [], []

    def call(i: int) -> None:
        try:
            with RecClient(f"127.0.0.1:{server.port}") as client:
                results.append(client.recommend(f"c{i}", history=[1 + i % 5, 2], k=3, mode="strict"))
        except grpc.RpcError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 12
    assert max(r.stats.batch_size for r in results) > 1


def test_calibration_picks_a_setting_per_width_and_keeps_results_exact(recommender) -> None:
    from recsvc.recommender.api import RecQuery
    from recsvc.service.startup.calibration import calibrate_speculation

    histories = [[1, 2, 3], [4, 5]]
    before = [r.item_ids for r in recommender.recommend([RecQuery(h, k=5, mode="plain") for h in histories])]
    spec = calibrate_speculation(recommender, "auto", None, step=lambda *a, **f: None, ks=(5,))
    choice = spec.per_width
    assert recommender.spec.per_width is None  # the calibrated recommender is not changed
    assert set(choice) == set(recommender.served_widths([5])) and all(n == 0 or n >= 1 for n, _ in choice.values())
    served = recommender.variant(spec=spec)
    after = [r.item_ids for r in served.recommend([RecQuery(h, k=5, mode="strict") for h in histories])]
    assert after == before


def test_relaxed_without_a_drafter_samples_from_the_target(tiny_bundle) -> None:
    from recsvc.recommender.api import RecQuery

    rec = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32", use_drafter=False)
    q = lambda seed: RecQuery([1, 2, 3], k=5, mode="relaxed", seed=seed, temperature=1.0)  # noqa: E731
    a, b = rec.recommend([q(1), q(1)])
    assert a.item_ids == b.item_ids and len(a.item_ids) == 5  # seeded: reproducible
    assert a.stats.target_calls == 4 and a.stats.accepted_steps == 0
    assert rec.recommend([RecQuery([1, 2, 3], k=5, mode="strict")])[0].stats.target_calls == 4  # plain


def test_auto_speculation_calibrates_on_the_bundles_validation_users(tiny_bundle, recommender, tmp_path) -> None:
    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import load_split_dir
    from recsvc.service.startup.calibration import calibration_histories

    data = load_split_dir(Bundle.open(tiny_bundle).resolve_data_dir())
    valid = {tuple(u.history[-50:]) for u in data.eval_users("valid")}
    histories, source = calibration_histories(recommender, str(tiny_bundle), n=4)
    assert source == "4 validation users" and len(histories) == 4 and all(tuple(h) in valid for h in histories)
    # no calibration histories in the bundle (here: no bundle at all): short lists of popular items
    histories, source = calibration_histories(recommender, str(tmp_path / "nowhere"), n=4)
    popular = set(recommender.popular_items(40))
    assert source == "popular items" and len(histories) == 4 and all(h and set(h) <= popular for h in histories)


def test_a_named_drafter_can_be_served(tiny_bundle, tmp_path) -> None:
    import shutil

    from recsvc.errors import UserError
    from recsvc.recommender.api import RecQuery

    named = tiny_bundle / "drafters" / "aligned"
    if not named.is_dir():
        shutil.copytree(tiny_bundle / "drafter", named)
    rec = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32", drafter_name="aligned")
    plain = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32", use_drafter=False)
    q = RecQuery([1, 2, 3], k=5, mode="strict")
    out, ref = rec.recommend([q])[0], plain.recommend([q])[0]
    assert rec.drafter is not None and out.item_ids == ref.item_ids  # strict: lossless with any drafter
    with pytest.raises(UserError, match="no drafter 'missing'"):
        BundleRecommender.from_bundle(tiny_bundle, dtype="fp32", drafter_name="missing")


def test_relaxed_at_the_temperature_bounds_returns_k_finite_items(make_server, recommender) -> None:
    import math

    server = make_server(recommender)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        for temperature in (0.05, 10.0):
            out = client.recommend("t", history=[1, 2, 3], k=5, mode="relaxed", temperature=temperature, seed=2)
            assert len(out.items) == 5 and out.fallback_reason == "", temperature
            assert all(math.isfinite(i.score) and i.score <= 0 for i in out.items), temperature
        with pytest.raises(grpc.RpcError) as err:
            client.recommend("t", history=[1, 2, 3], k=5, mode="relaxed", temperature=1e-20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_serve_process_is_not_serving_until_loaded_and_bounds_calibration(tiny_bundle) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from harness.redis_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", str(tiny_bundle), "--dtype", "fp32",
           "--port", str(port), "--spec", "auto", "--startup-budget-s", "0.001"]  # too short for a width
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    seen: list[str] = []
    try:
        # the port first, by TCP: a gRPC channel that failed to connect backs off for a second or more, longer than
        # a tiny bundle's load on an idle machine, and would miss the NOT_SERVING window
        import socket

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                seen[:] = ["DOWN"]
                time.sleep(0.005)
        with RecClient(f"127.0.0.1:{port}", timeout_s=2) as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = client.health()
                except grpc.RpcError:
                    status = "DOWN"
                if not seen or seen[-1] != status:
                    seen.append(status)
                if status == "SERVING":
                    break
                time.sleep(0.005)  # the NOT_SERVING window of a tiny bundle is short on an idle machine
            assert "NOT_SERVING" in seen and seen[-1] == "SERVING", seen
            assert seen.index("NOT_SERVING") < seen.index("SERVING")
            assert len(client.recommend("u", history=[1, 2], k=5).items) == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        events = {}
        for line in proc.stderr.read().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and "event" in entry:
                events.setdefault(entry["event"], entry)
        for step in ("listening", "loading_bundle", "loading_models", "models_loaded", "calibrating", "serving"):
            assert step in events, (step, sorted(events))
        exhausted = events["calibration_budget_exhausted"]
        assert exhausted["untuned_widths"] and exhausted["untuned_widths"][-1] == 20
        serving = events["serving"]
        assert serving["bundle"] == str(tiny_bundle) and serving["port"] == port and serving["spec"] == "auto"
        assert all(serving["speculation_per_width"][str(w)] == [0, 0] for w in exhausted["untuned_widths"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_auto_calibration_is_stored_and_reused_on_the_same_hardware_models_and_settings(tiny_bundle, tmp_path) -> None:
    import json
    import shutil

    from recsvc.service.startup.calibration import calibrate_speculation

    root = tmp_path / "b"
    shutil.copytree(tiny_bundle, root)
    rec = BundleRecommender.from_bundle(root, dtype="fp32")
    events: list[str] = []

    def step(event, level=None, **fields):
        events.append(event)

    settings = {"dtype": "fp32", "attention": "fp32", "drafter": None}
    first = calibrate_speculation(rec, "auto", str(root), step=step, ks=(1, 5), cache_settings=settings)
    assert "calibrated" in events and (root / "calibration.json").is_file()
    events.clear()
    again = calibrate_speculation(rec, "auto", str(root), step=step, ks=(1, 5), cache_settings=settings)
    assert again == first and events == ["calibration_reused"] and again.per_width
    # other settings, other K values or a retrained model: calibrate again
    for ks, other in (((1, 5), {**settings, "attention": "exact"}), ((1, 10), settings)):
        events.clear()
        calibrate_speculation(rec, "auto", str(root), step=step, ks=ks, cache_settings=other)
        assert "calibration_reused" not in events and "calibrated" in events
    weights = next((root / "target").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # same bytes, new mtime: counts as a new model
    events.clear()
    calibrate_speculation(rec, "auto", str(root), step=step, ks=(1, 10), cache_settings=settings)
    assert "calibration_reused" not in events
    # a damaged file is ignored, never an error
    (root / "calibration.json").write_text("{not json")
    events.clear()
    calibrate_speculation(rec, "auto", str(root), step=step, ks=(1, 10), cache_settings=settings)
    assert "calibrated" in events and json.loads((root / "calibration.json").read_text())["choice"]
