"""The container image and the deployment files, checked without a Docker engine or a cluster.

No Docker engine runs here and base images cannot be pulled, so the image is not built in CI. What is
checked instead:
- docker/install.sh, the exact Python install the Dockerfile's builder stage performs, runs into a
  fresh venv (no system site packages) over a copy of the build context as .dockerignore leaves it;
  the result imports ``service`` and ``kernels`` and answers ``python -m service --help``;
- hadolint on the Dockerfile (no finding left; every inline ignore carries a reason), and the
  Dockerfile's contract: multi-stage, a pinned cuDNN base, gcc + Python headers in the runtime stage,
  a non-root USER, EXPOSE 8000 8001, a HEALTHCHECK on /readyz, a TRITON_CACHE_DIR volume;
- docker/healthcheck.py against a real local HTTP server (200 -> healthy, 503 or nothing -> not);
- yamllint (repository config .yamllint) on every YAML file of the repository;
- kubernetes-validate (strict) on every Kubernetes manifest; the KServe CRDs, which it has no schema
  for, get a schema check of their required fields here, their containers checked against the
  core/v1 Container schema that kubernetes-validate ships;
- the semantics that schemas cannot see: probes on /readyz and /healthz, GPU requests, drain timing,
  Service ports and appProtocol, the HPA metric being one the service really exports;
- docker/compose.yaml: the GPU reservation and the Triton cache volume;
- every ATTNSERVE_* variable named in the image and deployment files is a real Settings field, and
  every value they set parses.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
K8S = DOCKER / "k8s"
BIN = Path(sys.executable).parent
# The torch that CI installs into the fresh venv: the CPU build on these machines' disk (the image
# passes the CUDA build). Same variable as the Makefile's.
TORCH_PIN = os.environ.get("TORCH_PIN", "torch==2.13.0")
K8S_VERSIONS = ("1.29", "1.37")  # oldest we claim, and the newest kubernetes-validate knows


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (it is a dev dependency in pyproject.toml; run `make install`)")
    return found


# --------------------------------------------------------------------------------------------- #
# Dockerfile parsing
# --------------------------------------------------------------------------------------------- #


def dockerfile_instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = DOCKERFILE.read_text() if text is None else text
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in dockerfile_instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            for token in shlex.split(rest):
                key, sep, value = token.partition("=")
                assert sep, f"ENV {rest!r}: use KEY=VALUE form"
                env[key] = value
    return env


def dockerfile_args() -> dict[str, str]:
    args: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ARG":
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
    return args


# --------------------------------------------------------------------------------------------- #
# .dockerignore: Docker's rules (patterns relative to the context, `*` within one path element,
# `**` across, `!` re-includes, the last matching line wins, a match on a parent covers children)
# --------------------------------------------------------------------------------------------- #


def _dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = os.path.normpath(pattern.lstrip("/"))
        rx, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pattern[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pattern[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(rx + r"\Z")))
    return rules


def in_build_context(rel: str, rules=None) -> bool:
    rules = _dockerignore_rules() if rules is None else rules
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, rx in rules:
        if any(rx.match(c) for c in candidates):
            included = negate
    return included


def build_context_files() -> list[str]:
    """Every file `docker build .` would send, as paths relative to the repository root."""
    rules = _dockerignore_rules()
    reincluded = [rx.pattern for negate, rx in rules if negate]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in dirnames:
            rel = f"{rel_dir}/{d}" if rel_dir else d
            # prune excluded folders that no `!` line could reach into (.venv, .git, ...)
            if in_build_context(rel, rules) or any(p.startswith(re.escape(d)) or "*" in p.split("/")[0]
                                                   for p in reincluded):
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if in_build_context(rel, rules):
                files.append(rel)
    return sorted(files)


def test_dockerignore_keeps_the_image_lean_and_complete():
    files = build_context_files()
    assert "pyproject.toml" in files and "docker/install.sh" in files and "docker/healthcheck.py" in files
    assert any(f.startswith("service/") for f in files) and any(f.startswith("kernels/") for f in files)
    assert any(f.startswith("proto/") and f.endswith(".proto") for f in files)
    for f in files:
        top = f.split("/")[0]
        assert top not in {".venv", ".git", "tests", ".whl", "reports", "build", ".pytest_cache",
                           ".ruff_cache", ".triton", "bench", "loadtest", "docs"}, f
        assert "__pycache__" not in f and not f.endswith((".whl", ".pyc")), f
        assert not f.startswith(("proto/gen/", "docker/k8s/")) and f != "docker/compose.yaml", f
    for rel in ("tests/conftest.py", ".venv/bin/python", ".git/HEAD", "x.whl", "reports/a.json",
                ".pytest_cache/v", "service/__pycache__/a.pyc", "proto/gen/STAMP.json"):
        assert not in_build_context(rel), rel
    # Every COPY source of the Dockerfile is in the context.
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from=" not in rest:
            sources = [s for s in rest.split()[:-1] if not s.startswith("--")]
            for src in sources:
                src = src.rstrip("/")
                assert src == "." or any(f == src or f.startswith(src + "/") for f in files), src


# --------------------------------------------------------------------------------------------- #
# Dockerfile
# --------------------------------------------------------------------------------------------- #


def test_hadolint_finds_nothing_and_every_ignore_has_a_reason():
    proc = subprocess.run([tool("hadolint"), "--no-color", "-f", "json", str(DOCKERFILE)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert proc.returncode == 0, proc.stderr
    text = DOCKERFILE.read_text()
    for code in set(re.findall(r"#\s*hadolint\s+ignore=([A-Z0-9,]+)", text)):
        for c in code.split(","):
            # a comment, not the pragma itself, that names the rule and says why
            reason = re.search(rf"^\s*#(?!\s*hadolint).*\b{c}\b", text, re.M)
            assert reason, f"{c} is ignored without a reason"


def test_dockerfile_contract():
    all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage: a builder and a slim runtime"
    args = dockerfile_args()

    def base(stage):
        image = stage[0][1].split()[0]
        return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)

    for stage in all_stages:
        image = base(stage)
        assert ":" in image and not image.endswith(":latest"), f"unpinned base image {image}"
        assert "cudnn" in image, f"{image}: a CUDA base image with cuDNN"
    builder, runtime = all_stages[0], all_stages[-1]
    builder_runs = " ".join(rest for word, rest in builder if word == "RUN")
    assert "docker/install.sh" in builder_runs, "the builder must use the same install script as CI"
    assert "TORCH_SPEC" in args and args["TORCH_SPEC"].startswith("torch=="), "torch pinned exactly"

    words = {word for word, _ in runtime}
    runtime_runs = " ".join(rest for word, rest in runtime if word == "RUN")
    # Triton compiles a C launcher at run time: a C compiler and Python's headers must be there.
    assert re.search(r"\bgcc\b", runtime_runs) and "python3-dev" in runtime_runs
    assert "COPY" in words and any("--from=builder" in rest for word, rest in runtime if word == "COPY")

    expose = [rest for word, rest in runtime if word == "EXPOSE"]
    assert expose and {"8000", "8001"} <= set(" ".join(expose).replace("/tcp", "").split())

    user = [rest for word, rest in runtime if word == "USER"]
    assert user, "the runtime stage must drop root"
    uid = user[-1].split(":")[0]
    assert uid not in {"root", "0"} and uid.isdigit(), "a numeric non-root uid (runAsNonRoot can verify it)"

    health = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert health and "start-period" in health[-1]
    probe = health[-1]
    if "healthcheck.py" in probe:
        assert '"/readyz"' in (DOCKER / "healthcheck.py").read_text()
    else:
        assert "/readyz" in probe

    env = dockerfile_env()
    cache = env.get("TRITON_CACHE_DIR")
    assert cache, "TRITON_CACHE_DIR must point at a writable directory"
    volumes = " ".join(rest for word, rest in runtime if word == "VOLUME")
    assert cache in volumes, "the Triton cache must be a volume, so restarts skip recompilation"
    assert "/opt/venv/bin" in env.get("PATH", "")

    entry = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1])[-2:] == ["-m", "service"]


def _serve_status(status: int):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code = status if self.path == "/readyz" else 404
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_script(status, healthy):
    server = _serve_status(status)
    try:
        env = {**os.environ, "ATTNSERVE_HTTP_PORT": str(server.server_address[1])}
        rc = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], env=env, timeout=30).returncode
        assert (rc == 0) is healthy
    finally:
        server.shutdown()
        server.server_close()
    # nothing listening: unhealthy, promptly
    env["ATTNSERVE_HTTP_PORT"] = str(server.server_address[1])
    rc = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], env=env, timeout=30).returncode
    assert rc == 1


# --------------------------------------------------------------------------------------------- #
# YAML
# --------------------------------------------------------------------------------------------- #


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))


def k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in k8s_files() for d in load_all(p)]


def find(kind: str) -> list[dict]:
    return [d for _, d in k8s_docs() if d.get("kind") == kind]


def test_yamllint_every_yaml_file():
    cmd = [tool("yamllint"), "--strict", "-f", "parsable", "-c", str(ROOT / ".yamllint"), "."]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert COMPOSE.exists() and k8s_files()


KSERVE_KINDS = {"ServingRuntime", "ClusterServingRuntime", "InferenceService"}
# session-affinity.yaml: the gateways' CRDs (no schema in kubernetes-validate); see test_session_affinity
AFFINITY_KINDS = {"DestinationRule", "HTTPRoute", "BackendTrafficPolicy"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate(version):
    from kubernetes_validate import utils

    seen = set()
    for path, doc in k8s_docs():
        if doc["kind"] in KSERVE_KINDS | AFFINITY_KINDS:
            continue  # CRDs: no schema in kubernetes-validate; see test_kserve_resources, test_session_affinity
        try:
            utils.validate(doc, version, strict=True)
        except utils.ValidationError as exc:
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            pytest.fail(f"{path.relative_to(ROOT)} {name} (k8s {version}): {exc}")
        seen.add(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= seen


def test_kubernetes_validate_cli_accepts_every_manifest():
    # The command a person would run; unknown kinds (the KServe CRDs) are warnings, not failures.
    proc = subprocess.run([tool("kubernetes-validate"), "--strict", *map(str, k8s_files())],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_session_affinity_hashes_on_the_header_clients_send():
    """docker/k8s/session-affinity.yaml: the Istio DestinationRule and the Envoy Gateway
    BackendTrafficPolicy hash on the header the clients send (service.sessions.SESSION_HEADER),
    for the Service of service.yaml, the policy aimed at the HTTPRoute that sends to it."""
    from service.wire import SESSION_HEADER

    docs = {d["kind"]: d for d in yaml.safe_load_all((K8S / "session-affinity.yaml").read_text())}
    assert set(docs) == AFFINITY_KINDS
    service = yaml.safe_load((K8S / "service.yaml").read_text())
    rule = docs["DestinationRule"]
    assert rule["apiVersion"].startswith("networking.istio.io/") and rule["spec"]["host"] == service["metadata"]["name"]
    assert rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"] == {"httpHeaderName": SESSION_HEADER}
    route, policy = docs["HTTPRoute"], docs["BackendTrafficPolicy"]
    assert [b["name"] for r in route["spec"]["rules"] for b in r["backendRefs"]] == [service["metadata"]["name"]]
    assert {"kind": "HTTPRoute", "name": route["metadata"]["name"]}.items() <= policy["spec"]["targetRefs"][0].items()
    lb = policy["spec"]["loadBalancer"]
    assert lb["type"] == "ConsistentHash"
    assert lb["consistentHash"] == {"type": "Header", "header": {"name": SESSION_HEADER}}


def _core_validator(definition: str):
    """A validator for one core Kubernetes type, from the schemas kubernetes-validate ships (strict)."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    version = utils.latest_version()
    defs = utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    registry = Resource.from_contents(defs) @ Registry()
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$ref": f"{defs['$id']}#/$defs/{definition}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


SERVING_RUNTIME_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1alpha1"},
        "kind": {"enum": ["ServingRuntime", "ClusterServingRuntime"]},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["supportedModelFormats", "containers", "protocolVersions"],
            "properties": {
                "supportedModelFormats": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name"],
                    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                   "autoSelect": {"type": "boolean"}, "priority": {"type": "integer"}}}},
                "protocolVersions": {"type": "array", "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]}},
                "containers": {"type": "array", "minItems": 1},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
    },
}

INFERENCE_SERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["predictor"], "properties": {"predictor": {
            "type": "object", "required": ["model"],
            "properties": {
                "minReplicas": {"type": "integer", "minimum": 0},
                "maxReplicas": {"type": "integer", "minimum": 1},
                "model": {"type": "object", "required": ["modelFormat"], "properties": {
                    "modelFormat": {"type": "object", "required": ["name"]},
                    "runtime": {"type": "string"},
                    "protocolVersion": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
                    "storageUri": {"type": "string", "pattern": "^[a-z0-9+]+://"},
                }},
            }}}},
    },
}


def test_kserve_resources():
    import jsonschema

    container_v = _core_validator("io.k8s.api.core.v1.Container")
    env_v = _core_validator("io.k8s.api.core.v1.EnvVar")
    port_v = _core_validator("io.k8s.api.core.v1.ContainerPort")
    resources_v = _core_validator("io.k8s.api.core.v1.ResourceRequirements")

    runtimes = find("ServingRuntime") + find("ClusterServingRuntime")
    services = find("InferenceService")
    assert runtimes and services
    by_name = {}
    for rt in runtimes:
        jsonschema.validate(rt, SERVING_RUNTIME_SCHEMA)
        spec = rt["spec"]
        assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"]), "the server speaks OIP v2 on HTTP and gRPC"
        for c in spec["containers"]:
            container_v.validate(c)
        main = spec["containers"][0]
        assert main["name"] == "kserve-container"
        ports = {p["containerPort"] for p in main.get("ports", [])}
        assert ports <= {8000, 8001}
        assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
        by_name[rt["metadata"]["name"]] = rt
    for isvc in services:
        jsonschema.validate(isvc, INFERENCE_SERVICE_SCHEMA)
        model = isvc["spec"]["predictor"]["model"]
        rt = by_name[model["runtime"]]
        assert model["modelFormat"]["name"] in {f["name"] for f in rt["spec"]["supportedModelFormats"]}
        assert model.get("protocolVersion", "v1") in rt["spec"]["protocolVersions"]
        for e in model.get("env", []):
            env_v.validate(e)
        for p in model.get("ports", []):
            port_v.validate(p)
        if model.get("protocolVersion") == "grpc-v2":
            assert [p["containerPort"] for p in model["ports"] if p["name"] == "h2c"] == [8001]
        resources_v.validate(model["resources"])
        assert "nvidia.com/gpu" in model["resources"]["limits"]


# --------------------------------------------------------------------------------------------- #
# Kubernetes semantics
# --------------------------------------------------------------------------------------------- #


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_deployment_gpu_probes_and_drain():
    (dep,) = find("Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = _container(dep)
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named == {"http": 8000, "grpc": 8001}
    assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "cpu" in c["resources"]["requests"], "the HPA's CPU fallback needs a CPU request"

    def probe_path(name):
        get = c[name]["httpGet"]
        assert named.get(get["port"], get["port"]) == 8000
        return get["path"]

    assert probe_path("readinessProbe") == "/readyz"
    assert probe_path("livenessProbe") == "/healthz"
    assert probe_path("startupProbe") == "/readyz"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "allow >= 10 min for a cold warm-up"

    # preStop, then SIGTERM: the server drains (held requests finish, each within the request timeout)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    env = {e["name"]: e.get("value") for e in c["env"]}
    timeout_s = float(env.get("ATTNSERVE_REQUEST_TIMEOUT_MS") or 60000) / 1000
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + timeout_s + 30

    assert pod["securityContext"]["runAsNonRoot"] is True
    uid = re.search(r"^USER\s+(\d+)", DOCKERFILE.read_text(), re.M).group(1)
    assert pod["securityContext"]["runAsUser"] == int(uid)
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert dockerfile_env()["TRITON_CACHE_DIR"] in mounts
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_service_exposes_both_ports():
    (svc,) = find("Service")
    (dep,) = find("Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["port"]: p for p in svc["spec"]["ports"]}
    assert ports[8000]["appProtocol"] == "http" and ports[8001]["appProtocol"] == "grpc"
    container_ports = {p["name"] for p in _container(dep)["ports"]}
    assert {ports[8000]["targetPort"], ports[8001]["targetPort"]} <= container_ports


def test_hpa_scales_on_a_metric_the_service_exports_with_cpu_fallback():
    (hpa,) = find("HorizontalPodAutoscaler")
    (dep,) = find("Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    pods_metric = kinds["Pods"]["pods"]["metric"]["name"]
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    # The metric must be one the service really exports on /metrics.
    exported = set()
    for path in (ROOT / "service").rglob("*.py"):
        exported |= set(re.findall(r"\"(attnserve_[a-z_]+)\"", path.read_text()))
    assert pods_metric in exported, f"{pods_metric} is not exported by service/ ({sorted(exported)})"
    assert "queue" in pods_metric
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]


# --------------------------------------------------------------------------------------------- #
# Compose
# --------------------------------------------------------------------------------------------- #


def test_compose_gpu_reservation_and_cache_volume():
    compose = yaml.safe_load(COMPOSE.read_text())
    (svc,) = compose["services"].values()
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
               and (d.get("count") == "all" or d.get("device_ids") or int(d.get("count", 0)) >= 1)
               for d in devices)
    cache = dockerfile_env()["TRITON_CACHE_DIR"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"] if isinstance(v, str)}
    assert cache in mounts and mounts[cache] in compose["volumes"], "a named volume for the Triton cache"
    assert {"8000:8000", "8001:8001"} <= set(svc["ports"])
    build = svc["build"]
    assert (COMPOSE.parent / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
    grace = svc["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= 60


# --------------------------------------------------------------------------------------------- #
# ATTNSERVE_* variables
# --------------------------------------------------------------------------------------------- #


def _deploy_texts() -> dict[str, str]:
    paths = [DOCKERFILE, COMPOSE, *k8s_files(), ROOT / "docs" / "deploy.md"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if p.exists()}


def _env_values() -> list[tuple[str, str, str]]:
    """(file, NAME, value) for every ATTNSERVE_* value the image and manifests set."""
    out = [("Dockerfile", k, v) for k, v in dockerfile_env().items() if k.startswith("ATTNSERVE_")]
    for svc in yaml.safe_load(COMPOSE.read_text())["services"].values():
        out += [("compose.yaml", k, str(v)) for k, v in (svc.get("environment") or {}).items()]

    def walk(node, where):
        if isinstance(node, dict):
            if isinstance(node.get("env"), list):
                for e in node["env"]:
                    if "value" in e:
                        out.append((where, e["name"], str(e["value"])))
            for v in node.values():
                walk(v, where)
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for path, doc in k8s_docs():
        walk(doc, str(path.relative_to(ROOT)))
    return out


def test_every_attnserve_variable_is_a_settings_field(monkeypatch):
    from service.settings import Settings

    fields = {f"ATTNSERVE_{name.upper()}" for name in Settings.model_fields}
    named = {}
    for where, text in _deploy_texts().items():
        for var in re.findall(r"\bATTNSERVE_[A-Z0-9_]*[A-Z0-9]\b", text):
            named.setdefault(var, where)
    unknown = {v: w for v, w in named.items() if v not in fields}
    assert not unknown, f"not Settings fields: {unknown}"
    assert "ATTNSERVE_LAYER" in named and "ATTNSERVE_DEVICE" in named

    values = _env_values()
    assert values
    for where, name, value in values:
        assert name in fields, f"{where}: {name}"
        for key in list(os.environ):
            if key.startswith("ATTNSERVE_"):
                monkeypatch.delenv(key)
        monkeypatch.setenv(name, value)
        Settings()  # raises if the value does not parse (e.g. ATTNSERVE_LAYER must be a JSON list)
    # The layer examples in comments are JSON lists of NAME=DIR:INDEX, as pydantic-settings wants.
    for where, text in _deploy_texts().items():
        for example in re.findall(r"ATTNSERVE_LAYER[=:]\s*'(\[.*?\])'", text):
            parsed = json.loads(example)
            assert all(re.fullmatch(r"[\w.-]+=/[^:]+:\d+", item) for item in parsed), (where, example)


# --------------------------------------------------------------------------------------------- #
# The install script, in a clean venv (the slow one: ~1-2 min, mostly pip; wheels come from the
# local wheel dirs and pip's cache)
# --------------------------------------------------------------------------------------------- #


@pytest.mark.timeout(900)
def test_install_script_builds_a_working_venv(tmp_path):
    src, venv = tmp_path / "app", tmp_path / "venv"
    for rel in build_context_files():  # exactly what `COPY . /app/` gets
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATTNSERVE_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}
    # the interpreter behind this venv (a venv made from a venv's python points at the base anyway)
    in_venv = sys.prefix != sys.base_prefix
    env["PYTHON"] = str(Path(sys.base_prefix) / "bin" / "python3") if in_venv else sys.executable
    log = tmp_path / "install.log"
    with open(log, "w") as fh:
        proc = subprocess.run(["sh", str(src / "docker/install.sh"), str(venv), TORCH_PIN, str(src)],
                              cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=840)
    assert proc.returncode == 0, log.read_text()[-6000:]

    cfg = (venv / "pyvenv.cfg").read_text()
    assert re.search(r"include-system-site-packages\s*=\s*false", cfg), "a clean venv"
    py = str(venv / "bin" / "python")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args):
        return subprocess.run([py, *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=120)

    probe = run("-c", "import service, kernels, torch, triton, grpc, fastapi; "
                      "print(service.__file__); print(kernels.__file__); print(triton.__version__)")
    assert probe.returncode == 0, probe.stderr
    service_file, kernels_file, triton_version = probe.stdout.split()
    assert service_file.startswith(str(src)) and kernels_file.startswith(str(src)), probe.stdout
    assert triton_version == "3.6.0"

    helped = run("-m", "service", "--help")
    assert helped.returncode == 0, helped.stderr
    from service.settings import Settings

    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in helped.stdout

    # The stubs were generated at install time; loading them needs no write into the (root-owned,
    # read-only for the image's user) source tree.
    gen = src / "proto" / "gen"
    if gen.is_dir():
        before = {p: p.stat().st_mtime_ns for p in gen.rglob("*") if p.is_file() and p.name != ".lock"}
        assert any(p.name.endswith("_pb2.py") for p in before), "install.sh must generate the gRPC stubs"
        loaded = run("-c", "from service.grpc import protogen as g; [getattr(g, f)() for f in "
                           "('attention_stubs', 'inference_stubs') if hasattr(g, f)]")
        assert loaded.returncode == 0, loaded.stderr
        after = {p: p.stat().st_mtime_ns for p in gen.rglob("*") if p.is_file() and p.name != ".lock"}
        assert before == after, "the stubs were regenerated at run time"
