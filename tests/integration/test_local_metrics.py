"""A LocalService's own metrics port: transfer bytes and latency per path, behind the admin token."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.config import LocalConfig
from memcache_core.errors import ConfigError
from memcache_core.testing import free_port, scrape_metrics

pytestmark = pytest.mark.integration


def test_transfer_metrics_per_path(meta):
    ports = [free_port(), free_port()]
    a, b = DistributedObjectStore(), DistributedObjectStore()
    assert a.setup(meta.local_config(metrics_port=ports[0])) == 0 and a.init(0, True) == 0
    assert b.setup(meta.local_config(protocol="host_tcp", metrics_port=ports[1])) == 0 and b.init(0, True) == 0
    try:
        assert a.put("m-1", b"a" * 300_000) == 0          # into a's own segment: host_shm
        assert b.get("m-1") == b"a" * 300_000             # b reads a's segment over TCP: host_tcp
        ma, mb = scrape_metrics(ports[0], meta.admin_headers()), scrape_metrics(ports[1], meta.admin_headers())
        wr = 'memcache_local_transfer_bytes_total{direction="write",path="host_shm"}'
        rd = 'memcache_local_transfer_bytes_total{direction="read",path="host_tcp"}'
        assert ma[wr] >= 300_000 and mb[rd] >= 300_000, (ma, mb)
        assert mb['memcache_local_transfer_seconds_count{direction="read",path="host_tcp"}'] >= 1
        assert "memcache_local_meta_restarts_total" in ma
        if meta.admin_headers():
            with pytest.raises(urllib.error.HTTPError) as e:
                scrape_metrics(ports[0], {})
            assert e.value.code == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        a.close()
        b.close()


def test_metrics_port_is_validated():
    with pytest.raises(ConfigError, match="metrics_port"):
        LocalConfig(metrics_port=70000)
    with pytest.raises(ConfigError, match="metrics_host"):
        LocalConfig(metrics_port=9000, metrics_host="")
