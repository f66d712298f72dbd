"""The container image and the Kubernetes manifests (Dockerfile, deploy/docker, deploy/k8s), checked offline.

No Docker daemon and no cluster: every manifest is validated against the Kubernetes JSON schemas that the
kubernetes-validate package ships (strict: unknown fields fail), the kustomizations are rendered with
`kubectl kustomize` where kubectl is installed, the manifests are checked against each other (ports, labels,
names) and against the Dockerfile, and the image's entrypoint and health-check scripts are run here against
real `recsvc serve` / RecServer processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, latest_version
from packaging.version import Version

from harness.redis_server import free_port
from recsvc.service import cli as serve_cli
from recsvc.service.rpc.server import STORE_HEALTH_NAME
from recsvc.service.rpc.servicer import SERVICE_NAME

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
TLS_OVERLAY = K8S / "tls"
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"
# The oldest Kubernetes minor the manifests promise (deploy/README.md) and the newest schema shipped.
K8S_VERSIONS = sorted({v for v in all_versions() if v == "1.30.0"} | {latest_version()}, key=Version)

EXPECTED_KINDS = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("policy/v1", "PodDisruptionBudget"),
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "PersistentVolumeClaim"),
}


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _base_resources() -> list[dict]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in _docs(BASE / name)]


def _one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    found = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _container(resources: list[dict]) -> dict:
    containers = _one(resources, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _validate(doc: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against Kubernetes {version}: {where}: {exc.message}")


# --- schemas ---------------------------------------------------------------------------------------------------


def test_every_manifest_is_listed_and_valid_against_the_kubernetes_schema():
    assert len(K8S_VERSIONS) >= 1 and Version(K8S_VERSIONS[-1]) >= Version("1.30")
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "deploy/k8s/base/kustomization.yaml must list every manifest beside it"
    resources = _base_resources()
    assert {(r["apiVersion"], r["kind"]) for r in resources} == EXPECTED_KINDS
    for doc in resources:
        _validate(doc)


def test_the_schema_check_catches_mistakes():
    """Guards the guard: strict validation rejects a misspelled field and a named port in a grpc probe."""
    deployment = _one(_base_resources(), "Deployment")
    typo = json.loads(json.dumps(deployment))
    container = typo["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    named = json.loads(json.dumps(deployment))
    named["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    for bad in (typo, named):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed")
def test_kustomize_renders_base_and_tls_overlay():
    rendered = {}
    for root in (BASE, TLS_OVERLAY):
        out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        rendered[root.name] = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
        assert {(r["apiVersion"], r["kind"]) for r in rendered[root.name]} == EXPECTED_KINDS
        for doc in rendered[root.name]:
            _validate(doc)
    base, tls = rendered["base"], rendered["tls"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" in _container(base)[probe]
        assert _container(tls)[probe]["exec"]["command"][0] == "recsvc-healthcheck"
        assert "grpc" not in _container(tls)[probe]
    config = _one(tls, "ConfigMap")["data"]
    mounts = {m["name"]: m["mountPath"] for m in _container(tls)["volumeMounts"]}
    secret = _one(tls, "Secret", "recsvc-tls")["stringData"]
    for variable in ("RECSVC_TLS_CERT", "RECSVC_TLS_KEY", "RECSVC_HEALTHCHECK_CA"):
        path = Path(config[variable])
        assert str(path.parent) == mounts["tls"] and path.name in secret, variable
    assert "RECSVC_TLS_CERT" not in _one(base, "ConfigMap")["data"]


# --- the manifests against each other ------------------------------------------------------------------------


def test_ports_probes_and_health_names_agree():
    resources = _base_resources()
    config = _one(resources, "ConfigMap")["data"]
    container = _container(resources)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    grpc_port = int(config["RECSVC_GRPC_PORT"])
    assert ports["grpc"] == grpc_port and ports["metrics"] == int(config["RECSVC_METRICS_PORT"])
    assert config["RECSVC_HOST"] == "0.0.0.0" and config["RECSVC_METRICS_HOST"] == "0.0.0.0"
    # Native gRPC probes on the served port, asking the health names the server sets.
    served_names = {"", SERVICE_NAME}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = container[probe]["grpc"]
        assert grpc["port"] == grpc_port
        assert grpc.get("service", "") in served_names, probe
    # Readiness must not follow the history store (inline-history requests work while Redis is down).
    assert container["readinessProbe"]["grpc"].get("service") != STORE_HEALTH_NAME
    # The startup probe outlasts model loading plus the bounded --spec auto calibration.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2 * float(config["RECSVC_STARTUP_BUDGET_S"])
    service = _one(resources, "Service")
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["targetPort"] in ("grpc", grpc_port) and by_name["grpc"]["port"] == grpc_port
    assert by_name["grpc"].get("appProtocol") == "grpc"
    assert by_name["metrics"]["targetPort"] in ("metrics", ports["metrics"])


def test_selectors_match_the_pod_template():
    resources = _base_resources()
    deployment = _one(resources, "Deployment")
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template_labels.items()
    assert _one(resources, "Service")["spec"]["selector"].items() <= template_labels.items()
    assert _one(resources, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]
    assert spread["matchLabels"] == selector


def test_hpa_pdb_and_deployment_fit_together():
    resources = _base_resources()
    deployment = _one(resources, "Deployment")
    hpa = _one(resources, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    assert [m["resource"]["name"] for m in hpa["metrics"] if m["type"] == "Resource"] == ["cpu"]
    assert 2 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    pdb = _one(resources, "PodDisruptionBudget")["spec"]
    assert pdb.get("maxUnavailable", 0) < hpa["minReplicas"]
    # CPU utilisation needs CPU requests; Guaranteed QoS (requests == limits) keeps latency predictable.
    container = _container(resources)
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    threads = {e["name"]: e for e in container.get("env", [])}["OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"


def test_referenced_configmaps_secrets_and_volumes_exist():
    resources = _base_resources()
    names = {(r["kind"], r["metadata"]["name"]) for r in resources}
    pod = _one(resources, "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for source in container["envFrom"]:
        if "configMapRef" in source:
            assert ("ConfigMap", source["configMapRef"]["name"]) in names
        if "secretRef" in source:
            assert ("Secret", source["secretRef"]["name"]) in names
    volumes = {v["name"]: v for v in pod["volumes"]}
    for volume in volumes.values():
        if "secret" in volume:
            assert ("Secret", volume["secret"]["secretName"]) in names
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in names
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts.keys() <= volumes.keys()
    config = _one(resources, "ConfigMap")["data"]
    bundle = mounts["bundle"]
    assert bundle["mountPath"] == config["RECSVC_BUNDLE"] and bundle["readOnly"] is True
    assert volumes["bundle"]["persistentVolumeClaim"]["readOnly"] is True
    assert "RECSVC_API_KEY" in _one(resources, "Secret", "recsvc-api-key")["stringData"]
    assert _one(resources, "Secret", "recsvc-tls")["type"] == "kubernetes.io/tls"
    # Kubernetes' service links would define RECSVC_PORT=tcp://... from the Service named recsvc.
    assert pod["enableServiceLinks"] is False
    grace = float(config["RECSVC_GRACE_S"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pod["terminationGracePeriodSeconds"] > grace + float(pre_stop[-1])


def test_secrets_hold_placeholders_only():
    for doc in _docs(BASE / "secret.yaml"):
        assert "data" not in doc, "placeholders go in stringData, readable as such"
        for key, value in doc["stringData"].items():
            assert value.startswith("REPLACE-ME"), f"{doc['metadata']['name']}/{key} is not a placeholder"
    text = "\n".join(p.read_text() for p in K8S.rglob("*.yaml"))
    assert "PRIVATE KEY-----" not in text and "BEGIN CERTIFICATE" not in text


def test_pod_runs_as_the_images_non_root_user():
    dockerfile = _dockerfile()
    uid = dockerfile["USER"][-1].split(":")[0]
    pod = _one(_base_resources(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid
    container = pod["containers"][0]["securityContext"]
    assert container["readOnlyRootFilesystem"] is True and container["allowPrivilegeEscalation"] is False


# --- Dockerfile ---------------------------------------------------------------------------------------------------


def _dockerfile(path: Path = REPO / "Dockerfile") -> dict[str, list[str]]:
    """Instruction -> its argument strings, in order (continuations joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "a continuation runs off the end of the Dockerfile"
    out: dict[str, list[str]] = {}
    for line in lines:
        instruction, _, rest = line.partition(" ")
        out.setdefault(instruction.upper(), []).append(rest.strip())
    return out


def _env(dockerfile: dict[str, list[str]]) -> dict[str, str]:
    env = {}
    for entry in dockerfile.get("ENV", []):
        for pair in shlex.split(entry):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def _copies(dockerfile: dict[str, list[str]]) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY, flags such as --chmod dropped."""
    out = []
    for entry in dockerfile["COPY"]:
        words = [w for w in entry.split() if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def _pins(text: str) -> set[str]:
    return set(re.findall(r"torch==([0-9][0-9.]*)", text))


def test_dockerfile_essentials():
    dockerfile = _dockerfile()
    # python:3.11-slim unless BASE_IMAGE names another (make base-image's Debian base where it cannot be pulled)
    args = dict(a.split("=", 1) for a in dockerfile["ARG"])
    assert dockerfile["FROM"] == ["${BASE_IMAGE}"] and args["BASE_IMAGE"] == "python:3.11-slim"
    # torch pinned as pyproject.toml and the Makefile pin it, installed before the project.
    project_pins = _pins((REPO / "pyproject.toml").read_text()) | _pins((REPO / "Makefile").read_text())
    assert project_pins == {args["TORCH_VERSION"]}
    assert args["TORCH_VARIANT"] == "cpu"
    runs = dockerfile["RUN"]
    torch_step = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    project_step = next(i for i, r in enumerate(runs) if "pip install ." in r)
    assert torch_step < project_step and "pip check" in runs[project_step]
    # Non-root, numeric, set after every RUN that needs root.
    user = dockerfile["USER"][-1]
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"
    text = (REPO / "Dockerfile").read_text()
    assert text.rindex("\nUSER ") > text.rindex("\nRUN ")
    # ENTRYPOINT: the entrypoint script (exec form), which execs `recsvc serve`.
    assert json.loads(dockerfile["ENTRYPOINT"][-1]) == ["recsvc-entrypoint"]
    copies = {destination: sources for sources, destination in _copies(dockerfile)}
    assert copies["/usr/local/bin/recsvc-entrypoint"] == ["deploy/docker/entrypoint.sh"]
    assert copies["/usr/local/bin/recsvc-healthcheck"] == ["deploy/docker/healthcheck.py"]
    assert ENTRYPOINT.read_text().rstrip().splitlines()[-1].startswith("exec recsvc serve ")
    for sources, _ in _copies(dockerfile):
        for source in sources:
            assert (REPO / source).exists(), source
    # The image carries the product, not the benchmarks nor the tests' and drills' launchers.
    copied = {source.split("/")[0] for sources, _ in _copies(dockerfile) for source in sources}
    assert copied.isdisjoint({"bench", "harness", "tests", "."}), copied
    assert not (REPO / "recsvc" / "bench").exists()
    # The port: EXPOSE == the image's RECSVC_GRPC_PORT == the ConfigMap's == the Service's target.
    env = _env(dockerfile)
    resources = _base_resources()
    config = _one(resources, "ConfigMap")["data"]
    assert dockerfile["EXPOSE"] == [env["RECSVC_GRPC_PORT"]] == [config["RECSVC_GRPC_PORT"]]
    assert env["RECSVC_BUNDLE"] == config["RECSVC_BUNDLE"] and env["RECSVC_HOST"] == "0.0.0.0"
    service_port = {p["name"]: p for p in _one(resources, "Service")["spec"]["ports"]}["grpc"]["port"]
    assert str(service_port) == env["RECSVC_GRPC_PORT"]
    assert "recsvc-healthcheck" in dockerfile["HEALTHCHECK"][-1]


def test_dockerignore_keeps_what_the_build_copies():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for sources, _ in _copies(_dockerfile()):
        for path in sources:
            assert not any(path == pattern or path.startswith(pattern.rstrip("/") + "/") for pattern in ignored), path
    for needed in ("pyproject.toml", "README.md", "recsvc", "tokenizer_rqvae", "training", "deploy/docker"):
        assert needed not in ignored


# --- the entrypoint: environment -> `recsvc serve` flags ----------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsvc")
    serve_cli.register(parser.add_subparsers(dest="command"))
    return parser


def _entrypoint_argv(tmp_path: Path, env: dict[str, str], *args: str) -> list[str]:
    """The argv the entrypoint hands to `recsvc`, captured by a stand-in `recsvc` first on PATH."""
    fake = tmp_path / "bin" / "recsvc"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    run_env = {"PATH": f"{fake.parent}:{os.environ['PATH']}", **env}
    out = subprocess.run(["bash", str(ENTRYPOINT), *args], env=run_env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _config_env() -> dict[str, str]:
    env = dict(_one(_base_resources(), "ConfigMap")["data"])
    env.update(_docs(TLS_OVERLAY / "configmap-tls.yaml")[0]["data"])
    return env


def test_entrypoint_flags_are_real_serve_flags(tmp_path):
    parser = _serve_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    known = {option for action in serve._actions for option in action.option_strings}
    code = "\n".join(line.split(" # ")[0] for line in ENTRYPOINT.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", code))
    assert {"--bundle", "--port", "--redis-url", "--tls-cert"} <= used
    assert used <= known, f"entrypoint.sh passes flags recsvc serve does not have: {sorted(used - known)}"

    argv = _entrypoint_argv(tmp_path, _config_env())
    assert argv[0] == "serve"
    args = parser.parse_args(argv)
    config = _config_env()
    assert args.bundle == config["RECSVC_BUNDLE"] and args.host == "0.0.0.0"
    assert args.port == int(config["RECSVC_GRPC_PORT"]) and args.metrics_port == int(config["RECSVC_METRICS_PORT"])
    assert args.redis_url == config["RECSVC_REDIS_URL"] and args.redis_prefix == config["RECSVC_REDIS_PREFIX"]
    assert args.redis_ttl_s == int(config["RECSVC_REDIS_TTL_S"])
    assert args.max_history == int(config["RECSVC_MAX_HISTORY"]) and args.max_batch == int(config["RECSVC_MAX_BATCH"])
    assert args.tls_cert == config["RECSVC_TLS_CERT"] and args.tls_key == config["RECSVC_TLS_KEY"]
    assert args.spec == "auto" and args.startup_budget_s == float(config["RECSVC_STARTUP_BUDGET_S"])
    assert args.grace_s == float(config["RECSVC_GRACE_S"]) and args.api_key is None  # the key stays in the env

    # Nothing set: the image's defaults; container arguments come last and win.
    argv = _entrypoint_argv(tmp_path, {"RECSVC_NO_PRIOR": "true", "RECSVC_EXTRA_ARGS": "--max-k 20"},
                            "--spec", "10:3", "--port", "6000")
    args = parser.parse_args(argv)
    assert (args.bundle, args.host, args.port, args.spec) == ("/models/bundle", "0.0.0.0", 6000, "10:3")
    assert args.no_prior is True and args.max_k == 20 and args.redis_url is None and args.metrics_port is None
    args = parser.parse_args(_entrypoint_argv(tmp_path, {"RECSVC_POPULARITY": "/data/counts.json"}))
    assert args.popularity == "/data/counts.json" and args.bundle is None


def test_entrypoint_rejects_a_bad_switch(tmp_path):
    out = subprocess.run(["bash", str(ENTRYPOINT)], env={"PATH": os.environ["PATH"], "RECSVC_NO_PRIOR": "maybe"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "RECSVC_NO_PRIOR must be true or false" in out.stderr


def test_configmap_keys_are_read_by_something():
    readers = ENTRYPOINT.read_text() + HEALTHCHECK.read_text()
    for key in _config_env():
        assert key in readers, f"{key} is set in a ConfigMap but nothing reads it"


# --- the image's runtime path, without the image -----------------------------------------------------------------


def _healthcheck(env: dict[str, str], *service: str) -> subprocess.CompletedProcess:
    run_env = {"PATH": os.environ["PATH"], **env}
    return subprocess.run([sys.executable, str(HEALTHCHECK), *service], env=run_env, capture_output=True,
                          text=True, timeout=60)


def test_healthcheck_script_exit_codes(catalog, make_server):
    starting = make_server(None)  # listens with health NOT_SERVING until an engine is attached
    out = _healthcheck({"RECSVC_GRPC_PORT": str(starting.port)})
    assert out.returncode == 1 and "NOT_SERVING" in out.stdout
    serving = make_server(catalog, api_key="secret")  # health needs no key
    for name in ((), (SERVICE_NAME,)):
        out = _healthcheck({"RECSVC_GRPC_PORT": str(serving.port)}, *name)
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
    out = _healthcheck({"RECSVC_GRPC_PORT": str(free_port()), "RECSVC_HEALTHCHECK_TIMEOUT_S": "1"})
    assert out.returncode == 1 and "UNAVAILABLE" in out.stdout


def test_healthcheck_script_over_tls(catalog, make_server, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=recsvc",
                    "-addext", "subjectAltName=DNS:recsvc", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server = make_server(catalog, tls_cert=cert, tls_key=key)
    env = {"RECSVC_GRPC_PORT": str(server.port), "RECSVC_TLS_CERT": str(cert), "RECSVC_HEALTHCHECK_TIMEOUT_S": "2"}
    assert _healthcheck({**env, "RECSVC_HEALTHCHECK_SERVER_NAME": "recsvc"}).returncode == 0
    # The certificate does not name 127.0.0.1, and a plaintext check cannot talk to a TLS port.
    assert _healthcheck(env).returncode == 1
    plain = {k: v for k, v in env.items() if k != "RECSVC_TLS_CERT"}
    assert _healthcheck(plain).returncode == 1


def test_entrypoint_serves_with_the_configmap_settings(tmp_path):
    """`recsvc serve` started the container's way (entrypoint.sh + the ConfigMap's variables, Redis down,
    an API key) becomes SERVING for the health check, keeps the store's health apart, and drains on SIGTERM."""
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({str(i): 100 - i for i in range(1, 51)}))
    port = free_port()
    env = {
        **os.environ,
        **_one(_base_resources(), "ConfigMap")["data"],
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RECSVC_POPULARITY": str(counts),  # the model-free engine: the same server, no bundle to load
        "RECSVC_GRPC_PORT": str(port),
        "RECSVC_HOST": "127.0.0.1",
        "RECSVC_METRICS_PORT": str(free_port()),
        "RECSVC_METRICS_HOST": "127.0.0.1",
        "RECSVC_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        "RECSVC_API_KEY": "k",
        "RECSVC_GRACE_S": "1",
    }
    proc = subprocess.Popen(["bash", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        probe = {"RECSVC_GRPC_PORT": str(port), "RECSVC_HEALTHCHECK_TIMEOUT_S": "2"}
        deadline = time.monotonic() + 120
        while _healthcheck(probe, SERVICE_NAME).returncode != 0:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "not SERVING within 120 s"
            time.sleep(0.5)
        assert _healthcheck(probe).returncode == 0
        store = _healthcheck(probe, STORE_HEALTH_NAME)
        assert store.returncode == 1 and "NOT_SERVING" in store.stdout
        proc.send_signal(signal.SIGTERM)  # the entrypoint exec'd recsvc: the signal reaches the server
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read()
    entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    serving = [entry for entry in entries if entry.get("event") == "serving"]
    assert serving and serving[0]["port"] == port and serving[0]["api_key"] is True, log
