"""The container image, built and run (`make image-smoke`): a tiny bundle made by the repository's own commands,
mounted read-only into the image, checked from outside through the published port by deploy/docker/image_smoke.py.

Runs when a Docker daemon answers; skipped, with the reason, otherwise. The image is (re)built from this checkout with
`make image` within RECSVC_IMAGE_BUILD_TIMEOUT_S (default 900 s; skipped past it, or where the Docker client has no
BuildKit); with the build cache that takes seconds when nothing changed.
The Docker client: $DOCKER (as the Makefile's), else `make image` picks one that can build
(deploy/docker/pick-docker.sh) and the checks run `docker`; RECSVC_IMAGE names another image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "deploy" / "docker" / "image_smoke.py"
IMAGE = os.environ.get("RECSVC_IMAGE", "recsvc:0.1.0-cpu")
BUILD_TIMEOUT_S = float(os.environ.get("RECSVC_IMAGE_BUILD_TIMEOUT_S", "900"))
GRACE_S = 10

sys.path.insert(0, str(SMOKE.parent))
from image_smoke import DOCKER, daemon_answers  # noqa: E402

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _image_ready() -> None:
    """The image of this checkout: `make image` (quick when the build cache holds every layer)."""
    version = daemon_answers()
    if version is None:
        pytest.skip("no Docker daemon answers (`docker version`): the image cannot be built or run here")
    try:
        build = subprocess.run(["make", "image", f"IMAGE={IMAGE}"], cwd=REPO, capture_output=True, text=True,
                               timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`make image` did not finish within {BUILD_TIMEOUT_S:g} s (RECSVC_IMAGE_BUILD_TIMEOUT_S)")
    output = build.stdout + build.stderr
    no_buildkit = ("buildx component is missing", "cannot build with BuildKit")  # Docker's words, pick-docker.sh's
    if build.returncode != 0 and any(words in output for words in no_buildkit):
        pytest.skip("the Docker client has no BuildKit (buildx), which the Dockerfile needs: "
                    "DOCKER=<a client with buildx, or a 20.10 client>")
    assert build.returncode == 0, f"make image failed:\n{output[-3000:]}"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A tiny bundle through the product's commands: synthetic data, RQ-VAE ids, the tiny target and an SFT
    drafter (so that the server calibrates speculation at start-up, on a read-only mount; ~1 min)."""
    _image_ready()
    root = tmp_path_factory.mktemp("image-smoke")
    for argv in (["data", "synth", "--out", str(root / "data"), "--items", "80", "--users", "160", "--seed", "0"],
                 ["build", "--data", str(root / "data"), "--out", str(root / "bundle"), "--preset", "tiny",
                  "--epochs", "1", "--prompt", "compact", "--window-stride", "5", "--recall-users", "64",
                  "--eval-users", "64", "--drafter-preset", "drafter-tiny", "--drafter-epochs", "1",
                  "--threads", "1"]):
        run = subprocess.run([sys.executable, "-m", "recsvc.cli.main", *argv], env=_env(), capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
    # the image's user (10001) reads the bundle; safetensors writes its files 0600
    subprocess.run(["chmod", "-R", "a+rX", str(root / "bundle")], check=True)
    return root / "bundle"


def test_the_image_serves_a_mounted_bundle_and_stops_cleanly_on_sigterm(bundle, tmp_path):
    summary_path = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, str(SMOKE), "--image", IMAGE, "--bundle", str(bundle), "--grace-s",
                          str(GRACE_S), "--startup-timeout-s", "180", "--json", str(summary_path)],
                         env=_env(), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    # the server (PID 1) runs as the image's numeric non-root user; so does `docker exec`
    uid = summary["image_user"].split(":")[0]
    assert uid != "0" and summary["pid1_uids"] == [uid] * 4 and summary["exec_uid"] == uid
    assert "/bin/recsvc serve --bundle /models/bundle " in summary["pid1_cmdline"]
    # published on the loopback only; health SERVING seen through it, and Docker's HEALTHCHECK healthy
    assert summary["published"].startswith("127.0.0.1:")
    assert summary["docker_health"] == "healthy"
    # the bundle has a drafter: the server calibrated speculation, and could not store it on the read-only mount
    events = [e.split("(")[0] for e in summary["startup_events"]]
    startup = [e for e in events if e != "bundle_watching"]  # the bundle watch starts once serving, logged after it
    assert "calibrating" in startup and startup[-1] == "serving"
    assert "calibration_not_stored" in events or "calibration_budget_exhausted" in events
    # the three calls through the published port
    assert len(summary["recommend_cold"]) == 5 and summary["history"] == summary["recorded"] == \
        summary["recommend_cold"][:3]
    assert len(summary["recommend_warm"]) == 5 and not set(summary["recommend_warm"]) & set(summary["recorded"])
    assert summary["recommend_warm_stats"]["target_forward_calls"] >= 1
    # SIGTERM: drained and exited by itself, code 0, within the grace period (docker stop -t GRACE)
    assert summary["exit_code"] == 0 and not summary["oom_killed"] and summary["signal_logged"]
    assert summary["stop_s"] < GRACE_S


def test_a_bundle_the_images_user_cannot_read_is_named_not_reported_missing(bundle, tmp_path):
    """safetensors writes 0600 files and reports one it cannot read as "No such file or directory". The smoke names
    such files and the fix before starting a container; `recsvc serve` (this checkout's code, run by the image's
    user inside the image) says the file cannot be read, with its mode and owner, and exits 2."""
    weights = bundle / "target" / "model.safetensors"
    if weights.stat().st_uid == 10001:
        pytest.skip("the bundle belongs to the image's user: a 0600 file stays readable to it")
    mode = weights.stat().st_mode & 0o777
    weights.chmod(0o600)
    try:
        smoke = subprocess.run([sys.executable, str(SMOKE), "--image", IMAGE, "--bundle", str(bundle)], env=_env(),
                               capture_output=True, text=True, timeout=60)
        serve = subprocess.run([DOCKER, "run", "--rm", "--volume", f"{bundle}:/models/bundle:ro", "--volume",
                                f"{REPO}:/src:ro", "--env", "PYTHONPATH=/src", "--entrypoint", "python", IMAGE,
                                "-m", "recsvc.cli.main", "serve", "--bundle", "/models/bundle", "--port", "0"],
                               capture_output=True, text=True, timeout=120)
    finally:
        weights.chmod(mode)
    assert smoke.returncode == 1
    assert "cannot read 1 of the bundle's files" in smoke.stderr and "target/model.safetensors" in smoke.stderr
    assert "chmod -R a+rX" in smoke.stderr
    assert serve.returncode == 2, serve.stderr[-2000:]
    last = serve.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read /models/bundle/target/model.safetensors: permission denied "
                           "(mode -rw-------"), last
    assert "this process runs as uid 10001" in last and "Traceback" not in serve.stderr
