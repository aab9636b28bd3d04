"""memcache_hybrid's ``memcache_*`` metric families, exported next to ours (``metrics.py``), so that a
dashboard or an alert written for Ascend's MetaService works on this one.

Ascend's MetaService counts each RPC in a single-key and a batch variant. Every request here is a
batch, so the single-key families (``memcache_alloc_*``, ``memcache_get_*``, ...) count keys (their
per-key outcomes), and the ``memcache_batch_*`` families count requests. Three of Ascend's names are
ours already and mean the same (``memcache_segment_capacity_bytes``, ``memcache_kv_events_published_total``,
``memcache_kv_events_dropped_total``): they are not repeated here. Families that cannot apply here are
exported at zero (docs/operations.md lists them and why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .stats import Snapshot

# Ascend's op -> (where its counts come from here, what they count). Sources: "keys:<outcome op>"
# (per-key outcomes, stats.count_outcomes), "requests:<Request>[+<Request>]" (requests handled),
# "events:<name>" (a count of events), "members" (segments that left: Leave requests and deaths).
OPS: tuple[tuple[str, str, str], ...] = (
    ("alloc", "keys:put", "objects asked to be allocated (each key of an Alloc request)"),
    ("batch_alloc", "requests:Alloc+ArenaCommit", "Alloc requests (puts and batch_alloc) and small puts' arena commits"),
    ("get", "keys:get", "objects looked up for reading (each key of a Lookup)"),
    ("batch_get", "requests:Lookup", "Lookup requests"),
    ("remove", "keys:remove", "objects asked to be removed"),
    ("batch_remove", "requests:Remove", "Remove requests"),
    ("remove_all", "requests:RemoveAll+RemovePrefix", "remove_all and remove_by_prefix requests"),
    ("update_state", "keys:commit", "objects committed (made visible)"),
    ("batch_update_state", "requests:Commit+Abort+ArenaCommit", "Commit, Abort and arena commit requests"),
    ("query", "keys:query", "objects described (each key of batch_get_key_info)"),
    ("batch_query", "requests:Info", "batch_get_key_info requests"),
    ("get_all_keys", "events:http_get_all_keys", "/get_all_keys calls"),
    ("exist_key", "keys:exist", "existence probes, per key"),
    ("batch_exist_key", "requests:Exist", "Exist requests"),
    ("mount", "requests:Join", "joins and re-joins (a segment mounted)"),
    ("unmount", "members", "members that left or were declared dead (a segment unmounted)"),
)
_OK = ("success", "hit", "found")
_ABSENT = ("miss", "missing", "object_not_exists")


def _op_counts(s: Snapshot, source: str) -> tuple[int, int, int, int]:
    """(requests, successes, failures, not found) of one source."""
    kind, _, what = source.partition(":")
    if kind == "keys":
        by = s.outcomes.get(what, {})
        total = sum(by.values())
        ok = sum(by.get(o, 0) for o in _OK)
        absent = sum(by.get(o, 0) for o in _ABSENT)
        return total, ok, total - ok - absent, absent
    if kind == "requests":
        reqs = [r for r in s.requests if r.op in what.split("+")]
        total, failed = sum(r.count for r in reqs), sum(r.failures for r in reqs)
        return total, total - failed, failed, 0
    if kind == "events":
        n = s.events.get(what, 0)
        return n, n, 0, 0
    n = s.events.get("leaves", 0) + s.events.get("deaths", 0)
    return n, n, 0, 0


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"memcache_{name}", help_, value=value)


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"memcache_{name}", help_, value=value)


def _space(s: Snapshot, v: dict[str, Any]) -> Iterator[Metric]:
    labels = ["segment", "host", "tier"]
    alloc = GaugeMetricFamily("memcache_segment_allocated_bytes", "Bytes allocated in a segment "
                              "(memcache_hybrid's name; the same as memcache_segment_used_bytes).", labels=labels)
    frag = GaugeMetricFamily("memcache_segment_fragmentation_bytes", "Free bytes of a segment outside its "
                             "largest free range (free space no object of that size can use).", labels=labels)
    for g in s.listed_segments():
        lv = [str(g.segment_id), g.host_id, g.tier]
        alloc.add_metric(lv, g.used_bytes)
        frag.add_metric(lv, max(0, g.capacity_bytes - g.used_bytes - g.largest_free_bytes))
    yield from (alloc, frag)
    yield _gauge("total_capacity_bytes", "Bytes of the whole pool (memcache_pool_capacity_bytes).", s.capacity_bytes)
    yield _gauge("allocated_bytes", "Bytes allocated in the whole pool (memcache_pool_used_bytes).", s.used_bytes)
    yield _gauge("stored_keys", "Committed objects (memcache_objects).", v["stored_keys"])


def values(s: Snapshot) -> dict[str, Any]:
    """Every value of these families but the per-segment and KV-event ones, computed once: the families
    below and ``/metrics/summary`` (ascend_http.py) both read them. ``op:<op>`` is the (requests,
    successes, failures, not found) of one of ``OPS``."""
    c = s.counters
    disk = {k: sum(d.counters.get(k, 0) for d in s.disk_tiers)
            for k in ("writes", "write_bytes", "promotion_failures")}
    out: dict[str, Any] = {f"op:{op}": _op_counts(s, source) for op, source, _ in OPS}
    out.update(stored_keys=s.objects, evict_operations=c["evictions"], evict_running=0, flush_blobs=disk["writes"],
               flush_bytes=disk["write_bytes"], get_hits_dram=c["hits"] - c["disk_hits"], get_hits_ssd=c["disk_hits"],
               query_hit_keys=s.outcomes.get("query", {}).get("found", 0), rewarm=c["promotions"],
               rewarm_failed=disk["promotion_failures"], rewarm_bytes=0, rewarm_bytes_current=0)
    return out


def _ops(v: dict[str, Any]) -> Iterator[Metric]:
    for op, _source, what in OPS:
        total, ok, failed, absent = v[f"op:{op}"]
        yield _counter(f"{op}_requests", f"memcache_hybrid's {op}: {what}.", total)
        yield _counter(f"{op}_successes", f"memcache_hybrid's {op}: {what}, that succeeded.", ok)
        yield _counter(f"{op}_failures", f"memcache_hybrid's {op}: {what}, that failed.", failed)
        yield _counter(f"{op}_not_found", f"memcache_hybrid's {op}: {what}, whose key was absent "
                       "(0 for requests and for calls no key can be absent from).", absent)


def _tiers(v: dict[str, Any]) -> Iterator[Metric]:
    yield _counter("evict_operations", "Objects evicted by LRU (memcache_evictions_total).", v["evict_operations"])
    yield _gauge("evict_running", "1 while an eviction pass runs: always 0 here (passes run inside housekeeping, "
                 "under the lock that scrapes take too).", v["evict_running"])
    yield _counter("flush_blobs", "Records written to providers' disk tiers (Ascend's SSD flushes).", v["flush_blobs"])
    yield _counter("flush_bytes", "Bytes written to providers' disk tiers.", v["flush_bytes"])
    yield _counter("get_hits_dram", "Lookups that found the object in DRAM.", v["get_hits_dram"])
    yield _counter("get_hits_ssd", "Lookups that found the object on a disk tier only.", v["get_hits_ssd"])
    yield _counter("query_hit_keys", "Keys batch_get_key_info found.", v["query_hit_keys"])
    yield _counter("rewarm", "Disk-only objects brought back into DRAM (memcache_promotions_total).", v["rewarm"])
    yield _counter("rewarm_failed", "Promotions from a disk tier that failed (providers' reports).", v["rewarm_failed"])
    yield _counter("rewarm_bytes", "Bytes brought back into DRAM: not counted here, always 0.", v["rewarm_bytes"])
    yield _gauge("rewarm_bytes_current", "Bytes being brought back into DRAM now: not tracked here, always 0.",
                 v["rewarm_bytes_current"])


def _kv_events(s: Snapshot) -> Iterator[Metric]:
    published, stored = s.events.get("kv_events_published", 0), s.events.get("kv_events_published_stored", 0)
    cleared = s.events.get("kv_events_published_cleared", 0)
    by_type = CounterMetricFamily("memcache_kv_events_published_by_type", "KV events sent, by type "
                                  "(cleared: a new object table, at each start).", labels=["type"])
    for t, n in (("stored", stored), ("removed", published - stored - cleared), ("cleared", cleared)):
        by_type.add_metric([t], n)
    by_medium = CounterMetricFamily("memcache_kv_events_published_by_medium", "KV events sent, by medium "
                                    "(every object here is in DRAM; AllBlocksCleared has none).", labels=["medium"])
    for m, n in (("hbm", 0), ("dram", published - cleared), ("ssd", 0), ("unknown", 0)):
        by_medium.add_metric([m], n)
    yield from (by_type, by_medium)
    yield _counter("kv_events_dropped_stored", "BlockStored events dropped (queue or socket full).",
                   s.events.get("kv_events_dropped_stored", 0))


def families(s: Snapshot) -> Iterator[Metric]:
    """memcache_hybrid's families (83 here; the other 3 of its 86 are ours already, in ``metrics.py``)."""
    v = values(s)
    yield from _space(s, v)
    yield from _ops(v)
    yield from _tiers(v)
    yield from _kv_events(s)
