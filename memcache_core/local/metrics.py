"""A LocalService's own Prometheus metrics, and the opt-in HTTP port that serves them.

Each LocalService has its own registry (several may live in one process, and the engine's own
``prometheus_client`` registry is left alone). With ``metrics_port`` set, ``/metrics`` is served on
``metrics_host`` (127.0.0.1 by default) and, like the MetaService's admin routes, needs the pool's
admin token (bearer, or as an HTTP Basic password) when authentication is on; ``/health`` and
``/ready`` are open and say only whether it joined the pool (``joined``, ``service_ready``):
``/health`` answers 200 while the process runs (liveness: a provider waiting for its MetaService is
alive), ``/ready`` 503 until it joined (readiness).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..auth import admin_authorized
from ..errors import cannot_listen
from ..http_guard import GuardedHTTPServer
from ..records import SegmentBytes

logger = logging.getLogger(__name__)

TRANSFER_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PROCESS = ProcessCollector(registry=None)   # process_cpu_seconds_total, process_resident_memory_bytes, ...


class LocalMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PROCESS)   # the process it lives in (an engine's, or a provider's own)
        labels = ["path", "direction"]
        self.bytes = Counter("memcache_local_transfer_bytes", "Payload bytes moved, per transfer path "
                             "(host_shm, host_tcp, nixl) and direction (read, write).", labels, registry=self.registry)
        self.seconds = Histogram("memcache_local_transfer_seconds", "Time of one transfer job (a batch's "
                                 "copies to or from one segment group), per path and direction.", labels,
                                 buckets=TRANSFER_BUCKETS, registry=self.registry)
        self.failures = Counter("memcache_local_transfer_failures", "Copies that failed, per path and direction.",
                                labels, registry=self.registry)
        self.served = Counter("memcache_local_served_bytes", "Payload bytes peers moved to or from this "
                              "LocalService's segment through its data server (the serving side of host_tcp: a "
                              "provider's traffic), per path and direction (read: peers read from it).", labels,
                              registry=self.registry)
        # the labelled children, looked up once each (``labels()`` takes a lock and hashes its labels on
        # every call); created on first use as before, so the exported series are the same
        self._moves: dict[tuple[str, bool], tuple[Any, Any]] = {}       # (path, read?) -> (bytes, seconds)
        self._serves: dict[tuple[str, bool], Any] = {}                  # (path, read?) -> served
        self._early: dict[str, Any] = {}                                # outcome -> early_reads
        for path in ("host_shm", "host_tcp"):   # present from the start: an idle provider shows 0
            for d in ("read", "write"):
                self._serves[path, d == "read"] = self.served.labels(path, d)
        self._moved: dict[int, list[int]] = {}   # segment -> [read, written] through shm, for the heartbeat
        self._moved_lock = threading.Lock()
        self.meta_restarts = Counter("memcache_local_meta_restarts", "MetaService restarts this LocalService "
                                     "saw (a new epoch) and re-joined after.", registry=self.registry)
        self.rejoins = Counter("memcache_local_rejoins", "Re-joins (after a MetaService restart or being "
                               "declared dead).", registry=self.registry)
        self.early_reads = Counter("memcache_local_early_reads", "Objects copied from a remembered place "
                                   "while their Lookup was on the way (location_hints), by outcome: used "
                                   "(the reply named that object there), discarded (read again, or a miss).",
                                   ["outcome"], registry=self.registry)
        self.joined = False   # in the pool (the first join done): /health, /ready and memcache_local_joined
        Gauge("memcache_local_joined", "1 once this LocalService joined the pool (it stays a member across "
              "MetaService restarts, re-joining), 0 while it waits for the MetaService to answer.",
              registry=self.registry).set_function(lambda: float(self.joined))
        self.held: Callable[[], bool] = lambda: False   # its segment is held (local/hold.py): the owner sets it
        Gauge("memcache_local_segment_held", "1 while this provider's segment is held: writes granted before its "
              "last re-join may still be in flight (a writer frozen mid-copy, or a process holding the fence "
              "page's lock), so its objects are served but nothing new is placed in it (docs/operations.md).",
              registry=self.registry).set_function(lambda: float(self.held()))
        self.join_attempts = Counter("memcache_local_join_attempts", "Attempts at the first join: the one at "
                                     "start and each retry while waiting for the MetaService.", registry=self.registry)
        self.join_failures = Counter("memcache_local_join_failures", "Attempts at the first join that failed.",
                                     registry=self.registry)

    def transfer(self, path: str, reading: bool, nbytes: int, seconds: float, failed: int) -> None:
        children = self._moves.get((path, reading))
        if children is None:
            d = "read" if reading else "write"
            children = self._moves[path, reading] = (self.bytes.labels(path, d), self.seconds.labels(path, d))
        children[0].inc(nbytes)
        children[1].observe(seconds)
        if failed:
            self.failures.labels(path, "read" if reading else "write").inc(failed)

    def early_read(self, used: int, discarded: int) -> None:
        """Objects of a Lookup's early copies that were used, and discarded (``local/reads.py``)."""
        early = self._early
        if not early:
            early.update(used=self.early_reads.labels("used"), discarded=self.early_reads.labels("discarded"))
        early["used"].inc(used)
        early["discarded"].inc(discarded)

    def moved_shm(self, reading: bool, per_segment: list[tuple[int, int]]) -> None:
        """Bytes this LocalService copied out of / into segments through shared memory."""
        with self._moved_lock:
            for sid, n in per_segment:
                self._moved.setdefault(sid, [0, 0])[0 if reading else 1] += n

    def take_moved(self) -> list[SegmentBytes]:
        """The shm byte counts since the last call, as the heartbeat carries them."""
        with self._moved_lock:
            moved, self._moved = self._moved, {}
        return [SegmentBytes(sid, r, w) for sid, (r, w) in moved.items()]

    def serve(self, path: str, reading: bool, nbytes: int) -> None:
        child = self._serves.get((path, reading))
        if child is None:
            child = self._serves[path, reading] = self.served.labels(path, "read" if reading else "write")
        child.inc(nbytes)

    def watch_disk(self, counters: Callable[[], dict[str, int]]) -> None:
        """Export this provider's disk tier (``local/tier.py`` ``DiskTier.counters``) at each scrape."""
        self.registry.register(_DiskCollector(counters))

    def render(self) -> bytes:
        """The registry's text without ``*_created`` series: the library adds one per counter and
        histogram series, a timestamp nobody graphs that doubles the series count. They are left out
        of what is collected, not cut from the text: the text format prints them as gauge families of
        their own, whose ``# HELP``/``# TYPE`` lines would stay behind without a sample."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated(Collector):
    """A registry's metrics without their ``*_created`` samples (a copy of each family: the library's
    own families are not changed)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for m in self.registry.collect():
            out = Metric(m.name, m.documentation, m.type, m.unit)
            out.samples = [s for s in m.samples if s.name != m.name + "_created"]
            yield out


class _DiskCollector(Collector):
    GAUGES = (("objects", "Records on this provider's disk tier."),
              ("used_bytes", "Bytes of records on this provider's disk tier."),
              ("queued_bytes", "Bytes of copies waiting for the disk writer."))

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self.counters()
        for name, help_ in self.GAUGES:
            yield GaugeMetricFamily(f"memcache_local_disk_{name}", help_, value=c.get(name, 0))
        ev = CounterMetricFamily("memcache_local_disk_events", "This provider's disk tier: writes, write_bytes, "
                                 "write_errors, writes_skipped, writes_stale, reads, read_bytes, read_errors, "
                                 "integrity_failures, lru_drops, promotions (docs/operations.md).", labels=["event"])
        for k, v in sorted(c.items()):
            if k not in ("objects", "used_bytes", "queued_bytes"):
                ev.add_metric([k], v)
        yield ev


MAX_CONNECTIONS = 64      # connections served at once by a LocalService's metrics port


class MetricsServer:
    def __init__(self, metrics: LocalMetrics, host: str, port: int, token: str | None) -> None:
        handler = type("Handler", (_Handler,), {"metrics": metrics, "token": token})
        try:
            # a listen backlog of 1,024, at most MAX_CONNECTIONS threads, headers due within 10 s, 64 of one
            # address at once: connections that never send a token cost a bounded number of threads
            self.httpd = GuardedHTTPServer((host, port), handler, max_connections=MAX_CONNECTIONS)
        except OSError as e:
            raise cannot_listen("metrics_port", host, port, e) from e
        self.httpd.daemon_threads = True
        self.addr = f"{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="local-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    metrics: LocalMetrics
    token: str | None
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("local metrics http: " + format, *args)  # noqa: G003

    def _authorized(self) -> bool:
        return admin_authorized(self.headers.get("Authorization", ""), self.token)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/ready"):   # open: the one thing they say is whether it joined the pool
            joined = self.metrics.joined
            body = json.dumps({"success": True, "status": "ok" if joined else "waiting for the MetaService",
                               "joined": joined, "service_ready": joined}).encode()
            return self._send(200 if joined or path == "/health" else 503, body, "application/json")
        if not self._authorized():
            return self._send(401, b'{"success": false, "error_message": "authentication required: '
                              b'Authorization: Bearer <admin token of the pool secret>"}', "application/json")
        if path == "/metrics":
            return self._send(200, self.metrics.render(), CONTENT_TYPE)
        self._send(404, b'{"success": false, "error_message": "no such route"}', "application/json")

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
