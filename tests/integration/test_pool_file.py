"""One pool file for every role, with real processes: ``memcache meta-service --config_path F`` and
``memcache local-service --config_path F`` start from the same file in strict mode without a word
about each other's keys, and clients set up from that file (directly, and through the SGLang
backend's config builder with ``config_path``) put and get byte-exact through the provider."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from memcache_sglang.config import BackendConfig

from memcache_core import DistributedObjectStore, LocalConfig
from memcache_core.config import load_file
from memcache_core.errors import ConfigError
from memcache_core.testing import die_with_parent, free_port, terminate, wait_for

pytestmark = pytest.mark.integration


def _start(role: str, path: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "memcache_core.cli", role, "--config_path", str(path)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent())


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _stats(metrics_url: str, secret_path: str) -> dict[str, Any]:
    from memcache_core.auth import admin_token, load_secret
    req = urllib.request.Request(metrics_url + "/api/v1/stats",
                                 headers={"Authorization": f"Bearer {admin_token(load_secret(secret_path))}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return dict(json.loads(r.read()))


def _round_trip(cfg: LocalConfig, key: str) -> None:
    store = DistributedObjectStore()
    assert store.setup(cfg) == 0 and store.init(0, False) == 0
    try:
        value = os.urandom(300_000)
        assert store.put(key, value) == 0
        assert store.get(key) == value
    finally:
        store.close()


def test_one_file_starts_the_metaservice_and_a_provider_and_serves_clients(tmp_path):
    """Scenario: an operator writes the pool's URLs once, in one file, and starts each role from it
    with MEMCACHE_CONFIG_STRICT=true; an engine's client reads the same file (its own dram_size "0"
    given inline) and its puts land in the provider's segment."""
    pool: dict[str, Any] = {"meta_service_url": f"tcp://127.0.0.1:{free_port()}", "config_store_url": f"tcp://127.0.0.1:{free_port()}",
            "metrics_url": f"http://127.0.0.1:{free_port()}", "pool_name": "poolfile", "auth_enable": True,
            "log_level": "info", "evict_threshold_high": 90, "heartbeat_timeout_ms": 3000,
            "protocol": "host_tcp", "dram_size": "32MB", "hcom_url": "tcp://127.0.0.1:0",
            "heartbeat_interval_ms": 200, "client_timeout_seconds": 5}
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(pool))
    env = {**os.environ, "MEMCACHE_CONFIG_STRICT": "true"}
    meta_log, provider_log = tmp_path / "meta.log", tmp_path / "provider.log"
    meta = _start("meta-service", path, meta_log, env)
    provider = None
    try:
        def healthy() -> bool:
            assert meta.poll() is None, f"meta-service exited: {meta_log.read_text()[-2000:]}"
            try:
                return _get(pool["metrics_url"] + "/health").get("success") is True
            except OSError:
                return False
        wait_for(healthy, 30, "the MetaService to answer /health")
        provider = _start("local-service", path, provider_log, env)

        def provider_joined() -> bool:
            assert provider is not None and provider.poll() is None, \
                f"local-service exited: {provider_log.read_text()[-2000:]}"
            return any(s.get("pid") == provider.pid for s in _stats(pool["metrics_url"], "")["segments"])
        wait_for(provider_joined, 30, "the provider to join")

        os.environ["MEMCACHE_CONFIG_STRICT"] = "true"
        try:
            direct = load_file(LocalConfig, str(path))
            direct.dram_size = "0"                                  # this process: a client only
            _round_trip(direct, "poolfile/direct")
            # the SGLang backend's builder: the file's store keys, the inline ones over them
            built = BackendConfig.from_sources({"config_path": str(path), "dram_size": "0", "init_bm": False})
            sglang = LocalConfig()
            assert built.apply_to(sglang) == []
            sglang.validate()
            assert (sglang.meta_service_url, sglang.pool_name, sglang.protocol, sglang.dram_size) == \
                (pool["meta_service_url"], "poolfile", "host_tcp", "0")
            _round_trip(sglang, "poolfile/sglang")
        finally:
            del os.environ["MEMCACHE_CONFIG_STRICT"]
        stats = _stats(pool["metrics_url"], "")
        assert stats["objects"] == 2 and [s["pid"] for s in stats["segments"]] == [provider.pid]
    finally:
        if provider is not None:
            terminate(provider)
        terminate(meta)
    for log in (meta_log, provider_log):
        text = log.read_text()
        assert "unknown" not in text and "ignoring" not in text, text[-3000:]
    assert "serving" in provider_log.read_text()


def test_the_sglang_builder_reads_config_path_with_inline_keys_winning(tmp_path, monkeypatch):
    pool = tmp_path / "pool.json"
    pool.write_text(json.dumps({"meta_service_url": "tcp://10.0.0.1:5000", "metrics_url": "http://10.0.0.1:8000",
                                "protocol": "host_tcp", "dram_size": "8GB", "client_timeout_seconds": 9,
                                "lease_ttl_ms": 20000}))
    monkeypatch.setenv("MEMCACHE_CONFIG_STRICT", "true")
    monkeypatch.setenv("MEMCACHE_HEARTBEAT_INTERVAL_MS", "300")   # an override the file leaves out
    built = BackendConfig.from_sources({"config_path": str(pool), "dram_size": "0", "init_bm": False})
    assert built.local_fields == {"meta_service_url": "tcp://10.0.0.1:5000", "protocol": "host_tcp",
                                  "dram_size": "0", "client_timeout_seconds": 9, "heartbeat_interval_ms": 300}
    assert built.metrics_url is None and not built.init_bm   # the pool file gives store keys only
    for bad, message in ((tmp_path / "missing.json", "^config_path: cannot read .*missing.json"),
                         (tmp_path / "list.json", "^config_path: .*expected a JSON object")):
        if bad.name == "list.json":
            bad.write_text("[1]")
        with pytest.raises(ConfigError, match=message):
            BackendConfig.from_sources({"config_path": str(bad)})
    pool.write_text(json.dumps({"dram_szie": "1GB"}))
    with pytest.raises(ConfigError, match="^config_path: .*'dram_szie' \\(did you mean 'dram_size'\\?\\).*strict"):
        BackendConfig.from_sources({"config_path": str(pool)})


def _read_relative_pool_file(path: str) -> dict[str, Any]:
    """In a process started the way vLLM starts its engine core and workers (multiprocessing)."""
    return BackendConfig.from_sources({"config_path": path}).local_fields


def test_a_relative_config_path_is_read_from_the_engines_working_directory(tmp_path, monkeypatch):
    """Scenario: `vllm serve` or SGLang started in the directory of pool.json, with "config_path":
    "pool.json". The engine and the processes it starts (they inherit its working directory) read
    that file; started elsewhere, the same setting fails naming the path."""
    import multiprocessing

    (tmp_path / "pool.json").write_text(json.dumps({"meta_service_url": "tcp://10.0.0.1:5000", "protocol": "host_tcp"}))
    monkeypatch.chdir(tmp_path)
    want = {"meta_service_url": "tcp://10.0.0.1:5000", "protocol": "host_tcp"}
    assert _read_relative_pool_file("pool.json") == want
    with multiprocessing.get_context("spawn").Pool(1) as workers:
        assert workers.apply(_read_relative_pool_file, ("pool.json",)) == want
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError, match="^config_path: cannot read pool.json"):
        _read_relative_pool_file("pool.json")
