"""The MetaService's HTTP as Ascend's MetaService answers it (memcache_hybrid 1.3.0): ``/livez``,
``service_ready`` in ``/health`` (and ``/ready``, its probe), ``/kv_events/status``, ``/memory/evict``, ``/memory/prefetch``, and its 86 ``memcache_*`` metric
families next to ours, with values that follow the pool (docs/operations.md)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import MetaServiceProcess, free_port, running_meta_service, wait_for
from tests.integration.stores import StoreProcess
from tests.integration.test_disk_tier import LAYOUT, MS_CONFIG, provider

pytestmark = pytest.mark.integration

OPS = ("alloc", "batch_alloc", "get", "batch_get", "remove", "batch_remove", "remove_all", "update_state",
       "batch_update_state", "query", "batch_query", "get_all_keys", "exist_key", "batch_exist_key", "mount",
       "unmount")
ASCEND_FAMILIES = (   # the reference's list: memcache-hybrid-api.md, "Its /metrics families"
    "memcache_segment_capacity_bytes", "memcache_segment_allocated_bytes", "memcache_segment_fragmentation_bytes",
    "memcache_total_capacity_bytes", "memcache_allocated_bytes", "memcache_stored_keys",
    *(f"memcache_{op}_{c}_total" for op in OPS for c in ("requests", "successes", "failures", "not_found")),
    "memcache_evict_operations_total", "memcache_evict_running", "memcache_flush_blobs_total",
    "memcache_flush_bytes_total", "memcache_get_hits_dram_total", "memcache_get_hits_ssd_total",
    "memcache_query_hit_keys_total", "memcache_rewarm_total", "memcache_rewarm_failed_total",
    "memcache_rewarm_bytes_total", "memcache_rewarm_bytes_current", "memcache_kv_events_published_total",
    "memcache_kv_events_published_by_type_total", "memcache_kv_events_published_by_medium_total",
    "memcache_kv_events_dropped_total", "memcache_kv_events_dropped_stored_total",
)
KV_STATUS_FIELDS = {"enabled", "publisher_active", "queue_size", "queue_capacity", "published_events",
                    "published_batches", "published_by_type", "published_by_medium", "dropped_events",
                    "last_sequence"}


def call(ms: MetaServiceProcess, path: str, method: str = "GET", authorized: bool = True) -> tuple[int, bytes]:
    req = urllib.request.Request(ms.metrics_url + path, method=method,
                                 headers=ms.admin_headers() if authorized else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def series(text: str, name: str, labels: str = "") -> float:
    """The sum of a family's samples whose labels contain ``labels``."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(2)) for m in pat.finditer(text) if labels in (m.group(1) or ""))


def test_routes_and_metric_families_as_ascend_answers_them():
    """Scenario: a store puts, reads, probes, describes and removes objects; every one of Ascend's 86
    families is exported once, with counts that follow what was done; /livez needs no token,
    /kv_events/status and the /memory routes need the admin token like the other admin routes."""
    with running_meta_service(kv_events_enable=True, kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}") as ms:
        s = StoreProcess(ms, small_put_max_bytes=0)   # two-phase puts: one Alloc and one Commit request
        try:
            keys = [f"asc-{i}" for i in range(5)]
            assert s("put", keys=keys, layout=[4096])["codes"] == [0] * 5
            assert s("get", keys=[*keys, "absent"], layout=[4096])["codes"] == [0] * 5 + [-3007]
            assert s("exist", keys=[keys[0], "absent"])["codes"] == [1, 0]
            assert s("gva_info", keys=[keys[0], "absent"])["sizes"] == [4096, 0]
            assert s("remove", keys=[keys[4], "absent"])["codes"] == [0, -3007]
            assert call(ms, "/get_all_keys")[0] == 200

            assert call(ms, "/livez", authorized=False) == (200, b"ok")
            assert call(ms, "/kv_events/status", authorized=False)[0] == 401
            wait_for(lambda: json.loads(call(ms, "/kv_events/status")[1])["published_events"] == 7, 10,
                     "the start's AllBlocksCleared, 5 stored and 1 removed event published")
            status: dict[str, Any] = json.loads(call(ms, "/kv_events/status")[1])
            assert KV_STATUS_FIELDS <= set(status) and status["enabled"] and status["publisher_active"]
            assert status["published_by_type"] == {"stored": 5, "removed": 1, "cleared": 1}

            text = ms.http("/metrics")
            families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
            exported = {f if f in families else f.removesuffix("_total") for f in ASCEND_FAMILIES}
            assert len(ASCEND_FAMILIES) == 86 and exported <= families, sorted(exported - families)
            for f in exported:   # each family once
                assert len(re.findall(rf"^# TYPE {f} ", text, re.M)) == 1, f
            assert series(text, "memcache_alloc_requests_total") == 5
            assert series(text, "memcache_alloc_successes_total") == 5
            assert series(text, "memcache_batch_alloc_requests_total") == 1
            assert series(text, "memcache_get_requests_total") == 6
            assert series(text, "memcache_get_not_found_total") == 1
            assert series(text, "memcache_get_hits_dram_total") == 5
            assert series(text, "memcache_exist_key_not_found_total") == 1
            assert series(text, "memcache_query_hit_keys_total") == 1
            assert series(text, "memcache_remove_successes_total") == 1
            assert series(text, "memcache_remove_not_found_total") == 1
            assert series(text, "memcache_get_all_keys_requests_total") == 1
            assert series(text, "memcache_mount_requests_total") == 1
            assert series(text, "memcache_stored_keys") == 4
            assert series(text, "memcache_segment_allocated_bytes") == series(text, "memcache_segment_used_bytes") > 0
            assert series(text, "memcache_kv_events_published_by_type_total", 'type="stored"') == 5
            assert series(text, "memcache_kv_events_published_by_type_total", 'type="cleared"') == 1
            assert series(text, "memcache_kv_events_published_by_medium_total", 'medium="dram"') == 6

            for route in ("/memory/evict", "/memory/prefetch?keys=asc-0"):
                assert call(ms, route, "POST", authorized=False)[0] == 401
            code, body = call(ms, "/memory/evict", "POST")
            assert code == 200 and json.loads(body) == {"success": True, "evicted": 0}
            got = json.loads(call(ms, "/memory/prefetch?keys=asc-0,absent", "POST")[1])
            assert [r["result"] for r in got["results"]] == ["dram", "absent"]
            assert json.loads(call(ms, "/memory/prefetch", "POST")[1])["success"] is False
        finally:
            s.stop()


def test_memory_routes_evict_to_disk_and_prefetch_back(tmp_path):
    """Scenario: /memory/evict?keys= keeps objects on their provider's disk tier only (as the tier
    call ``evict``), /memory/prefetch?keys= has the provider bring them back into DRAM; reads stay
    byte-exact throughout."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        try:
            keys = ["mem-0", "mem-1"]
            assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0, 0]

            def evicted() -> bool:
                got = json.loads(call(ms, "/memory/evict?keys=mem-0,mem-1", "POST")[1])
                return [r["code"] for r in got["results"]] == [0, 0]

            wait_for(evicted, 10, "both objects written to disk, then kept there only")
            assert prov("key_info", keys=keys)["media"] == [["DISK"]] * 2
            got = json.loads(call(ms, "/memory/prefetch?keys=mem-0,mem-1,absent", "POST")[1])
            assert [r["result"] for r in got["results"]] == ["queued", "queued", "absent"]
            wait_for(lambda: prov("key_info", keys=keys)["media"] == [["DRAM", "DISK"]] * 2, 10,
                     "the provider to bring them back into DRAM")
            assert json.loads(call(ms, "/memory/prefetch?keys=mem-0", "POST")[1])["results"][0]["result"] == "dram"
            got = prov("get", keys=keys, layout=LAYOUT)
            assert got["codes"] == [0, 0] and not got["mismatches"]
        finally:
            prov.stop()


def test_health_says_when_the_pool_is_ready_and_ready_answers_503_until_then(tmp_path):
    """Scenario: a readiness check without the admin token. A MetaService without members is alive
    (/health 200) but not ready: ``service_ready`` false (Ascend's field) and /ready 503; a pure
    client joining changes nothing; once a LocalService with a segment joins, both say ready. /ready
    says nothing else, and /health keeps its fields."""
    ms = MetaServiceProcess(str(tmp_path))
    client, provider = DistributedObjectStore(), DistributedObjectStore()
    try:
        ms.start()
        health = ms.http("/health", authorized=False)
        assert health["status"] == "ok" and health["members"] == 0 and health["service_ready"] is False, health
        assert call(ms, "/ready", authorized=False) == (503, b'{"success": false, "service_ready": false}')
        assert client.setup(ms.local_config(dram_size="0")) == 0 and client.init(0, False) == 0
        assert ms.http("/health", authorized=False)["service_ready"] is False
        assert call(ms, "/ready", authorized=False)[0] == 503
        assert provider.setup(ms.local_config()) == 0 and provider.init(0, True) == 0
        health = ms.http("/health", authorized=False)
        assert health["service_ready"] is True and set(health) == {"success", "status", "epoch", "uptime_s",
                                                                   "members", "service_ready"}, health
        assert call(ms, "/ready", authorized=False) == (200, b'{"success": true, "service_ready": true}')
    finally:
        client.close()
        provider.close()
        ms.stop()
