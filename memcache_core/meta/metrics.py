"""Prometheus text exposition for the MetaService, with no dependency beyond the standard library."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .service import MetaServiceCore

BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)


class Histogram:
    __slots__ = ("counts", "total", "count", "failures")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.count = 0
        self.failures = 0


class Metrics:
    """Handling latency and failures per request type (updated and read under the MetaService lock)."""

    def __init__(self) -> None:
        self.requests: dict[str, Histogram] = {}

    def observe(self, name: str, seconds: float, failed: bool) -> None:
        h = self.requests.get(name)
        if h is None:
            h = self.requests[name] = Histogram()
        h.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        h.total += seconds
        h.count += 1
        h.failures += failed

    def render(self, core: MetaServiceCore) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP memcache_{name} {help_}")
            out.append(f"# TYPE memcache_{name} {kind}")
            out.extend(f"memcache_{name}{labels} {value:g}" for labels, value in samples)

        t = core.table
        segs = sorted(t.segments.items())
        metric("segment_capacity_bytes", "gauge", "Bytes a segment contributes to the pool.",
               [(f'{{segment="{i}"}}', s.allocator.size) for i, s in segs])
        metric("segment_used_bytes", "gauge", "Bytes allocated in a segment.",
               [(f'{{segment="{i}"}}', s.allocator.used) for i, s in segs])
        metric("segment_objects", "gauge", "Committed objects in a segment.",
               [(f'{{segment="{i}"}}', len(s.lru)) for i, s in segs])
        metric("pool_capacity_bytes", "gauge", "Bytes of the whole pool.",
               [("", sum(s.allocator.size for _, s in segs))])
        metric("pool_used_bytes", "gauge", "Bytes allocated in the whole pool.",
               [("", sum(s.allocator.used for _, s in segs))])
        metric("objects", "gauge", "Committed objects.", [("", len(t.objects) - t.pending)])
        metric("objects_under_replicated", "gauge",
               "Committed objects holding fewer replicas than their put asked for (placed partially, or a "
               "replica's segment died or failed its checksum).", [("", t.under_replicated)])
        metric("pending_objects", "gauge", "Objects allocated and not yet committed.", [("", t.pending)])
        metric("members", "gauge", "LocalServices and clients joined.", [("", len(core.members))])
        leading = core.ha is None or core.ha.serving()
        metric("meta_is_leader", "gauge", "1 when this MetaService serves (the HA leader, or HA is off).",
               [("", 1 if leading else 0)])
        metric("meta_term", "gauge", "The HA leader term this MetaService serves under (0: standby, or HA off).",
               [("", core.ha.term if core.ha is not None and leading else 0)])
        c = t.counters
        for name, value, help_ in (
                ("puts_total", c.allocs, "Objects asked to be put (alloc)."),
                ("commits_total", c.commits, "Objects made visible."),
                ("gets_total", c.lookups, "Objects looked up for reading."),
                ("get_hits_total", c.hits, "Lookups that found the object."),
                ("exists_total", c.exists, "Existence probes."),
                ("removes_total", c.removes, "Objects removed."),
                ("evictions_total", c.evictions, "Objects evicted by LRU."),
                ("evicted_bytes_total", c.evicted_bytes, "Bytes evicted by LRU."),
                ("put_failures_total", c.alloc_failures, "Puts refused for lack of space."),
                ("pending_reclaimed_total", c.pending_reclaimed, "Uncommitted puts aborted."),
                ("integrity_failures_total", c.integrity_failures,
                 "Reads whose bytes failed the checksum (reported by readers; each object is dropped).")):
            metric(name, "counter", help_, [("", value)])
        core.drains.render_metrics(metric)
        reqs = sorted(self.requests.items())
        out.append("# HELP memcache_request_seconds Time the MetaService spent on a request.")
        out.append("# TYPE memcache_request_seconds histogram")
        for name, h in reqs:
            cum = 0
            for le, n in zip(BUCKETS + (float("inf"),), h.counts, strict=True):
                cum += n
                le_s = "+Inf" if le == float("inf") else f"{le:g}"
                out.append(f'memcache_request_seconds_bucket{{op="{name}",le="{le_s}"}} {cum}')
            out.append(f'memcache_request_seconds_sum{{op="{name}"}} {h.total:.9f}')
            out.append(f'memcache_request_seconds_count{{op="{name}"}} {h.count}')
        metric("request_failures_total", "counter", "Requests answered with an error.",
               [(f'{{op="{name}"}}', h.failures) for name, h in reqs])
        return "\n".join(out) + "\n"
