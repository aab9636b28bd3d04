"""Errors an operator can act on (issue: each names the setting and the remedy, in one line, without a
traceback): a port in use, auth on at one end and off at the other, a taken metrics_port, a missing
MEMCACHE_SHM_DIR. Real processes and real sockets; each message is asserted, not just the exit code."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import free_port, running_meta_service, start_local_service, terminate

pytestmark = pytest.mark.integration


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def memcache(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memcache_core.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr


@pytest.mark.parametrize("key", ["meta_service_url", "config_store_url", "metrics_url"])
def test_a_metaservice_port_in_use_names_the_key_the_address_and_the_remedy(tmp_path, taken_port, key):
    urls = {"meta_service_url": f"tcp://127.0.0.1:{free_port()}", "config_store_url": f"tcp://127.0.0.1:{free_port()}",
            "metrics_url": f"http://127.0.0.1:{free_port()}"}
    urls[key] = urls[key].rsplit(":", 1)[0] + f":{taken_port}"
    path = tmp_path / "meta.json"
    path.write_text(json.dumps(urls))
    err = one_line_error(memcache("meta-service", "--config_path", str(path)))
    assert (f"{key}: cannot listen on 127.0.0.1:{taken_port}: the port is in use by another process "
            f"(stop it, or choose a free port in {key})") in err


def test_auth_off_here_and_on_at_the_metaservice_says_so(meta, caplog):
    """Scenario: the MetaService authenticates, this member has auth_enable false. It used to read the
    server's challenge as a frame length ("frame of 826360653 bytes")."""
    s = DistributedObjectStore()
    with caplog.at_level(logging.WARNING):
        assert s.setup(meta.local_config(auth_enable=False)) == 0
        assert s.init(0, True) == -3017
    s.close()
    assert "frame of" not in caplog.text
    assert ("it asks for the pool's authentication, but auth_enable is false here: set auth_enable: true and "
            "auth_secret_path to the pool secret here too") in caplog.text


def test_auth_on_here_and_off_at_the_metaservice_says_so(caplog):
    with running_meta_service(auth_enable=False) as ms:
        s = DistributedObjectStore()
        with caplog.at_level(logging.WARNING):
            assert s.setup(ms.local_config(client_timeout_seconds=1)) == 0
            assert s.init(0, True) != 0
        s.close()
    assert "no authentication challenge from the server within 1s: it runs with auth_enable: false?" in caplog.text
    assert "Set auth_enable (and auth_secret_path) alike on the MetaService and every member" in caplog.text


def test_a_taken_metrics_port_names_metrics_port(meta, taken_port, tmp_path, caplog):
    """Inside an engine a taken port is a warning (metrics never stop an engine's start); a
    standalone provider, whose metrics are its only view, refuses to start. Both name the setting."""
    s = DistributedObjectStore()
    with caplog.at_level(logging.WARNING):
        assert s.setup(meta.local_config(metrics_port=taken_port)) == 0
        assert s.init(0, True) == 0
    s.close()
    want = (f"metrics_port: cannot listen on 127.0.0.1:{taken_port}: the port is in use by another process "
            f"(stop it, or choose a free port in metrics_port)")
    assert want in caplog.text and "cannot create the segment or data server" not in caplog.text
    path = tmp_path / "provider.json"   # the same as a standalone provider: one line, no traceback
    path.write_text(json.dumps({"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
                                "protocol": "host_shm", "dram_size": "64MB", "metrics_port": taken_port}))
    assert want in one_line_error(memcache("local-service", "--config_path", str(path)))


def test_a_missing_shm_dir_names_memcache_shm_dir(meta, tmp_path):
    path = tmp_path / "provider.json"
    path.write_text(json.dumps({"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
                                "protocol": "host_shm", "dram_size": "64MB"}))
    missing = tmp_path / "no-such-tmpfs"
    err = one_line_error(memcache("local-service", "--config_path", str(path), env={"MEMCACHE_SHM_DIR": str(missing)}))
    assert (f"MEMCACHE_SHM_DIR: cannot create the segment file in {missing}: No such file or directory; point "
            "MEMCACHE_SHM_DIR at an existing tmpfs directory this user can write") in err


def test_a_misspelt_key_in_strict_mode_stops_the_metaservice(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text(json.dumps({"meta_service_url": f"tcp://127.0.0.1:{free_port()}", "lease_ttl_msec": 500}))
    err = one_line_error(memcache("meta-service", "--config_path", str(path), env={"MEMCACHE_CONFIG_STRICT": "true"}))
    assert "unknown MetaConfig keys: 'lease_ttl_msec' (did you mean 'lease_ttl_ms'?)" in err
    assert "strict mode: MEMCACHE_CONFIG_STRICT is set; fix or remove them" in err


def test_a_provider_takes_its_advertised_address_from_the_environment(meta, tmp_path):
    """Scenario: the Kubernetes provider (examples/k8s/providers.yaml) gets hcom_advertise_url from
    MEMCACHE_HCOM_ADVERTISE_URL, not from its file: the pool hands that address to peers."""
    config = {"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
              "protocol": "host_tcp", "dram_size": "64MB", "hcom_url": "tcp://0.0.0.0:0"}
    proc, segment_id = start_local_service(
        config, tmp_path, lambda: meta.http("/get_all_segments")["segments"],
        env={**os.environ, "MEMCACHE_HCOM_ADVERTISE_URL": "tcp://127.0.0.1:7000", "MEMCACHE_CONFIG_STRICT": "true"})
    try:
        seg = next(s for s in meta.http("/get_all_segments")["segments"] if s["segment_id"] == segment_id)
        assert seg["data_addr"] == "127.0.0.1:7000", seg
    finally:
        terminate(proc)
