"""What the stats snapshot counts, seen through /api/v1/stats and /metrics of a real pool: per-op
outcomes, member joins, leaves and deaths, a MetaService restart and the recovery after it."""

from __future__ import annotations

import urllib.request

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import free_port, wait_for

pytestmark = pytest.mark.integration


def test_outcomes_and_member_events(short_heartbeat, meta, stores):
    s, client = DistributedObjectStore(), DistributedObjectStore()
    assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    assert client.setup(meta.local_config()) == 0 and client.init(0, False) == 0
    try:
        assert s.put("o-1", b"x" * 100) == 0 and s.put("o-1", b"x" * 100) == 0   # second: already there
        assert s.get("o-1") and not s.get("o-absent")
        assert s.is_exist("o-1") == 1 and s.is_exist("o-absent") == 0
        assert s.remove("o-1") == 0
        client.close()
        doomed = stores()
        doomed.kill()                                  # SIGKILL: declared dead after heartbeat_timeout_ms
        wait_for(lambda: meta.http("/api/v1/stats")["events"].get("deaths") == 1, 10, "the death to be counted")
        snap = meta.http("/api/v1/stats")
        assert snap["events"]["joins"] == 3 and snap["events"]["leaves"] == 1
        out = snap["outcomes"]
        assert out["put"]["success"] == 1 and out["put"]["object_already_exists"] == 1
        assert out["get"]["hit"] >= 1 and out["get"]["miss"] >= 1
        assert out["exist"] == {"found": 1, "missing": 1} and out["remove"]["success"] == 1
        text = meta.http("/metrics")
        for line in ('memcache_member_events_total{event="deaths"} 1.0',
                     'memcache_op_outcomes_total{op="put",outcome="object_already_exists"} 1.0',
                     'memcache_op_outcomes_total{op="exist",outcome="missing"} 1.0'):
            assert line in text, line
    finally:
        s.close()


def test_restart_and_recovery_are_counted(meta):
    port = free_port()
    s = DistributedObjectStore()
    assert s.setup(meta.local_config(metrics_port=port, heartbeat_interval_ms=100)) == 0 and s.init(0, True) == 0
    try:
        for i in range(5):
            assert s.put(f"r-{i}", b"r" * 1000) == 0
        first = meta.http("/api/v1/stats")["epoch"]
        meta.kill()
        meta.start()
        wait_for(lambda: meta.http("/api/v1/stats")["objects"] == 5, 20, "the objects to be recovered")
        snap = meta.http("/api/v1/stats")
        assert snap["epoch"] != first
        assert snap["events"]["recoveries"] == 1 and snap["events"]["recovered_objects"] == 5
        text = meta.http("/metrics")
        assert "memcache_recoveries_total 1.0" in text and "memcache_recovered_objects_total 5.0" in text
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=meta.admin_headers())
        with urllib.request.urlopen(req, timeout=5) as r:
            local = r.read().decode()
        assert "memcache_local_meta_restarts_total 1.0" in local
    finally:
        s.close()
