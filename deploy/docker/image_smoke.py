"""The built image run as an operator runs it, checked from outside through the published port (`make image-smoke`).

    python deploy/docker/image_smoke.py --image recsvc:0.1.0-cpu --bundle artifacts/image-smoke/bundle

Starts the image with the bundle mounted read-only at /models/bundle and the Kubernetes Deployment's restrictions
(read-only root filesystem with a tmpfs on /tmp, every capability dropped, no privilege escalation), publishes the
gRPC port on 127.0.0.1 only, and puts the training data directory recorded in the bundle's bundle.json in the
container at its recorded path, unreadable by the image's user (a root-owned 0700 directory: what a clone under
/root gives; serving must never open it, docs/ARCHITECTURE.md "Bundle"). Then: waits for health SERVING, and for
Docker's own HEALTHCHECK (the image's `recsvc-healthcheck`) to report healthy; checks that the server process runs
as the image's non-root user; calls Recommend (no history: the bundle's popularity.json order),
RecordInteractions and GetHistory with the repository's client; stops the container with SIGTERM (`docker stop -t
GRACE`: Docker kills it only after GRACE seconds) and checks that it exited by itself, with code 0, within the
grace period. Prints one line per step and a JSON summary (also written to --json); exit 0 when every check
passed, 1 when one failed, 2 when Docker or the image is missing. The container is removed in every case.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTAINER_PORT = 50051
DOCKER = os.environ.get("DOCKER") or "docker"  # the client (as the Makefile's DOCKER)
SERVICE = "recsvc.v1.Recommender"


class SmokeFailure(Exception):
    """A check failed (exit 1)."""


class Unavailable(Exception):
    """No Docker daemon or no image (exit 2): nothing was checked."""


def docker(*args: str, timeout_s: float = 60, check: bool = True) -> str:
    try:
        out = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise Unavailable("no docker client on PATH") from exc
    if check and out.returncode != 0:
        raise SmokeFailure(f"docker {' '.join(args[:2])} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return out.stdout.strip()


def daemon_answers(timeout_s: float = 10) -> str | None:
    """The daemon's version, or None when no daemon answers."""
    try:
        out = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"], capture_output=True,
                             text=True, timeout=timeout_s)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def container_logs(name: str, tail: int) -> str:
    """The container's last lines, stdout and stderr together (`docker logs` replays them on its own two)."""
    out = subprocess.run([DOCKER, "logs", "--tail", str(tail), name], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=30)
    return out.stdout.strip()


def unreadable_files(bundle: Path, uid: int, gid: int) -> list[str]:
    """Files of the bundle that the image's user (uid, gid) could not read, directories it could not enter."""
    bad = []
    for path in [bundle, *bundle.rglob("*")]:
        st = path.stat()
        need = 0o5 if path.is_dir() else 0o4
        if st.st_uid == uid:
            mode = st.st_mode >> 6
        elif st.st_gid == gid:
            mode = st.st_mode >> 3
        else:
            mode = st.st_mode
        if mode & need != need:
            bad.append(f"{path.relative_to(bundle)} ({oct(st.st_mode & 0o777)}, uid {st.st_uid})")
    return bad


def _state(name: str) -> dict:
    return json.loads(docker("inspect", "--format", "{{json .State}}", name))


class Smoke:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name = f"recsvc-smoke-{os.getpid()}"
        self.t0 = time.monotonic()
        self.summary: dict = {"image": args.image, "bundle": str(args.bundle), "grace_s": args.grace_s}
        self.blocked: str | None = None  # the unreadable stand-in for the recorded data directory

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    def run(self) -> dict:
        version = daemon_answers()
        if version is None:
            raise Unavailable("no Docker daemon answers (`docker version` failed)")
        image = docker("image", "inspect", "--format", "{{json .}}", self.args.image, check=False)
        if not image:
            raise Unavailable(f"no image {self.args.image} (make image)")
        meta = json.loads(image)
        size_mb = meta["Size"] / 1e6
        self.summary.update(docker_server=version, image_id=meta["Id"][7:19], image_size_mb=round(size_mb),
                            image_user=meta["Config"]["User"])
        self.say(f"image {self.args.image} ({meta['Id'][7:19]}, {size_mb:.0f} MB, USER {meta['Config']['User']}), "
                 f"Docker {version}")
        bundle = self.args.bundle.resolve()
        if not (bundle / "bundle.json").is_file():
            raise Unavailable(f"no bundle at {bundle} (bundle.json missing)")
        uid, _, gid = meta["Config"]["User"].partition(":")
        bad = unreadable_files(bundle, int(uid), int(gid or uid))
        if bad:
            raise SmokeFailure(f"the image's user {uid} cannot read {len(bad)} of the bundle's files, e.g. "
                               f"{', '.join(bad[:3])}: chmod -R a+rX {bundle} (deploy/README.md)")
        try:
            self._start(bundle)
            self._check_user()
            port = self._wait_serving()
            self._calls(port)
            self._wait_docker_healthy()
            self._stop()
        except BaseException:
            logs = container_logs(self.name, 40)
            if logs:
                print("--- last container log lines ---\n" + logs, file=sys.stderr)
            raise
        finally:
            docker("rm", "-f", self.name, check=False, timeout_s=60)
            if self.blocked is not None:
                shutil.rmtree(self.blocked, ignore_errors=True)
        self.summary["seconds"] = round(time.monotonic() - self.t0, 1)
        return self.summary

    def _blocked_data(self, bundle: Path) -> list[str]:
        """``--volume`` arguments putting an unreadable directory at the bundle's recorded data path (none when it
        records none, or one inside the bundle's mount)."""
        recorded = json.loads((bundle / "bundle.json").read_text()).get("data")
        if not recorded or not recorded.startswith("/") or recorded.startswith("/models"):
            return []
        self.blocked = tempfile.mkdtemp(prefix="recsvc-smoke-data-")  # 0700, this (root) user's
        Path(self.blocked, "sequential_train.txt").write_text("1 1 2 3\n")
        self.summary["data_dir_unreadable_at"] = recorded
        return ["--volume", f"{self.blocked}:{recorded}:ro"]

    def _start(self, bundle: Path) -> None:
        blocked = self._blocked_data(bundle)
        cid = docker(
            "run", "--detach", "--name", self.name,
            "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--publish", f"127.0.0.1::{CONTAINER_PORT}",
            "--volume", f"{bundle}:/models/bundle:ro", *blocked,
            "--env", f"RECSVC_GRACE_S={self.args.grace_s:g}",
            "--env", f"RECSVC_STARTUP_BUDGET_S={self.args.startup_budget_s:g}",
            "--env", "OMP_NUM_THREADS=1",
            self.args.image,
        )
        self.say(f"started {self.name} ({cid[:12]}): bundle {bundle} read-only at /models/bundle, read-only root "
                 f"filesystem, capabilities dropped"
                 + (f"; its recorded data directory {self.summary['data_dir_unreadable_at']} unreadable"
                    if blocked else ""))

    def _check_user(self) -> None:
        # The server is PID 1 (the entrypoint execs recsvc serve): its real and effective uid, and what exec gets.
        status = docker("exec", self.name, "cat", "/proc/1/status", timeout_s=30)
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        cmdline = docker("exec", self.name, "cat", "/proc/1/cmdline", timeout_s=30).replace("\0", " ").strip()
        exec_uid = docker("exec", self.name, "id", "-u", timeout_s=30)
        self.summary.update(pid1_uids=uids, exec_uid=exec_uid, pid1_cmdline=cmdline)
        self.say(f"PID 1 uid (real, effective, saved, fs) = {','.join(uids)}; `docker exec id -u` = {exec_uid}; "
                 f"PID 1: {cmdline[:90]}")
        if set(uids) == {"0"} or exec_uid == "0" or set(uids) != {exec_uid}:
            raise SmokeFailure(f"the server runs as root or not as the image's user: uids {uids}, exec {exec_uid}")
        if "recsvc serve" not in cmdline:
            raise SmokeFailure(f"PID 1 is not recsvc serve: {cmdline!r}")

    def _wait_serving(self) -> int:
        import grpc

        from recsvc.client.client import RecClient

        published = docker("port", self.name, f"{CONTAINER_PORT}/tcp")
        host, _, port = published.splitlines()[0].rpartition(":")
        if host != "127.0.0.1":
            raise SmokeFailure(f"the port is published on {host}, not only on 127.0.0.1")
        self.summary["published"] = f"{host}:{port}"
        self.say(f"gRPC port {CONTAINER_PORT} published on {host}:{port}; waiting for health SERVING")
        deadline = time.monotonic() + self.args.startup_timeout_s
        last = ""
        with RecClient(f"127.0.0.1:{port}", timeout_s=3) as client:
            while time.monotonic() < deadline:
                state = _state(self.name)
                if not state["Running"]:
                    raise SmokeFailure(f"the container exited during start-up (code {state['ExitCode']})")
                try:
                    status = client.health(SERVICE)
                except grpc.RpcError as exc:  # UNAVAILABLE while the port is not up yet
                    status = exc.code().name
                if status != last:
                    self.say(f"health {SERVICE}: {status}")
                    last = status
                if status == "SERVING":
                    self.summary["serving_after_s"] = round(time.monotonic() - self.t0, 1)
                    self._startup_events()
                    return int(port)
                time.sleep(0.5)
        raise SmokeFailure(f"not SERVING within {self.args.startup_timeout_s:g} s (last: {last})")

    def _startup_events(self) -> None:
        """The server's start-up steps (its JSON log lines), e.g. the speculation calibration on a bundle with a
        drafter, and `calibration_not_stored` for the read-only mount."""
        events = []
        for line in container_logs(self.name, 200).splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "event" in entry:
                detail = entry.get("choice") and f"(width={entry.get('width')}: {entry['choice']})"
                events.append(f"{entry['event']}{detail or ''}")
        self.summary["startup_events"] = events
        self.say(f"start-up log: {', '.join(events)}")

    def _calls(self, port: int) -> None:
        from recsvc.client.client import RecClient, response_to_dict

        user = f"smoke-{os.getpid()}"
        with RecClient(f"127.0.0.1:{port}", timeout_s=30) as client:
            first = response_to_dict(client.recommend(user, k=5))
            items = [i["item_id"] for i in first["items"]]
            self.say(f"Recommend({user}, k=5), no history: {items} "
                     f"(fallback: {first['fallback_reason'] or 'none'})")
            if len(items) != 5:
                raise SmokeFailure(f"Recommend returned {len(items)} items, wanted 5")
            popularity = self.args.bundle / "popularity.json"
            if popularity.is_file():  # the bundle's own counts (serving reads nothing else of the data)
                counts = {int(k): v for k, v in json.loads(popularity.read_text()).items()}
                top = sorted(counts, key=lambda i: (-counts[i], i))[:5]
                if items != top:
                    raise SmokeFailure(f"no-history Recommend returned {items}, popularity.json's top 5 are {top}")
            recorded = items[:3]
            length = client.record(user, recorded)
            self.say(f"RecordInteractions({user}, {recorded}) -> history length {length}")
            history = client.history(user)
            self.say(f"GetHistory({user}) -> {history}")
            if length != len(recorded) or history != recorded:
                raise SmokeFailure(f"the stored history is {history} (length {length}), wanted {recorded}")
            second = response_to_dict(client.recommend(user, k=5, exclude_history=True))
            again = [i["item_id"] for i in second["items"]]
            self.say(f"Recommend({user}, k=5, exclude_history) with the stored history: {again} "
                     f"(mode {second['stats']['mode']}, {second['stats']['target_forward_calls']} target forwards, "
                     f"{second['stats']['server_ms']:.1f} ms in the server)")
            if len(again) != 5 or set(again) & set(recorded):
                raise SmokeFailure(f"the history-conditioned Recommend returned {again} (history {recorded})")
            if second["stats"]["target_forward_calls"] < 1:
                raise SmokeFailure("the history-conditioned Recommend did not run the target model")
        self.summary.update(recommend_cold=items, recorded=recorded, history=history, recommend_warm=again,
                            recommend_warm_stats=second["stats"])

    def _wait_docker_healthy(self) -> None:
        # The image's HEALTHCHECK (interval 15 s): its first run comes 15 s after the start.
        deadline = time.monotonic() + self.args.healthcheck_timeout_s
        while time.monotonic() < deadline:
            health = _state(self.name).get("Health") or {}
            if health.get("Status") == "healthy":
                self.summary["docker_health"] = "healthy"
                self.say("Docker HEALTHCHECK (recsvc-healthcheck inside the image): healthy")
                return
            time.sleep(1)
        raise SmokeFailure(f"Docker's HEALTHCHECK did not report healthy within {self.args.healthcheck_timeout_s:g}"
                           f" s: {json.dumps(_state(self.name).get('Health'))[:400]}")

    def _stop(self) -> None:
        grace = self.args.grace_s
        self.say(f"docker stop -t {grace:g} (SIGTERM; SIGKILL only after {grace:g} s)")
        t = time.monotonic()
        docker("stop", "--time", f"{grace:g}", self.name, timeout_s=grace + 60)
        stopped_s = time.monotonic() - t
        state = _state(self.name)
        logs = container_logs(self.name, 200)
        drained = "signal_received" in logs
        for line in logs.splitlines():
            if any(f'"event": "{e}"' in line for e in ("signal_received", "draining", "stopped")):
                self.say(f"  container log: {line}")
        self.summary.update(stop_s=round(stopped_s, 2), exit_code=state["ExitCode"], oom_killed=state["OOMKilled"],
                            signal_logged=drained)
        self.say(f"stopped in {stopped_s:.2f} s, exit code {state['ExitCode']}, signal logged: {drained}")
        if state["ExitCode"] != 0 or stopped_s >= grace:
            raise SmokeFailure(f"not a clean exit within the grace period: code {state['ExitCode']} after "
                               f"{stopped_s:.2f} s (grace {grace:g} s)")
        if not drained:
            raise SmokeFailure("the server did not log the SIGTERM it got")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--image", default="recsvc:0.1.0-cpu")
    p.add_argument("--bundle", type=Path, required=True, help="bundle directory, mounted read-only")
    p.add_argument("--grace-s", type=float, default=10.0, help="RECSVC_GRACE_S and docker stop's timeout")
    p.add_argument("--startup-budget-s", type=float, default=20.0, help="RECSVC_STARTUP_BUDGET_S")
    p.add_argument("--startup-timeout-s", type=float, default=240.0, help="how long to wait for SERVING")
    p.add_argument("--healthcheck-timeout-s", type=float, default=60.0,
                   help="how long to wait for Docker's HEALTHCHECK to say healthy (its interval is 15 s)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if args.grace_s <= 0 or args.startup_timeout_s <= 0:
        p.error("--grace-s and --startup-timeout-s must be positive")
    smoke = Smoke(args)
    try:
        summary = smoke.run()
    except Unavailable as exc:
        print(f"image-smoke: skipped: {exc}", file=sys.stderr)
        return 2
    except SmokeFailure as exc:
        print(f"image-smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    print(f"image-smoke: passed in {summary['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
