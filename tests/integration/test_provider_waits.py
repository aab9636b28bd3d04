"""A standalone provider (``memcache local-service``) and its MetaService started in any order, as
applying Kubernetes manifests all at once does: the provider waits for the MetaService (its /health
alive and saying it has not joined, its /ready 503, ``memcache_local_joined`` 0), joins once it
answers and serves puts and gets; a wrong pool secret is no reason to wait (exit 1, naming the
secret file). Real processes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import (
    MetaServiceProcess,
    die_with_parent,
    free_port,
    make_tls_files,
    scrape_metrics,
    terminate,
    wait_for,
)

pytestmark = pytest.mark.integration


def _get(url: str) -> tuple[int, dict[str, Any]]:
    """An open GET (no token): its status and JSON body, 503 included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _provider(ms: MetaServiceProcess, tmp_path: Path, **extra: Any) -> tuple[subprocess.Popen[bytes], Path, int]:
    port = free_port()
    conf = {"meta_service_url": ms.meta_service_url, "config_store_url": ms.config_store_url,
            "protocol": "host_shm", "dram_size": "32MB", "heartbeat_interval_ms": 200, "metrics_port": port,
            "client_timeout_seconds": 2, "client_retry_milliseconds": 6000, **extra}
    path = tmp_path / "provider.json"
    path.write_text(json.dumps(conf))
    log = tmp_path / "provider.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "local-service", "--config_path", str(path)],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
    return proc, log, port


def _alive(proc: subprocess.Popen[bytes], log: Path) -> bool:
    """Fails the test when the provider exited; False otherwise (to chain: ``_alive(...) or cond``)."""
    assert proc.poll() is None, f"the provider exited with {proc.returncode}: {log.read_text()[-2000:]}"
    return False


def test_a_provider_started_before_its_metaservice_waits_and_joins(tmp_path):
    """Scenario: the provider starts while nothing answers at meta_service_url. It stays up, logs
    the wait once, says it has not joined on /health (200: alive), /ready (503) and its metrics;
    once the MetaService starts it joins, says so, and an engine's put lands in its segment and
    reads back byte-exact."""
    ms = MetaServiceProcess(str(tmp_path))             # its ports chosen, not started
    proc, log, port = _provider(ms, tmp_path)
    engine = DistributedObjectStore()
    try:
        def failed_twice() -> bool:
            _alive(proc, log)
            try:
                m = scrape_metrics(port, ms.admin_headers())
            except OSError:
                return False
            return m.get("memcache_local_join_failures_total", 0) >= 2
        wait_for(failed_twice, 60, "the provider to try to join twice and fail")
        _alive(proc, log)                              # past its first attempts, still waiting
        m = scrape_metrics(port, ms.admin_headers())
        assert m["memcache_local_joined"] == 0
        status, health = _get(f"http://127.0.0.1:{port}/health")
        assert status == 200 and health["joined"] is False and health["service_ready"] is False, health
        assert _get(f"http://127.0.0.1:{port}/ready")[0] == 503
        ms.start()

        def joined() -> int:
            _alive(proc, log)
            return next((s["segment_id"] for s in ms.http("/get_all_segments")["segments"]
                         if s.get("pid") == proc.pid), 0)
        sid = wait_for(joined, 60, "the provider to join")
        status, health = _get(f"http://127.0.0.1:{port}/health")
        assert status == 200 and health["joined"] is True, health
        assert _get(f"http://127.0.0.1:{port}/ready")[0] == 200
        assert scrape_metrics(port, ms.admin_headers())["memcache_local_joined"] == 1
        assert engine.setup(ms.local_config(dram_size="0")) == 0 and engine.init(0, False) == 0
        value = secrets.token_bytes(300_000)
        assert engine.put("waited-for", value) == 0 and engine.get("waited-for") == value
        assert ms.http("/query_key?key=waited-for")["locations"][0]["segment"] == sid
        text = log.read_text()
        assert text.count("cannot join the pool yet") == 1, text   # one line per outage, not per attempt
    finally:
        engine.close()
        terminate(proc)
        ms.stop()


@pytest.mark.parametrize("meta_first", [True, False], ids=["metaservice-up", "metaservice-later"])
def test_a_provider_with_a_wrong_secret_exits_naming_it(tmp_path, meta_first):
    """Scenario: the provider's secret file is not the pool's. Whether the MetaService answers at once
    or only after the provider began waiting, the provider does not wait forever: it exits 1 with a
    line naming auth_secret_path and the file."""
    wrong = tmp_path / "other-pool.secret"
    wrong.write_text(secrets.token_hex(32) + "\n")
    os.chmod(wrong, 0o600)
    ms = MetaServiceProcess(str(tmp_path))
    if meta_first:
        ms.start()
    proc, log, port = _provider(ms, tmp_path, auth_secret_path=str(wrong))
    try:
        if not meta_first:
            wait_for(lambda: _alive(proc, log) or "cannot join the pool yet" in log.read_text(), 60,
                     "the provider to wait for the MetaService")
            ms.start()
        wait_for(lambda: proc.poll() is not None, 60, lambda: f"the provider to exit: {log.read_text()[-2000:]}")
        text = log.read_text()
        assert proc.returncode == 1, text
        assert "auth_secret_path" in text and str(wrong) in text and "wrong pool secret" in text, text
    finally:
        terminate(proc)
        ms.stop()



@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_provider_whose_ca_does_not_verify_the_metaservice_exits_naming_tls_ca_path(tmp_path):
    """Scenario: TLS on, but the provider's certificates come from another CA than the MetaService's:
    its certificate can never verify, so the provider exits 1 naming tls_ca_path rather than wait."""
    (tmp_path / "pool").mkdir()
    (tmp_path / "other").mkdir()
    pool_tls, other_tls = make_tls_files(str(tmp_path / "pool")), make_tls_files(str(tmp_path / "other"))
    ms = MetaServiceProcess(str(tmp_path), **pool_tls)
    ms.start()
    proc, log, _ = _provider(ms, tmp_path, **other_tls)
    try:
        wait_for(lambda: proc.poll() is not None, 60, lambda: f"the provider to exit: {log.read_text()[-2000:]}")
        text = log.read_text()
        assert proc.returncode == 1 and "tls_ca_path" in text and other_tls["tls_ca_path"] in text, text
    finally:
        terminate(proc)
        ms.stop()
