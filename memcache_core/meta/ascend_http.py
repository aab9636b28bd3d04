"""The admin routes' answers in memcache_hybrid 1.3.0's own shapes (http.py routes to these).

A dashboard or tool written against Ascend's MetaService reads these fields, types and status codes
as its MetaService answers them (recorded in the project's reference, "The admin answers ..."): the
same field names and types, plain text where it answers text (``/role``, ``/ha_status``,
``/metrics/summary``), an integer ``timestamp`` in errors, 405 on a GET of a POST-only route and 404
with an empty body for an unknown path. What this MetaService knows beyond that is added as extra
JSON fields (``success``, ``locations``, ``segments`` ...), which no JSON client of Ascend's reads.

Two differences stay, on purpose: every route but ``/health`` and ``/livez`` needs the admin token
(Ascend's port is open), and ``/get_all_keys`` / ``/get_all_segments`` answer JSON (Ascend answers an
empty body for an empty pool; its answer for a full one is not recorded, and ours must stay
machine-readable): docs/operations.md, "Ascend's admin API".
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParameter
from . import ascend_metrics, stats, validate
from .metadata import error, missing, timestamp

if TYPE_CHECKING:
    from .service import MetaServiceCore

MAX_BODY_BYTES = 1 << 20        # a POST/PUT body read at most (a larger one is refused unread)


# ---- role, leader, health ---------------------------------------------------------------------------

def _ha(core: MetaServiceCore) -> tuple[str, str, str, int, bool]:
    """(role, ha_state, leader_address, view_version, serving) as Ascend names them: "unknown" for
    the first three without HA, as its MetaService answers without HA."""
    if core.ha is None:
        return "unknown", "unknown", "unknown", 0, True
    st = core.ha.status()
    leader = st.get("leader") or {}
    addr = str(leader.get("control", "")).split("://", 1)[-1] or "unknown"
    serving = st["role"] == "leader"
    return st["role"], "leading" if serving else "following", addr, int(leader.get("term") or 0), serving


def role_word(core: MetaServiceCore) -> str:
    """``/role`` and ``/ha_status``: one word of text."""
    return _ha(core)[0]


def pool_ready(snap: stats.Snapshot) -> bool:
    """The pool can take puts (ours, ``/ready``): this MetaService serves (not an HA standby) and at
    least one segment joined that takes new objects (not draining, past a re-join's grace, not held by
    its owner; a full one evicts). Ascend's ``service_ready`` says less: that the MetaService serves,
    true on an empty pool."""
    return snap.role != "standby" and any(g.capacity_bytes > 0 and g.accepts_new_objects_in_s == 0.0 and not g.held
                                          for g in snap.segments)


def health(core: MetaServiceCore, snap: stats.Snapshot) -> dict[str, Any]:
    role, state, addr, version, serving = _ha(core)
    joined = [g for g in snap.segments if g.capacity_bytes > 0]
    return {"ha_state": state, "leader_address": addr, "role": role, "service_ready": serving,
            "status": "ok", "view_version": version,
            # ours
            "success": True, "epoch": snap.epoch, "uptime_s": snap.uptime_s, "members": len(snap.members),
            "segments": len(joined), "pool_ready": pool_ready(snap)}


def leader(core: MetaServiceCore) -> dict[str, Any]:
    role, _, addr, version, _ = _ha(core)
    if core.ha is None:
        cfg = core.config
        ours: dict[str, Any] = {"ha_enable": False, "role": "leader", "term": 0, "leader": {
            "control": cfg.meta_service_url, "config_store": cfg.config_store_url, "admin": cfg.metrics_url,
            "term": 0}}
    else:
        st = core.ha.status()
        ours = {"ha_enable": True, "role": st["role"], "term": st["term"], "cluster_id": st["cluster_id"],
                "etcd_reachable": st["etcd_reachable"], "lease_ttl_s": st["lease_ttl_s"], "leader": st["leader"]}
    return {"leader_address": addr, "present": core.ha is not None and addr != "unknown",
            "view_version": version, "success": True, **ours}


# ---- keys -------------------------------------------------------------------------------------------

def key_row(core: MetaServiceCore, key: str, now: float) -> dict[str, Any]:
    """One key as Ascend's ``batch_query_keys`` row (``blobs``: one per copy), with ours added."""
    o = core.table.objects.get(key)
    if o is None or not o.committed:
        return {"blobs": [], "key": key, "numBlobs": 0, "prot": 0, "size": 0, "valid": False, "exists": False}
    locs = [{"segment": loc.segment_id, "offset": loc.offset} for loc in o.locations]
    blobs = [{"segment": loc["segment"], "offset": loc["offset"], "size": o.size, "medium": "dram"} for loc in locs]
    if o.disk is not None:
        blobs.append({"segment": o.disk[0], "offset": 0, "size": o.size, "medium": "ssd"})
    return {"blobs": blobs, "key": key, "numBlobs": len(blobs), "prot": 0, "size": o.size, "valid": True,
            "exists": True, "generation": o.generation, "leased": o.lease_until > now,
            "replicas_wanted": o.replicas, "locations": locs,
            "disk": o.disk[0] if o.disk is not None else None}


def query_key(core: MetaServiceCore, q: dict[str, str], now: float) -> dict[str, Any]:
    if "key" not in q:
        return missing("key")
    row = key_row(core, q["key"], now)
    if not row["valid"]:
        return error("Key not found")
    return {"success": True, "timestamp": timestamp(), **row}


def batch_query_keys(core: MetaServiceCore, q: dict[str, str], now: float) -> dict[str, Any]:
    if "keys" not in q:
        return missing("keys")
    rows = [key_row(core, k, now) for k in q["keys"].split(",") if k]
    return {"data": rows, "success": True, "keys": rows}


# ---- segments and capacity --------------------------------------------------------------------------

def segment(g: stats.SegmentStats) -> dict[str, Any]:
    return {"segment_id": g.segment_id, "host_id": g.host_id, "tag": g.tag, "data_addr": g.data_addr,
            "metrics_addr": g.metrics_addr, "pid": g.pid, "capacity_bytes": g.capacity_bytes,
            "used_bytes": g.used_bytes, "remaining_bytes": g.capacity_bytes - g.used_bytes, "objects": g.objects,
            "largest_free_bytes": g.largest_free_bytes, "accepts_new_objects": g.accepts_new_objects_in_s == 0.0 and not g.held,
            "accepts_new_objects_in_s": g.accepts_new_objects_in_s, "draining": g.draining, "held": g.held}


def find_segment(snap: stats.Snapshot, q: dict[str, str]) -> dict[str, Any]:
    """``/query_segment`` and ``/api/v1/segments/status``: one segment by ``?segment=<id>``."""
    if "segment" not in q:
        return missing("segment")
    for g in snap.segments:
        if str(g.segment_id) == q["segment"].strip():
            return {"success": True, "timestamp": timestamp(), **segment(g)}
    return error("Segment not found")


def _usage(total: int, used: int) -> dict[str, Any]:
    return {"free_bytes": total - used, "total_bytes": total, "usage_ratio": used / total if total else 0.0,
            "used_bytes": used}


def capacity_usage(snap: stats.Snapshot) -> dict[str, Any]:
    """Every segment here is host memory: Ascend's ``cpu``; ``npu`` (HBM segments) is zero."""
    total, used = snap.capacity_bytes, snap.used_bytes
    return {"cpu": _usage(total, used), "data_source_ready": True, "degraded": False, "npu": _usage(0, 0),
            "timestamp": timestamp(),
            "success": True, "total_bytes": total, "used_bytes": used, "free_bytes": total - used,
            "usage_percent": round(100.0 * used / total, 3) if total else 0.0,
            "segments": [segment(g) for g in snap.segments]}


def segment_remaining(snap: stats.Snapshot) -> dict[str, Any]:
    return {"data_source_ready": True, "degraded": False, "segments": [segment(g) for g in snap.segments],
            "timestamp": timestamp(), "success": True}


def summary_line(snap: stats.Snapshot) -> str:
    """``/metrics/summary``: one line of ``name=value`` pairs, from the values the metric families
    export (``ascend_metrics.values``: each computed once)."""
    v = ascend_metrics.values(snap)
    used, total = snap.used_bytes, snap.capacity_bytes
    disk_used = sum(d.used_bytes for d in snap.disk_tiers)
    disk_total = sum(d.capacity_bytes for d in snap.disk_tiers)
    pairs = [("keys", v["stored_keys"]), ("evict", v["evict_operations"]), ("rewarm", v["rewarm"]),
             ("rewarm_fail", v["rewarm_failed"]), ("rewarm_bytes_total", v["rewarm_bytes"]),
             ("rewarm_bytes_current", v["rewarm_bytes_current"]), ("flush_blobs", v["flush_blobs"]),
             ("flush_bytes", v["flush_bytes"]), ("get_hit_dram", v["get_hits_dram"]),
             ("get_hit_ssd", v["get_hits_ssd"]), ("query_hit_keys", v["query_hit_keys"]),
             ("hbm_used", "0/0"), ("dram_used", f"{used}/{total}"), ("ssd_used", f"{disk_used}/{disk_total}")]
    for op, source, _ in ascend_metrics.OPS:
        total_n, ok, failed, absent = v[f"op:{op}"]
        pairs += [(f"{op}_req", total_n), (f"{op}_success", ok), (f"{op}_fail", failed)]
        if source.startswith("keys:"):
            pairs.append((f"{op}_not_found", absent))
    return " ".join(f"{k}={n}" for k, n in pairs)


# ---- POST bodies --------------------------------------------------------------------------------------

def chunk_hashes(body: bytes | None) -> list[str] | dict[str, Any]:
    """The ``chunk_hashes`` of a ``/memory/evict`` or ``/memory/prefetch`` body, or the error answer."""
    try:
        doc = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        return error("Invalid JSON body")
    if "chunk_hashes" not in doc:
        return error("Missing 'chunk_hashes' in request body")
    hashes = doc["chunk_hashes"]
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        return error("'chunk_hashes' must be an array of strings")
    try:
        validate.batch(hashes)
    except InvalidParameter as e:
        return error(f"chunk_hashes: {e}")
    return hashes
