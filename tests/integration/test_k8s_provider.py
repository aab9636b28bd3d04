"""The provider of examples/k8s/providers.yaml as Kubernetes runs it: its container's environment
(downward API and $(VAR) expansion as the kubelet makes them) and a hostname of its own, the pod's name
(a UTS namespace, as the pod has). A rollout replaces a node's provider pod with one of a new name; the
MetaService's series of that provider must go on under the same labels (docs/operations.md,
"Kubernetes")."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memcache_core.testing import free_port, start_local_service, terminate, wait_for
from tests.unit.test_deploy_files import pod_env

pytestmark = pytest.mark.integration

K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"
CLONE_NEWUTS = 0x04000000


def manifest(kind: str, name: str) -> dict[str, Any]:
    import yaml  # PyYAML comes with kubernetes-validate (the test extra)
    return next(d for p in K8S.glob("*.yaml") for d in yaml.safe_load_all(p.read_text(encoding="utf-8"))
                if d and d["kind"] == kind and d["metadata"]["name"] == name)


def with_hostname(name: str) -> Callable[[], None]:
    """In the child: a UTS namespace of its own with the pod's hostname, as a pod has."""
    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        raw = name.encode()
        if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(raw, len(raw)) != 0:
            raise OSError(ctypes.get_errno(), f"cannot become host {name}")
    return enter


def can_set_hostname() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--uts", "hostname", "probe"], capture_output=True, timeout=10).returncode == 0


def segment_labels(metrics: str) -> list[dict[str, str]]:
    return [dict(re.findall(r'(\w+)="([^"]*)"', m))
            for m in re.findall(r"^memcache_segment_capacity_bytes\{([^}]*)\}", metrics, re.M)]


def test_a_rollout_of_a_nodes_provider_keeps_its_metric_series(meta, tmp_path):
    """Scenario: node n1's provider pod is replaced (a DaemonSet rollout: the old pod leaves, a new pod
    with another name and hostname joins and gets a new segment id). The MetaService's series of that
    provider carry the same segment and host labels before and after, naming the node."""
    if not can_set_hostname():
        pytest.skip("needs a UTS namespace of its own per process (root or user namespaces)")
    container = manifest("DaemonSet", "memcache-provider")["spec"]["template"]["spec"]["containers"][0]
    provider_json = json.loads(manifest("ConfigMap", "memcache-config")["data"]["provider.json"])
    seen: list[tuple[int, list[dict[str, str]]]] = []

    def left(segment: int) -> bool:
        return all(g["segment_id"] != segment for g in meta.http("/get_all_segments")["segments"])

    for pod in ("memcache-provider-7xk2p", "memcache-provider-q9z4m"):
        port = free_port()
        config = {**provider_json, "meta_service_url": meta.meta_service_url,
                  "config_store_url": meta.config_store_url, "dram_size": "64MB",
                  "hcom_url": f"tcp://127.0.0.1:{port}", "hcom_advertise_url": f"tcp://127.0.0.1:{port}",
                  "metrics_port": free_port(), "metrics_host": "127.0.0.1", "heartbeat_interval_ms": 200,
                  "drain_timeout_ms": 0}
        config.pop("auth_secret_path")   # the test pool's secret: the default one
        env = {**os.environ, **pod_env(container, pod, "n1", "127.0.0.1")}
        proc, segment = start_local_service(config, tmp_path, lambda: meta.http("/get_all_segments")["segments"],
                                            name=pod, env=env, preexec=with_hostname(pod))
        try:
            labels = wait_for(lambda: segment_labels(meta.http("/metrics")), 15, "the provider's series")
            seen.append((segment, labels))
        finally:
            terminate(proc)
        wait_for(functools.partial(left, segment), 15, f"{pod} to leave the pool")
    (first, before), (second, after) = seen
    assert first != second                       # a new segment id, as every start draws
    assert before == after == [{"segment": "provider-n1", "host": "n1/memcache-provider", "tier": "dram"}]


def test_the_metaservice_starts_from_the_manifests_config_and_publishes_kv_events(tmp_path, monkeypatch):
    """Scenario: the MetaService's pod starts from meta.json as shipped (the addresses aside: this test
    binds loopback ports) in strict mode; its KV-event publisher runs (pyzmq, the events extra)."""
    from memcache_core.testing import MetaServiceProcess
    meta_json = json.loads(manifest("ConfigMap", "memcache-config")["data"]["meta.json"])
    bound = {k: re.sub(r"0\.0\.0\.0:\d+", f"127.0.0.1:{free_port()}", v) for k, v in meta_json.items()
             if isinstance(v, str) and "0.0.0.0:" in v}
    assert set(bound) >= {"kv_events_endpoint", "kv_events_replay_endpoint"}
    config = {**meta_json, **bound}
    config.pop("auth_secret_path")   # the test pool's secret: the default one
    monkeypatch.setenv("MEMCACHE_CONFIG_STRICT", "true")   # inherited by the MetaService, as its pod sets it
    ms = MetaServiceProcess(str(tmp_path), **config).start()

    def publishing() -> dict[str, Any] | None:
        status: dict[str, Any] = ms.http("/kv_events/status")
        return status if status.get("publisher_active") else None

    try:
        status = wait_for(publishing, 15, "the KV-event publisher")
        assert status is not None and status["enabled"] is True
    finally:
        ms.stop()
