"""HTTP admin server of the MetaService, at ``metrics_url``.

Every route but /health, /livez and /ready needs ``Authorization: Bearer <token>`` with the pool's admin token
(``auth.admin_token``) when authentication is on. At most ``http_guard.MAX_CONNECTIONS`` connections are served
at once, each with a socket timeout (over HTTPS, the TLS handshake runs in the connection's thread
within ``TLS_HANDSHAKE_TIMEOUT_S``, never in the accept loop); scans of the whole table copy it under the lock and do the work
outside it, so a client polling /get_all_keys does not stall the control plane.

A browser may instead send the token as the password of HTTP Basic authentication (any user name):
/status answers 401 with ``WWW-Authenticate: Basic`` so that the browser asks for it. Basic opens the
GET routes only: every POST, PUT and DELETE (a change) needs the Bearer header, which another site's
page cannot make the browser send, so a form it submits is refused (CSRF).

memcache_hybrid's routes answer in its shapes (``ascend_http.py``): GET /health, /livez, /role and
/ha_status (text), /leader, /kv_events/status, /metrics (Prometheus), /metrics/summary (text),
/query_key?key=, /batch_query_keys?keys=a,b, /get_all_keys, /get_all_segments, /query_segment?segment=,
/api/v1/segments/status?segment=, /api/v1/capacity/usage, /api/v1/capacity/segment_remaining,
GET/PUT/DELETE /metadata?key=, POST /memory/evict and /memory/prefetch (a JSON body
``{"chunk_hashes": [...]}``), POST /api/v1/drain_jobs?segment=, GET /api/v1/drain_jobs/query?job_id=.
Ours: GET /ready (open: 200 once the pool can take puts, else 503), GET / (redirects to /status), /status (HTML), /api/v1/stats (the stats snapshot as JSON),
/api/v1/segments (every segment as JSON), /keys?prefix=P, POST /remove_prefix?prefix=P,
POST /drain/<segment_id>[?timeout_ms=], GET /drain/<segment_id>, /drains. Errors are HTTP 200 with
``{"success": false, "error_message": ..., "timestamp": <seconds>}``, as memcache_hybrid answers; an
unknown path is 404 with an empty body, a GET of a POST-only route 405.
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
from ..errors import cannot_listen
from ..http_guard import GuardedHTTPServer
from . import ascend_http, disk, metrics, stats, status_page
from .metadata import error as _error

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

    def _body(self) -> bytes | None:
        """The request's body (``ascend_http.MAX_BODY_BYTES`` at most: None for a larger or a missing one)."""
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if not 0 < n <= ascend_http.MAX_BODY_BYTES:
            return None
        return self.rfile.read(n)

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not self._authorized(basic=False):   # no browser login for a change: CSRF (auth.py)
            return self._refuse(url.path, change=True)
        if url.path.startswith("/drain/"):
            with self.core.lock:
                return self._json(_start_drain(self.core, url.path.removeprefix("/drain/"), q.get("timeout_ms", "0")))
        if url.path == "/api/v1/drain_jobs":
            with self.core.lock:
                return self._json(_drain_job(self.core, q))
        if url.path == "/api/v1/drain_jobs/cancel":
            return self._json(_error("cancel: a drain runs until its objects are moved or its timeout_ms ends; "
                                     "start it with a shorter timeout_ms"))
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
            keys = ascend_http.chunk_hashes(self._body())
            if isinstance(keys, dict):
                return self._json(keys)
            with self.core.lock:
                return self._json(_memory(self.core, url.path, keys))
        if url.path == "/metadata":
            return self._metadata("PUT", q)
        self._send(404, b"", "text/plain")

    def do_PUT(self) -> None:  # noqa: N802 - stdlib name
        self._change("PUT")

    def do_DELETE(self) -> None:  # noqa: N802 - stdlib name
        self._change("DELETE")

    def _change(self, method: str) -> None:
        url = urlparse(self.path)
        if not self._authorized(basic=False):
            return self._refuse(url.path, change=True)
        if url.path != "/metadata":
            return self._send(405 if url.path in POST_ONLY else 404, b"", "text/plain")
        self._metadata(method, {k: v[-1] for k, v in parse_qs(url.query).items()})

    def _metadata(self, method: str, q: dict[str, str]) -> None:
        body = self._body() if method == "PUT" else None
        with self.core.lock:
            result = self.core.metadata.handle(method, q, body)
        self._json(result)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        core = self.core
        if url.path == "/":
            return self._send(302, b"", "text/plain", {"Location": "/status"})
        if url.path == "/livez":   # liveness, as memcache_hybrid answers it: the process serves HTTP
            return self._send(200, b"ok", "text/plain")
        if url.path == "/ready":   # readiness of the pool, open: 200 once it can take puts, else 503
            ready = ascend_http.pool_ready(core.stats())
            return self._send(200 if ready else 503, json.dumps({"success": ready, "pool_ready": ready}).encode(),
                              "application/json")
        if url.path != "/health" and not self._authorized():
            return self._refuse(url.path)
        if url.path in POST_ONLY:
            return self._send(405, b"", "text/plain")
        if url.path == "/get_all_keys":
            with core.lock:
                core.http_calls["get_all_keys"] += 1
            return self._send(200, _all_keys_body(core), "application/json")
        if url.path == "/keys":
            return self._send(200, _all_keys_body(core, q.get("prefix", "")), "application/json")
        if url.path in ("/metrics", "/status", "/api/v1/stats"):
            return self._view(url.path, core.stats())
        if url.path in ("/role", "/ha_status"):
            return self._send(200, ascend_http.role_word(core).encode(), "text/plain")
        if url.path == "/metrics/summary":
            return self._send(200, ascend_http.summary_line(core.stats()).encode(), "text/plain")
        if url.path == "/metadata":
            return self._metadata("GET", q)
        if url.path in SNAPSHOT_ROUTES:
            result = _from_snapshot(core, url.path, q, core.stats())
        else:
            with core.lock:
                result = self._route(url.path, q)
        if result is None:
            return self._send(404, b"", "text/plain")
        self._json(result)

    def _route(self, path: str, q: dict[str, str]) -> dict[str, Any] | None:
        core, now = self.core, time.monotonic()
        match path:
            case "/leader":
                return ascend_http.leader(core)
            case "/query_key":
                return ascend_http.query_key(core, q, now)
            case "/batch_query_keys":
                return ascend_http.batch_query_keys(core, q, now)
            case "/drains":
                return {"success": True, "drains": core.drains.all(now)}
            case "/api/v1/drain_jobs/query":
                if "job_id" not in q:
                    return ascend_http.missing("job_id")
                job = _segment_id(q["job_id"])
                found = core.drains.find(job, now) if job is not None else None
                if found is None:
                    return _error("Drain job not found")
                return {"success": True, "job_id": str(found["segment_id"]), "status": found["state"], **found}
            case "/kv_events/status":
                status = core.publisher.status() if core.publisher is not None else KV_EVENTS_OFF
                return {**KV_EVENTS_ASCEND, **status}

        if path.startswith("/drain/"):
            drained = _segment_id(path.removeprefix("/drain/"))
            found = core.drains.find(drained, now) if drained is not None else None
            return {"success": True, **found} if found else _error(f"no drain of segment {path[7:]!r}")
        return None

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


SNAPSHOT_ROUTES = ("/health", "/get_all_segments", "/api/v1/segments", "/api/v1/segments/status", "/query_segment",
                   "/api/v1/capacity/usage", "/api/v1/capacity/segment_remaining")
POST_ONLY = ("/memory/evict", "/memory/prefetch", "/api/v1/drain_jobs", "/api/v1/drain_jobs/cancel", "/remove_prefix")


def _from_snapshot(core: MetaServiceCore, path: str, q: dict[str, str], snap: stats.Snapshot,
                   ) -> dict[str, Any] | None:
    match path:
        case "/health":
            return ascend_http.health(core, snap)
        case "/get_all_segments" | "/api/v1/segments":
            return {"success": True, "segments": [ascend_http.segment(g) for g in snap.segments]}
        case "/query_segment" | "/api/v1/segments/status":
            return ascend_http.find_segment(snap, q)
        case "/api/v1/capacity/usage":
            return ascend_http.capacity_usage(snap)
        case "/api/v1/capacity/segment_remaining":
            return ascend_http.segment_remaining(snap)
    return None


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


def _drain_job(core: MetaServiceCore, q: dict[str, str]) -> dict[str, Any]:
    """``POST /api/v1/drain_jobs?segment=<id>[&timeout_ms=]``: a drain (``/drain/<id>``) whose job id is
    the segment's id."""
    if "segment" not in q:
        return ascend_http.missing("segment")
    got = _start_drain(core, q["segment"], q.get("timeout_ms", "0"))
    if got.get("success"):
        got = {"job_id": str(got["segment_id"]), "status": got["state"], **got}
    return got


KV_EVENTS_ASCEND: dict[str, Any] = {"dropped_high_priority_events": 0, "skipped_unparsed_keys": 0}
KV_EVENTS_OFF: dict[str, Any] = {
    "enabled": False, "publisher_active": False, "queue_size": 0, "queue_capacity": 0, "published_events": 0,
    "published_batches": 0, "published_by_type": {"stored": 0, "removed": 0, "cleared": 0},
    "published_by_medium": {"hbm": 0, "dram": 0, "ssd": 0, "unknown": 0}, "dropped_events": 0,
    "dropped_stored_events": 0, "last_sequence": 0}


def _memory(core: MetaServiceCore, path: str, keys: list[str]) -> dict[str, Any]:
    """``/memory/evict`` and ``/memory/prefetch`` (memcache_hybrid's admin routes; the caller holds the lock),
    their keys the body's ``chunk_hashes``.

    evict with keys: the tier call ``evict`` (keep them on their disk tier only; ``num_evicted`` those
    that now are); evict with none: an LRU pass now over every segment above its high-water mark (as
    housekeeping runs it). prefetch: ``disk.prefetch`` (disk-only objects are promoted by their provider)."""
    now = time.monotonic()
    if path == "/memory/evict":
        if not keys:
            return {"num_evicted": core.table.evict_all(now), "status": "success", "success": True}
        codes = disk.demote(core.table, keys, now)
        return {"num_evicted": sum(c == 0 for c in codes), "status": "success", "success": True,
                "results": [{"key": k, "code": c, "result": stats.code_name(c)}
                            for k, c in zip(keys, codes, strict=True)]}
    return {"lookup_id": "", "num_chunks": len(keys), "status": "prefetch_started", "success": True,
            "results": [{"key": k, "result": r} for k, r in zip(keys, disk.prefetch(core.table, keys), strict=True)]}
