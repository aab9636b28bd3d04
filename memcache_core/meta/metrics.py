"""The MetaService's Prometheus metrics, exposed through ``prometheus_client``.

Every metric is declared here, in ``families``, from a ``stats.Snapshot`` (taken under the lock;
rendering happens outside it). Names are stable and listed in docs/operations.md. Request latency
is kept in ``Metrics`` (a few integer adds under the lock, cheaper than a client-library histogram
on the hottest path) and exported as a histogram family.
"""

from __future__ import annotations

import bisect
import collections
import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from . import ascend_metrics
from .stats import MAX_SEGMENT_SERIES, Snapshot

BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PROCESS = ProcessCollector(registry=None)   # process_cpu_seconds_total, process_resident_memory_bytes, ...

COUNTERS = (   # (metric name, Counters field, help)
    ("puts_total", "allocs", "Objects asked to be put (alloc)."),
    ("commits_total", "commits", "Objects made visible."),
    ("gets_total", "lookups", "Objects looked up for reading."),
    ("get_hits_total", "hits", "Lookups that found the object."),
    ("exists_total", "exists", "Existence probes."),
    ("removes_total", "removes", "Objects removed."),
    ("evictions_total", "evictions", "Objects evicted by LRU."),
    ("evicted_bytes_total", "evicted_bytes", "Bytes evicted by LRU."),
    ("put_failures_total", "alloc_failures", "Puts refused for lack of space."),
    ("pending_reclaimed_total", "pending_reclaimed", "Uncommitted puts aborted."),
    ("integrity_failures_total", "integrity_failures",
     "Reads whose bytes failed the checksum (reported by readers; each object is dropped)."),
    ("evictions_to_disk_total", "evictions_to_disk",
     "Evictions that kept the object on its provider's disk tier (its DRAM copies were freed)."),
    ("disk_drops_total", "disk_drops",
     "Disk-only objects gone for good (their tier dropped the record: full, or it failed its checksum)."),
    ("superseded_total", "superseded",
     "Objects dropped on recovery because a re-joining member reported a newer generation of the key."),
    ("disk_hits_total", "disk_hits", "Lookups that found the object on a disk tier only."),
    ("promotions_total", "promotions", "Disk-only objects brought back into DRAM (repeated hits, prefetch)."),
    ("uncounted_writes_total", "uncounted_writes",
     "Commits counted against no member's quota (member_max_objects): 4,095 other writers kept objects."),
)
DISK_EVENTS = ("writes", "write_bytes", "write_errors", "writes_skipped", "writes_stale", "reads", "read_bytes",
               "read_errors", "integrity_failures", "lru_drops", "promotions")
MEMBER_EVENTS = ("joins", "leaves", "deaths", "rejoins")


class Histogram:
    __slots__ = ("counts", "total", "count", "failures")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.count = 0
        self.failures = 0


class Metrics:
    """Handling latency and failures per request type (updated under the MetaService lock)."""

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


def _gauge(name: str, help_: str, value: float | None = None, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    if labels:
        return GaugeMetricFamily(f"memcache_{name}", help_, labels=list(labels))
    return GaugeMetricFamily(f"memcache_{name}", help_, value=value)


def segment_names(s: Snapshot) -> dict[int, str]:
    """The ``segment`` label of each segment: its LocalService's ``tag`` where that names it alone on
    its host (a stable provider name: its series survive restarts, which draw new segment ids), else
    the segment id (two segments never share a series)."""
    seen = collections.Counter((g.host_id, g.tag) for g in s.segments)
    return {g.segment_id: g.tag if g.tag and seen[g.host_id, g.tag] == 1 and not g.tag.isdigit() else str(g.segment_id)
            for g in s.segments}


def _segments(s: Snapshot) -> Iterator[Metric]:
    labels = ("segment", "host", "tier")
    names = segment_names(s)
    cap = _gauge("segment_capacity_bytes", "Bytes a segment contributes to the pool.", labels=labels)
    used = _gauge("segment_used_bytes", "Bytes allocated in a segment.", labels=labels)
    free = _gauge("segment_free_bytes", "Bytes not allocated in a segment.", labels=labels)
    objs = _gauge("segment_objects", "Committed objects in a segment.", labels=labels)
    arena = _gauge("segment_arena_reserved_bytes", "Bytes of a segment's allocation arena that hold no object: "
                   "counted in segment_used_bytes, reserved for its holder's small puts.", labels=labels)
    served = CounterMetricFamily("memcache_segment_served_bytes", "Payload bytes members copied out of (read) "
                                 "and into (write) a segment through shared memory (host_shm), as their "
                                 "heartbeats report them.", labels=[*labels, "direction"])
    for g in s.listed_segments():
        lv = [names[g.segment_id], g.host_id, g.tier]
        served.add_metric([*lv, "read"], g.served_read_bytes)
        served.add_metric([*lv, "write"], g.served_written_bytes)
        cap.add_metric(lv, g.capacity_bytes)
        used.add_metric(lv, g.used_bytes)
        free.add_metric(lv, g.capacity_bytes - g.used_bytes)
        objs.add_metric(lv, g.objects)
        arena.add_metric(lv, g.arena_reserved_bytes)
    yield from (cap, used, free, objs, arena, served)
    yield _gauge("held_segments", "Segments whose owner re-joined while writes granted before still held its "
                 "fence (fence_wait_ms passed): their objects are served, no new object goes there.",
                 sum(g.held for g in s.segments))
    yield _gauge("fenced_bytes", "Bytes of grants reclaimed from writers that may be frozen, kept out of use "
                 "until their segment's owner rotated its write fence (counted in used bytes).",
                 sum(g.fenced_bytes for g in s.segments))
    yield CounterMetricFamily("memcache_fence_rotations_total", "Write fences rotated by their owner to void "
                              "reclaimed grants (the reclaimed ranges are free from then on).",
                              value=s.events.get("fence_rotations", 0))
    yield _gauge("segments_unlisted", f"Segments without series of their own (only the {MAX_SEGMENT_SERIES} "
                 "largest have them; the pool totals count all).",
                 len(s.segments) - min(len(s.segments), MAX_SEGMENT_SERIES))
    tiers: dict[str, list[int]] = {}
    for g in s.segments:
        t = tiers.setdefault(g.tier, [0, 0])
        t[0] += g.capacity_bytes
        t[1] += g.used_bytes
    for d in s.disk_tiers:
        t = tiers.setdefault("disk", [0, 0])
        t[0] += d.capacity_bytes
        t[1] += d.used_bytes
    tcap = _gauge("tier_capacity_bytes", "Bytes of the pool per tier (medium).", labels=("tier",))
    tused = _gauge("tier_used_bytes", "Bytes allocated per tier (medium).", labels=("tier",))
    for name, (c, u) in sorted(tiers.items()):
        tcap.add_metric([name], c)
        tused.add_metric([name], u)
    yield from (tcap, tused)


def _disk(s: Snapshot) -> Iterator[Metric]:
    labels = ("segment",)
    cap = _gauge("disk_capacity_bytes", "Bytes a provider's disk tier may hold (disk_size).", labels=labels)
    used = _gauge("disk_used_bytes", "Bytes of records on a provider's disk tier.", labels=labels)
    objs = _gauge("disk_objects", "Records on a provider's disk tier.", labels=labels)
    ev = CounterMetricFamily("memcache_disk_events_total", "A provider's disk tier: records written, bytes "
                             "written, write errors (disk full, I/O), writes skipped (queue full), writes "
                             "stale (the DRAM copy changed first), reads, bytes read, read errors, integrity "
                             "failures, records dropped to make room, promotions.", labels=["segment", "event"])
    names = segment_names(s)
    for d in s.listed_disk_tiers():
        lv = [names.get(d.segment_id, str(d.segment_id))]
        cap.add_metric(lv, d.capacity_bytes)
        used.add_metric(lv, d.used_bytes)
        objs.add_metric(lv, d.objects)
        for e in DISK_EVENTS:
            ev.add_metric([*lv, e], d.counters.get(e, 0))
    yield from (cap, used, objs, ev)


def _counters(s: Snapshot) -> Iterator[Metric]:
    for name, field, help_ in COUNTERS:
        yield CounterMetricFamily(f"memcache_{name}", help_, value=s.counters[field])
    out = CounterMetricFamily("memcache_op_outcomes_total", "Per-key outcomes of put (alloc), commit, get, "
                              "exist and remove, by result.", labels=["op", "outcome"])
    for op, by in sorted(s.outcomes.items()):
        for outcome, n in sorted(by.items()):
            out.add_metric([op, outcome], n)
    yield out
    ev = CounterMetricFamily("memcache_member_events_total", "Members that joined, left cleanly, were "
                             "declared dead, or re-joined.", labels=["event"])
    for e in MEMBER_EVENTS:
        ev.add_metric([e], s.events.get(e, 0))
    yield ev
    yield CounterMetricFamily("memcache_recoveries_total", "Segments that joined with objects to recover "
                              "(after a MetaService restart or a member's re-join).",
                              value=s.events.get("recoveries", 0))
    yield CounterMetricFamily("memcache_recovered_objects_total", "Objects recovered from re-joining segments.",
                              value=s.events.get("recovered_objects", 0))
    yield CounterMetricFamily("memcache_kv_events_published_total", "KV events sent (kv_events_enable).",
                              value=s.events.get("kv_events_published", 0))
    yield CounterMetricFamily("memcache_kv_events_dropped_total", "KV events dropped: queue or socket full.",
                              value=s.events.get("kv_events_dropped", 0))
    yield CounterMetricFamily("memcache_kv_events_replays_total", "KV-event replays sent whole "
                              "(kv_events_replay_endpoint).", value=s.events.get("kv_events_replays", 0))
    yield CounterMetricFamily("memcache_kv_events_replay_dropped_total", "KV-event replay requests dropped "
                              "(malformed, too soon or too many) and replays given up (peer gone or not reading).",
                              value=s.events.get("kv_events_replay_dropped", 0))


DRAIN_COUNTERS = (   # (metric name, Drains.stats() field, help)
    ("drain_moved_objects_total", "moved_objects", "Objects a drain moved to another segment."),
    ("drain_moved_bytes_total", "moved_bytes", "Payload bytes a drain moved."),
    ("drain_dropped_objects_total", "dropped_objects",
     "Objects a drain could not place (no room), or left behind when its segment left."),
    ("drain_dropped_bytes_total", "dropped_bytes", "Payload bytes of the dropped objects."),
    ("drain_failed_moves_total", "failed_moves", "Copies of a drain that failed (retried elsewhere)."),
)


REPAIR_COUNTERS = (   # (metric name, Repairs.stats() field, help)
    ("repaired_objects_total", "repaired_objects", "Replicas re-created for under-replicated objects."),
    ("repaired_bytes_total", "repaired_bytes", "Payload bytes of the re-created replicas."),
    ("repair_failed_copies_total", "repair_failed_copies",
     "Re-replication copies that failed or were not made in time (the object is tried again later)."),
    ("repair_spread_objects_total", "repair_spread_objects",
     "Repair copies moved to a segment holding fewer of them (one that joined after the repair)."),
)


def _drains(s: Snapshot) -> Iterator[Metric]:
    yield _gauge("draining_segments", "Segments being drained.", s.drains.get("draining_segments", 0))
    yield _gauge("repairs_in_flight", "Re-replication copies planned and not yet reported.",
                 s.drains.get("repairs_in_flight", 0))
    for name, field, help_ in (*DRAIN_COUNTERS, *REPAIR_COUNTERS):
        yield CounterMetricFamily(f"memcache_{name}", help_, value=s.drains.get(field, 0))


def op_label(request: str) -> str:
    """The ``op`` label of a request type, snake_case like every other ``op`` value (``Exist`` ->
    ``exist``, ``GetSegments`` -> ``get_segments``): one spelling per op across the families."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", request).lower()


def _requests(s: Snapshot) -> Iterator[Metric]:
    h = HistogramMetricFamily("memcache_request_seconds", "Time the MetaService spent on a request.",
                              labels=["op"])
    f = CounterMetricFamily("memcache_request_failures_total", "Requests answered with an error.", labels=["op"])
    for r in s.requests:
        cum, buckets = 0, []
        for le, n in zip((*map(str, BUCKETS), "+Inf"), r.buckets, strict=True):
            cum += n
            buckets.append((le, cum))
        op = op_label(r.op)
        h.add_metric([op], buckets, r.total_s)
        f.add_metric([op], r.failures)
    yield from (h, f)


def families(s: Snapshot) -> Iterator[Metric]:
    """Every metric of the MetaService (add new ones here, from the snapshot)."""
    yield from _segments(s)
    yield _gauge("pool_capacity_bytes", "Bytes of the whole pool.", s.capacity_bytes)
    yield _gauge("pool_used_bytes", "Bytes allocated in the whole pool.", s.used_bytes)
    yield _gauge("objects", "Committed objects.", s.objects)
    yield _gauge("pending_objects", "Objects allocated and not yet committed.", s.pending_objects)
    yield _gauge("objects_under_replicated", "Committed objects holding fewer replicas than their put asked for "
                 "(placed partially, or a replica's segment died or failed its checksum).", s.under_replicated)
    yield _gauge("members", "LocalServices and clients joined.", len(s.members))
    yield _gauge("meta_is_leader", "1 when this MetaService serves (the HA leader, or HA is off).",
                 1 if s.role == "leader" else 0)
    yield _gauge("meta_term", "The HA leader term this MetaService serves under (0: standby, or HA off).",
                 s.term or 0)
    yield from _drains(s)
    yield from _disk(s)
    yield _gauge("meta_uptime_seconds", "Seconds since this MetaService started.", s.uptime_s)
    yield _gauge("meta_start_time_seconds", "Unix time this MetaService started (a change is a restart).",
                 s.time - s.uptime_s)
    yield _gauge("meta_epoch", "Epoch of this MetaService (random, new at every start).", s.epoch)
    yield from _counters(s)
    yield from _requests(s)
    yield from ascend_metrics.families(s)   # memcache_hybrid's names, next to ours


class _Once(Collector):
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        return families(self.snap)


def render(snap: Snapshot) -> bytes:
    """Prometheus text exposition of a snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once(snap))
    registry.register(PROCESS)
    return generate_latest(registry)
