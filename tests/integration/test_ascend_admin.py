"""The MetaService's HTTP as Ascend's MetaService answers it (memcache_hybrid 1.3.0): ``/livez``,
``service_ready`` in ``/health`` (and ``/ready``, its probe), ``/kv_events/status``, ``/memory/evict``, ``/memory/prefetch``, and its 86 ``memcache_*`` metric
families next to ours, with values that follow the pool (docs/operations.md)."""

from __future__ import annotations

import json
import re
import time
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


def call(ms: MetaServiceProcess, path: str, method: str = "GET", authorized: bool = True,
         body: Any = None) -> tuple[int, bytes]:
    """(status, body) of one admin request; ``body`` a JSON value (sent as such) or bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(ms.metrics_url + path, method=method, data=data,
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

            for route in ("/memory/evict", "/memory/prefetch"):
                assert call(ms, route, "POST", authorized=False, body={"chunk_hashes": ["asc-0"]})[0] == 401
            code, body = call(ms, "/memory/evict", "POST", body={"chunk_hashes": []})
            assert code == 200 and json.loads(body) == {"num_evicted": 0, "status": "success", "success": True}
            got = json.loads(call(ms, "/memory/prefetch", "POST", body={"chunk_hashes": ["asc-0", "absent"]})[1])
            assert [r["result"] for r in got["results"]] == ["dram", "absent"] and got["num_chunks"] == 2
            assert json.loads(call(ms, "/memory/prefetch", "POST")[1])["success"] is False
        finally:
            s.stop()


def test_memory_routes_evict_to_disk_and_prefetch_back(tmp_path):
    """Scenario: /memory/evict with ``{"chunk_hashes": keys}`` keeps objects on their provider's disk
    tier only (as the tier call ``evict``), /memory/prefetch has the provider bring them back into
    DRAM; reads stay byte-exact throughout."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        try:
            keys = ["mem-0", "mem-1"]
            assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0, 0]

            def evicted() -> bool:
                got = json.loads(call(ms, "/memory/evict", "POST", body={"chunk_hashes": keys})[1])
                return [r["code"] for r in got["results"]] == [0, 0] and got["num_evicted"] == 2

            wait_for(evicted, 10, "both objects written to disk, then kept there only")
            assert prov("key_info", keys=keys)["media"] == [["DISK"]] * 2
            got = json.loads(call(ms, "/memory/prefetch", "POST", body={"chunk_hashes": [*keys, "absent"]})[1])
            assert [r["result"] for r in got["results"]] == ["queued", "queued", "absent"]
            assert got["status"] == "prefetch_started" and got["num_chunks"] == 3
            wait_for(lambda: prov("key_info", keys=keys)["media"] == [["DRAM", "DISK"]] * 2, 10,
                     "the provider to bring them back into DRAM")
            got = json.loads(call(ms, "/memory/prefetch", "POST", body={"chunk_hashes": ["mem-0"]})[1])
            assert got["results"][0]["result"] == "dram"
            got = prov("get", keys=keys, layout=LAYOUT)
            assert got["codes"] == [0, 0] and not got["mismatches"]
        finally:
            prov.stop()


# memcache_hybrid 1.3.0's MetaService, every admin route called on an empty pool without HA: (method,
# path, JSON body) -> (status, answer). Transcribed from the project's reference ("The admin answers of
# memcache_hybrid 1.3.0's MetaService, recorded"); a str answer is text, None an empty body, and a
# timestamp is compared by type (it is the time of the call).
TS = 1796655268
RECORDED: list[tuple[str, str, Any, int, Any]] = [
    ("GET", "/health", None, 200, {"ha_state": "unknown", "leader_address": "unknown", "role": "unknown",
                                   "service_ready": True, "status": "ok", "view_version": 0}),
    ("GET", "/livez", None, 200, "ok"),
    ("GET", "/role", None, 200, "unknown"),
    ("GET", "/ha_status", None, 200, "unknown"),
    ("GET", "/leader", None, 200, {"leader_address": "unknown", "present": False, "view_version": 0}),
    ("GET", "/kv_events/status", None, 200, {
        "dropped_events": 0, "dropped_high_priority_events": 0, "dropped_stored_events": 0, "enabled": False,
        "last_sequence": 0, "published_batches": 0, "published_by_medium": {"dram": 0, "hbm": 0, "ssd": 0, "unknown": 0},
        "published_by_type": {"cleared": 0, "removed": 0, "stored": 0}, "published_events": 0,
        "publisher_active": False, "queue_capacity": 0, "queue_size": 0, "skipped_unparsed_keys": 0}),
    ("GET", "/query_key?key=a", None, 200, {"error_message": "Key not found", "success": False, "timestamp": TS}),
    ("GET", "/query_key", None, 200, {"error_message": "Missing 'key' parameter", "success": False, "timestamp": TS}),
    ("GET", "/batch_query_keys?keys=a,b", None, 200, {"data": [
        {"blobs": [], "key": "a", "numBlobs": 0, "prot": 0, "size": 0, "valid": False},
        {"blobs": [], "key": "b", "numBlobs": 0, "prot": 0, "size": 0, "valid": False}], "success": True}),
    ("GET", "/batch_query_keys", None, 200,
     {"error_message": "Missing 'keys' parameter", "success": False, "timestamp": TS}),
    ("GET", "/metadata?key=a", None, 200,
     {"error_message": "Metadata key not found", "success": False, "timestamp": TS}),
    ("GET", "/metadata", None, 200, {"error_message": "Missing 'key' parameter", "success": False, "timestamp": TS}),
    ("GET", "/query_segment?segment=1", None, 200,
     {"error_message": "Segment not found", "success": False, "timestamp": TS}),
    ("GET", "/query_segment", None, 200,
     {"error_message": "Missing 'segment' parameter", "success": False, "timestamp": TS}),
    ("GET", "/api/v1/segments/status", None, 200,
     {"error_message": "Missing 'segment' parameter", "success": False, "timestamp": TS}),
    ("GET", "/api/v1/capacity/usage", None, 200, {
        "cpu": {"free_bytes": 0, "total_bytes": 0, "usage_ratio": 0.0, "used_bytes": 0}, "data_source_ready": True,
        "degraded": False, "npu": {"free_bytes": 0, "total_bytes": 0, "usage_ratio": 0.0, "used_bytes": 0},
        "timestamp": TS}),
    ("GET", "/api/v1/capacity/segment_remaining", None, 200,
     {"data_source_ready": True, "degraded": False, "segments": [], "timestamp": TS}),
    ("GET", "/memory/evict", None, 405, None),
    ("GET", "/memory/prefetch", None, 405, None),
    ("GET", "/api/v1/drain_jobs", None, 405, None),
    ("POST", "/memory/evict", None, 200, {"error_message": "Invalid JSON body", "success": False, "timestamp": TS}),
    ("POST", "/memory/prefetch", {}, 200,
     {"error_message": "Missing 'chunk_hashes' in request body", "success": False, "timestamp": TS}),
    ("POST", "/memory/evict", {"chunk_hashes": [1, 2]}, 200,
     {"error_message": "'chunk_hashes' must be an array of strings", "success": False, "timestamp": TS}),
    ("POST", "/memory/evict", {"chunk_hashes": ["a"]}, 200, {"num_evicted": 0, "status": "success"}),
    ("POST", "/memory/prefetch", {"chunk_hashes": ["a"]}, 200,
     {"lookup_id": "", "num_chunks": 1, "status": "prefetch_started"}),
    ("GET", "/no/such/route", None, 404, None),
]
# Routes whose text answer is a one-line summary: Ascend's names, checked by name (values differ).
SUMMARY_NAMES = ("keys evict rewarm rewarm_fail rewarm_bytes_total rewarm_bytes_current flush_blobs flush_bytes "
                 "get_hit_dram get_hit_ssd query_hit_keys hbm_used dram_used ssd_used alloc_req alloc_success "
                 "alloc_fail batch_alloc_req get_req get_success get_fail get_not_found batch_get_req remove_req "
                 "remove_success remove_fail remove_not_found").split()


def same_shape(want: Any, got: Any, where: str = "") -> None:
    """``got`` has every field of ``want`` with its type, and its value where the value is not a time;
    fields ``got`` adds beyond ``want`` are ours (no client of Ascend's reads them)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {got!r} is not an object"
        for k, v in want.items():
            assert k in got, f"{where}: no field {k!r} in {got!r}"
            same_shape(v, got[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            same_shape(w, g, f"{where}[{i}]")
    elif where.endswith(".timestamp"):
        assert type(got) is int and abs(got - time.time()) < 600, f"{where}: {got!r}"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r}, Ascend answers {want!r}"


def answer(ms: MetaServiceProcess, method: str, path: str, body: Any) -> tuple[int, Any]:
    code, raw = call(ms, path, method, body=body)
    if not raw:
        return code, None
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode()


def test_every_route_answers_as_ascends_recorded_answers():
    """Scenario: each of memcache_hybrid's admin routes is called as its recorded answers were (empty
    pool, no HA): the status code, text or JSON, every field with its type and value (timestamps by
    type) as Ascend answered; ours adds fields only. Before, 19 points differed (JSON /role, a JSON
    /metrics/summary, ``keys`` instead of ``data`` rows, no /metadata, ``?keys=`` instead of a JSON
    body, 404 instead of 405, fields missing from /health, /leader and the capacity routes ...)."""
    with running_meta_service() as ms:
        for method, path, body, status, want in RECORDED:
            code, got = answer(ms, method, path, body)
            assert code == status, (method, path, code, got)
            if want is None or isinstance(want, str):
                assert got == want, (method, path, got)
            else:
                same_shape(want, got, f"{method} {path}")
        assert answer(ms, "GET", "/health", None)[0] == 200 and call(ms, "/health", authorized=False)[0] == 200
        code, summary = answer(ms, "GET", "/metrics/summary", None)
        assert code == 200 and isinstance(summary, str) and "\n" not in summary.strip()
        pairs = dict(kv.split("=", 1) for kv in summary.split())
        assert set(SUMMARY_NAMES) <= set(pairs), sorted(set(SUMMARY_NAMES) - set(pairs))
        assert pairs["keys"] == "0" and pairs["dram_used"] == "0/0" and pairs["hbm_used"] == "0/0"
        for path in ("/role", "/metrics/summary", "/metadata?key=a", "/query_key?key=a"):
            assert call(ms, path, authorized=False)[0] == 401   # ours keeps the token (docs/operations.md)


def test_a_pool_with_objects_disk_records_and_a_drain_answers_in_ascends_shapes(tmp_path):
    """Scenario: the same routes on a pool that holds objects (one also on its provider's disk tier) and
    has a drain in progress: rows are ``valid`` with their ``size`` and one blob per copy, the summary
    line and the capacity routes count what is held, a segment is found by its id, /metadata keeps a
    value until it is deleted, and a drain started through ``/api/v1/drain_jobs`` is found by its job id."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        try:
            keys = ["full-0", "full-1", "full-2"]
            size = sum(LAYOUT)
            assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0, 0, 0]
            wait_for(lambda: all(r["numBlobs"] == 2 for r in
                                 json.loads(call(ms, "/batch_query_keys?keys=" + ",".join(keys))[1])["data"]), 15,
                     "each object written through to the disk tier (a second blob)")
            rows = json.loads(call(ms, "/batch_query_keys?keys=full-0,absent")[1])["data"]
            assert [r["valid"] for r in rows] == [True, False] and rows[0]["size"] == size
            assert {b["medium"] for b in rows[0]["blobs"]} == {"dram", "ssd"} and rows[0]["key"] == "full-0"
            one = json.loads(call(ms, "/query_key?key=full-1")[1])
            assert one["success"] and one["valid"] and one["size"] == size and one["numBlobs"] == 2
            assert type(one["timestamp"]) is int

            usage = json.loads(call(ms, "/api/v1/capacity/usage")[1])
            assert usage["cpu"]["total_bytes"] == 32 << 20 and usage["cpu"]["used_bytes"] >= 3 * size
            assert usage["cpu"]["free_bytes"] == usage["cpu"]["total_bytes"] - usage["cpu"]["used_bytes"]
            assert 0 < usage["cpu"]["usage_ratio"] < 1 and usage["npu"]["total_bytes"] == 0
            (seg,) = json.loads(call(ms, "/api/v1/capacity/segment_remaining")[1])["segments"]
            assert seg["remaining_bytes"] == seg["capacity_bytes"] - seg["used_bytes"]
            sid = seg["segment_id"]
            for route in ("/query_segment", "/api/v1/segments/status"):
                found = json.loads(call(ms, f"{route}?segment={sid}")[1])
                assert found["success"] and found["segment_id"] == sid and found["objects"] == 3
            pairs = dict(kv.split("=", 1) for kv in call(ms, "/metrics/summary")[1].decode().split())
            assert pairs["keys"] == "3" and pairs["alloc_req"] == "3" and pairs["flush_blobs"] == "3"
            assert pairs["dram_used"] == f"{usage['cpu']['used_bytes']}/{32 << 20}"
            assert pairs["ssd_used"].split("/")[1] == str(128 << 20) and int(pairs["ssd_used"].split("/")[0]) > 0

            assert json.loads(call(ms, "/metadata?key=owner", "PUT", body=b"team-a")[1])["success"]
            got = json.loads(call(ms, "/metadata?key=owner")[1])
            assert got["success"] and got["value"] == "team-a" and type(got["timestamp"]) is int
            assert call(ms, "/metadata?key=owner", "PUT", authorized=False, body=b"x")[0] == 401
            assert json.loads(call(ms, "/metadata?key=owner", "DELETE")[1])["success"]
            assert json.loads(call(ms, "/metadata?key=owner")[1])["error_message"] == "Metadata key not found"

            # no other segment has room: the drain stays in progress for its timeout
            job = json.loads(call(ms, f"/api/v1/drain_jobs?segment={sid}&timeout_ms=60000", "POST")[1])
            assert job["success"] and job["job_id"] == str(sid) and job["status"] == "draining"
            q = json.loads(call(ms, f"/api/v1/drain_jobs/query?job_id={sid}")[1])
            assert q["job_id"] == str(sid) and q["status"] == "draining" and q["objects_left"] == 3
            assert json.loads(call(ms, "/api/v1/drain_jobs/query?job_id=999")[1])["error_message"] == \
                "Drain job not found"
            status = json.loads(call(ms, "/health")[1])
            assert status["status"] == "ok" and status["service_ready"] is True and status["segments"] == 1
            assert prov("get", keys=keys, layout=LAYOUT)["mismatches"] == []
        finally:
            prov.stop()


def test_health_says_when_the_pool_is_ready_and_ready_answers_503_until_then(tmp_path):
    """Scenario: a readiness check without the admin token. A MetaService without members is alive
    (/health 200, and ``service_ready`` true: Ascend's field says the MetaService serves, as its own
    answers on an empty pool) but the pool is not ready: ``pool_ready`` false and /ready 503; a pure
    client joining changes nothing; once a LocalService with a segment joins, both say ready. /ready
    says nothing else."""
    ms = MetaServiceProcess(str(tmp_path))
    client, provider = DistributedObjectStore(), DistributedObjectStore()
    try:
        ms.start()
        health = ms.http("/health", authorized=False)
        assert health["status"] == "ok" and health["members"] == 0 and health["pool_ready"] is False, health
        assert health["service_ready"] is True
        assert call(ms, "/ready", authorized=False) == (503, b'{"success": false, "pool_ready": false}')
        assert client.setup(ms.local_config(dram_size="0")) == 0 and client.init(0, False) == 0
        assert ms.http("/health", authorized=False)["pool_ready"] is False
        assert call(ms, "/ready", authorized=False)[0] == 503
        assert provider.setup(ms.local_config()) == 0 and provider.init(0, True) == 0
        health = ms.http("/health", authorized=False)
        assert health["pool_ready"] is True and health["service_ready"] is True, health
        assert call(ms, "/ready", authorized=False) == (200, b'{"success": true, "pool_ready": true}')
    finally:
        client.close()
        provider.close()
        ms.stop()
