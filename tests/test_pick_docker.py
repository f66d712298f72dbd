"""`make image`'s Docker client (deploy/docker/pick-docker.sh): the first client that can build with BuildKit
(buildx answers, or a 20.10 client), else exit 2 with the one line that fixes it. Stand-in clients are small
shell scripts that answer `--version` and `buildx version` as Docker's do."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PICK = REPO / "deploy" / "docker" / "pick-docker.sh"


def client(tmp: Path, name: str, version: str, buildx: bool) -> Path:
    path = tmp / name
    answer = "echo 'github.com/docker/buildx v0.17.1'" if buildx else "echo 'unknown command: buildx' >&2; exit 1"
    path.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "Docker version {version}, build 0000000" ;;
  buildx) {answer} ;;
  *) exit 1 ;;
esac
""")
    path.chmod(0o755)
    return path


def pick(candidates: list[Path], docker: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(PICK), docker], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "DOCKER_CANDIDATES": " ".join(map(str, candidates))})


def test_a_client_without_buildx_is_passed_over_for_one_that_builds(tmp_path) -> None:
    new = client(tmp_path, "docker28", "28.2.2", buildx=False)
    old = client(tmp_path, "docker2010", "20.10.24+dfsg1", buildx=False)
    plugin = client(tmp_path, "docker27", "27.3.1", buildx=True)
    assert pick([new, old]).stdout.split() == [str(old), "buildkit"]
    assert pick([new, plugin, old]).stdout.split() == [str(plugin), "buildx"]
    assert pick([new], docker=str(plugin)).stdout.split() == [str(plugin), "buildx"]


def test_no_client_that_builds_stops_with_the_line_that_fixes_it(tmp_path) -> None:
    new = client(tmp_path, "docker28", "28.2.2", buildx=False)
    out = pick([new, tmp_path / "absent"])
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "(Docker 28.2) has no buildx plugin" in lines[0] and "fix: apt-get install" in lines[0]
    named = pick([], docker=str(new))
    assert named.returncode == 2 and len(named.stderr.strip().splitlines()) == 1
    assert f"DOCKER={new} cannot build" in named.stderr
