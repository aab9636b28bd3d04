"""HTTP admin server of the MetaService, at ``metrics_url``.

Every route but /health, /livez and /ready needs ``Authorization: Bearer <token>`` with the pool's admin token
(``auth.admin_token``) when authentication is on. At most ``http_guard.MAX_CONNECTIONS`` connections are served
at once, each with a socket timeout (over HTTPS, the TLS handshake runs in the connection's thread
within ``TLS_HANDSHAKE_TIMEOUT_S``, never in the accept loop); scans of the whole table copy it under the lock and do the work
outside it, so a client polling /get_all_keys does not stall the control plane.

A browser may instead send the token as the password of HTTP Basic authentication (any user name):
/status answers 401 with ``WWW-Authenticate: Basic`` so that the browser asks for it. Basic opens the
GET routes only: every POST (a change) needs the Bearer header, which another site's page cannot make
the browser send, so a form it submits is refused (CSRF).

GET / (redirects to /status), /status (HTML), /api/v1/stats (the stats snapshot as JSON),
/keys?prefix=P, POST /remove_prefix?prefix=P, POST /drain/<segment_id>[?timeout_ms=], GET /drain/<segment_id>,
/drains, /role, /leader (HA), /kv_events/status, POST /memory/evict[?keys=a,b], POST /memory/prefetch?keys=a,b,
GET /health, /livez and /ready (without the token; /ready answers 503 until the pool can take puts), /metrics (Prometheus), /metrics/summary, /query_key?key=, /batch_query_keys?keys=a,b,
/get_all_keys, /get_all_segments, /query_segment?segment=, /api/v1/capacity/usage,
/api/v1/segments/status. Errors are HTTP 200 with ``{"success": false, "error_message": ...}``,
as memcache_hybrid answers.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

import msgspec

from .. import protocol as p
from ..auth import admin_authorized, admin_token
from ..config import parse_url
from ..errors import InvalidParameter, cannot_listen
from ..http_guard import GuardedHTTPServer
from . import disk, metrics, stats, status_page, validate

if TYPE_CHECKING:
    from .service import MetaServiceCore

logger = logging.getLogger(__name__)


SOCKET_TIMEOUT_S = 10.0


class AdminServer:
    def __init__(self, core: MetaServiceCore, url: str, secret: bytes | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        host, port = parse_url(url, "metrics_url", ("http", "https"))
        self.core = core
        token = admin_token(secret) if secret is not None else None
        handler = type("Handler", (_Handler,), {"core": core, "token": token})
        try:
            self.httpd = GuardedHTTPServer((host, port), handler, tls)
        except OSError as e:
            raise cannot_listen("metrics_url", host, port, e) from e
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="meta-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _all_keys_body(core: MetaServiceCore, prefix: str = "") -> bytes:
    """``{"success", "count", "keys"}`` of every committed key (starting with ``prefix``), in no
    particular order.

    Only the copy of the table's keys holds the lock (one C-level copy, no tuples: it also holds the
    GIL throughout); each key's state is read after it, a dict read being atomic. No sort and
    msgspec's encoder, so the work after it is short too (the HTTP thread shares the GIL with the
    control plane's)."""
    with core.lock:
        names = list(core.table.objects)
    objs = core.table.objects
    keys = [k for k in names if k.startswith(prefix) and _committed(objs.get(k))]
    return msgspec.json.encode({"success": True, "count": len(keys), "keys": keys})


def _committed(obj: Any) -> bool:
    return obj is not None and obj.committed


class _Handler(BaseHTTPRequestHandler):
    core: MetaServiceCore
    token: str | None
    timeout = SOCKET_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("http: " + format, *args)  # noqa: G003

    def parse_request(self) -> bool:
        ok = super().parse_request()   # reads the headers, under the guard's deadline
        self.server.guard.done()   # type: ignore[attr-defined]  # the headers are in: no deadline any more
        return ok

    def _authorized(self, basic: bool = True) -> bool:
        return admin_authorized(self.headers.get("Authorization", ""), self.token, basic)

    def _refuse(self, path: str, change: bool = False) -> None:
        why = "a change needs the header (HTTP Basic, a browser's login, reads pages only)" if change else \
            "authentication required"
        body = json.dumps({"success": False, "error_message": f"{why}: "
                           "Authorization: Bearer <admin token of the pool secret>"}).encode()
        extra = {"WWW-Authenticate": 'Basic realm="memcache admin token"'} if path == "/status" else {}
        self._send(401, body, "application/json", extra)

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not self._authorized(basic=False):   # no browser login for a change: CSRF (auth.py)
            return self._refuse(url.path, change=True)
        if url.path.startswith("/drain/"):
            with self.core.lock:
                return self._json(_start_drain(self.core, url.path.removeprefix("/drain/"), q.get("timeout_ms", "0")))
        if url.path == "/remove_prefix":
            prefix = q.get("prefix", "")
            if not prefix:
                return self._json(_error("prefix: expected a non-empty key prefix"))
            with self.core.lock:   # the control plane's own RemovePrefix, as a store's remove_by_prefix
                reply = self.core.handle(p.RemovePrefix(prefix))
            if not isinstance(reply, p.Codes):
                return self._json(_error(getattr(reply, "message", "remove_prefix failed")))
            return self._json({"success": True, "removed": reply.codes[0]})
        if url.path in ("/memory/evict", "/memory/prefetch"):
            keys = [k for k in q.get("keys", "").split(",") if k]
            with self.core.lock:
                return self._json(_memory(self.core, url.path, keys))
        self._send(404, json.dumps({"success": False, "error_message": f"no route POST {url.path}"}).encode(),
                   "application/json")

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        core = self.core
        if url.path == "/":
            return self._send(302, b"", "text/plain", {"Location": "/status"})
        if url.path == "/livez":   # liveness, as memcache_hybrid answers it: the process serves HTTP
            return self._send(200, b"ok", "text/plain")
        if url.path == "/ready":   # readiness of the pool, open: 200 once it can take puts, else 503
            ready = service_ready(core.stats())
            return self._send(200 if ready else 503, json.dumps({"success": ready, "service_ready": ready}).encode(),
                              "application/json")
        if url.path != "/health" and not self._authorized():
            return self._refuse(url.path)
        if url.path == "/get_all_keys":
            with core.lock:
                core.http_calls["get_all_keys"] += 1
            return self._send(200, _all_keys_body(core), "application/json")
        if url.path == "/keys":
            return self._send(200, _all_keys_body(core, q.get("prefix", "")), "application/json")
        if url.path in ("/metrics", "/status", "/api/v1/stats"):
            return self._view(url.path, core.stats())
        if url.path in SNAPSHOT_ROUTES:
            result = _from_snapshot(url.path, q, core.stats())
        else:
            with core.lock:
                result = self._route(url.path, q)
        if result is None:
            return self._send(404, json.dumps({"success": False, "error_message": f"no route {url.path}"})
                              .encode(), "application/json")
        self._json(result)

    def _route(self, path: str, q: dict[str, str]) -> dict[str, Any] | None:
        core, now = self.core, time.monotonic()
        match path:
            case "/role" | "/ha_status":
                if core.ha is None:
                    return {"success": True, "role": "leader", "ha_enable": False, "term": 0}
                return {"success": True, "ha_enable": True, **core.ha.status()}
            case "/leader":
                if core.ha is None:
                    cfg = core.config
                    return {"success": True, "ha_enable": False, "leader": {
                        "control": cfg.meta_service_url, "config_store": cfg.config_store_url,
                        "admin": cfg.metrics_url, "term": 0}}
                return {"success": True, "ha_enable": True, "leader": core.ha.leader}
            case "/query_key":
                return self._keys([q.get("key", "")], now)
            case "/batch_query_keys":
                return self._keys([k for k in q.get("keys", "").split(",") if k], now)
            case "/drains":
                return {"success": True, "drains": core.drains.all(now)}
            case "/kv_events/status":
                return core.publisher.status() if core.publisher is not None else KV_EVENTS_OFF

        if path.startswith("/drain/"):
            drained = _segment_id(path.removeprefix("/drain/"))
            found = core.drains.find(drained, now) if drained is not None else None
            return {"success": True, **found} if found else _error(f"no drain of segment {path[7:]!r}")
        return None

    def _keys(self, keys: list[str], now: float) -> dict[str, Any]:
        out = []
        for k in keys:
            o = self.core.table.objects.get(k)
            if o is None or not o.committed:
                out.append({"key": k, "exists": False})
            else:
                out.append({"key": k, "exists": True, "size": o.size, "generation": o.generation,
                            "leased": o.lease_until > now, "replicas_wanted": o.replicas,
                            "locations": [{"segment": loc.segment_id, "offset": loc.offset} for loc in o.locations],
                            "disk": o.disk[0] if o.disk is not None else None})
        if len(out) == 1:
            return {"success": out[0]["exists"], **out[0],
                    **({} if out[0]["exists"] else {"error_message": "key not found"})}
        return {"success": True, "keys": out}

    def _view(self, path: str, snap: Any) -> None:
        """Views rendered from the stats snapshot, outside the lock."""
        if path == "/metrics":
            return self._send(200, metrics.render(snap), metrics.CONTENT_TYPE)
        if path == "/status":
            return self._send(200, status_page.render(snap).encode(), "text/html; charset=utf-8")
        return self._send(200, msgspec.json.encode(snap), "application/json")

    def _json(self, result: dict[str, Any]) -> None:
        self._send(200, json.dumps(result).encode(), "application/json")

    def _send(self, status: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


SNAPSHOT_ROUTES = ("/health", "/get_all_segments", "/api/v1/segments/status", "/query_segment",
                   "/api/v1/capacity/usage", "/api/v1/capacity/segment_remaining", "/metrics/summary")


def _from_snapshot(path: str, q: dict[str, str], snap: stats.Snapshot) -> dict[str, Any] | None:
    segs = {g.segment_id: _segment(g) for g in snap.segments}
    match path:
        case "/health":
            return {"success": True, "status": "ok", "epoch": snap.epoch, "uptime_s": snap.uptime_s,
                    "members": len(snap.members), "service_ready": service_ready(snap)}
        case "/get_all_segments" | "/api/v1/segments/status":
            return {"success": True, "segments": list(segs.values())}
        case "/query_segment":
            try:
                sid = int(q.get("segment", ""))
            except ValueError:
                return _error("segment: expected an integer id")
            return {"success": True, **segs[sid]} if sid in segs else _error(f"segment {sid} not found")
        case "/api/v1/capacity/usage" | "/api/v1/capacity/segment_remaining":
            total, used = snap.capacity_bytes, snap.used_bytes
            return {"success": True, "total_bytes": total, "used_bytes": used,
                    "free_bytes": total - used, "usage_percent": round(100.0 * used / total, 3) if total else 0.0,
                    "segments": list(segs.values())}
        case "/metrics/summary":
            return {"success": True, **snap.counters}
    return None


def service_ready(snap: stats.Snapshot) -> bool:
    """The pool can take puts: this MetaService serves (not an HA standby) and at least one segment
    joined that takes new objects (not draining, past a re-join's grace; a full one evicts)."""
    return snap.role != "standby" and any(g.capacity_bytes > 0 and g.accepts_new_objects_in_s == 0.0
                                          for g in snap.segments)


def _segment(g: stats.SegmentStats) -> dict[str, Any]:
    return {"segment_id": g.segment_id, "host_id": g.host_id, "tag": g.tag, "data_addr": g.data_addr,
            "metrics_addr": g.metrics_addr, "pid": g.pid, "capacity_bytes": g.capacity_bytes, "used_bytes": g.used_bytes, "objects": g.objects,
            "largest_free_bytes": g.largest_free_bytes, "accepts_new_objects": g.accepts_new_objects_in_s == 0.0,
            "accepts_new_objects_in_s": g.accepts_new_objects_in_s, "draining": g.draining}


def _segment_id(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _start_drain(core: MetaServiceCore, sid_text: str, timeout_text: str) -> dict[str, Any]:
    sid = _segment_id(sid_text)
    if sid is None:
        return _error(f"segment id: expected an integer, got {sid_text!r}")
    try:
        timeout_ms = int(timeout_text)
    except ValueError:
        timeout_ms = -1
    if not 0 <= timeout_ms <= 86_400_000:
        return _error(f"timeout_ms: expected an integer in [0, 86400000], got {timeout_text!r}")
    if sid not in core.table.segments:
        return _error(f"segment {sid} not found")
    now = time.monotonic()
    drain = core.drains.start(sid, now, timeout_ms / 1000.0)
    logger.info("admin: draining segment %d (timeout %.1fs)", sid, drain.deadline - drain.started)
    return {"success": True, **drain.snapshot(now)}


def _error(msg: str) -> dict[str, Any]:
    return {"success": False, "error_message": msg, "timestamp": time.time()}


KV_EVENTS_OFF: dict[str, Any] = {
    "enabled": False, "publisher_active": False, "queue_size": 0, "queue_capacity": 0, "published_events": 0,
    "published_batches": 0, "published_by_type": {"stored": 0, "removed": 0, "cleared": 0},
    "published_by_medium": {"hbm": 0, "dram": 0, "ssd": 0, "unknown": 0}, "dropped_events": 0,
    "dropped_stored_events": 0, "last_sequence": 0}


def _memory(core: MetaServiceCore, path: str, keys: list[str]) -> dict[str, Any]:
    """``/memory/evict`` and ``/memory/prefetch`` (memcache_hybrid's admin routes; the caller holds the lock).

    evict with ``keys``: the tier call ``evict`` (keep them on their disk tier only; a code per key);
    evict without: an LRU pass now over every segment above its high-water mark (as housekeeping
    runs it). prefetch: ``disk.prefetch`` (disk-only objects are promoted by their provider)."""
    now = time.monotonic()
    try:
        validate.batch(keys)
    except InvalidParameter as e:
        return _error(f"keys: {e}")
    if path == "/memory/evict":
        if not keys:
            return {"success": True, "evicted": core.table.evict_all(now)}
        codes = disk.demote(core.table, keys, now)
        return {"success": True, "results": [{"key": k, "code": c, "result": stats.code_name(c)}
                                             for k, c in zip(keys, codes, strict=True)]}
    if not keys:
        return _error("keys: expected a comma-separated list of keys")
    return {"success": True, "results": [{"key": k, "result": r}
                                         for k, r in zip(keys, disk.prefetch(core.table, keys), strict=True)]}
