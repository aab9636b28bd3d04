"""A point-in-time copy of the MetaService's state: what /metrics, /status and ``memcache status`` show.

``MetaServiceCore.stats`` copies numbers out of the core into a ``Snapshot`` under its lock (a pass
over the segments and members, never over the objects); everything after it (rendering Prometheus text, HTML, JSON,
terminal tables) works on the copy, outside the lock. ``History`` keeps a small ring of samples so
the status page can draw hit ratio and throughput over the last minutes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from .. import errors
from .. import protocol as p

if TYPE_CHECKING:
    from .table import ObjectTable

HISTORY_LEN = 120          # ten minutes of samples
_CODE_NAMES = {v: k.lower() for k, v in vars(errors).items()
               if k.isupper() and isinstance(v, int) and v <= 0}


def code_name(code: int) -> str:
    """``success``, ``object_already_exists``, ... (the outcome label of a result code)."""
    return _CODE_NAMES.get(code, str(code))


class SegmentStats(msgspec.Struct):
    segment_id: int
    host_id: str
    tag: str
    data_addr: str
    metrics_addr: str
    served_read_bytes: int        # what members copied out of / into it through shared memory
    served_written_bytes: int
    pid: int | None
    tier: str
    capacity_bytes: int
    used_bytes: int
    objects: int
    largest_free_bytes: int
    accepts_new_objects_in_s: float | None   # None: draining, never again
    draining: bool
    arena_reserved_bytes: int = 0            # counted in used_bytes: its holder's arena, holding no object
    held: bool = False                       # its owner holds it: no new object goes there (local/hold.py)
    fenced_bytes: int = 0                    # counted in used_bytes: reclaimed ranges waiting for a fence rotation

    @property
    def state(self) -> str:
        """What the status views say of it: ``draining``, ``held``, or nothing (takes puts as usual)."""
        return "draining" if self.draining else "held" if self.held else ""


class MemberStats(msgspec.Struct):
    client_id: int
    host_id: str
    pid: int
    segment_id: int | None
    last_seen_s: float
    kept_objects: int = 0   # committed objects it wrote that the pool keeps (member_max_objects)
    kept_bytes: int = 0     # their payload bytes (member_max_bytes)


class RequestStats(msgspec.Struct):
    op: str
    buckets: list[int]      # per bucket of metrics.BUCKETS, then +Inf (not cumulative)
    total_s: float
    count: int
    failures: int


class Sample(msgspec.Struct, array_like=True):
    t: float                # wall-clock seconds
    gets: int
    hits: int
    puts: int
    used_bytes: int


class DiskTierStats(msgspec.Struct):
    segment_id: int                         # the provider's segment (its disk tier lies under it)
    policy: str
    capacity_bytes: int
    used_bytes: int
    objects: int
    counters: dict[str, int]                # the provider's own counts (local/disk.py DiskCounters)


MAX_SEGMENT_SERIES = 1024   # segments (and disk tiers) given series of their own in /metrics


class Snapshot(msgspec.Struct):
    time: float
    uptime_s: float
    epoch: int
    role: str
    term: int | None
    members: list[MemberStats]
    segments: list[SegmentStats]
    objects: int
    pending_objects: int
    under_replicated: int
    drains: dict[str, int]                 # Drains.stats() (meta/drain.py) and Repairs.stats() (meta/repair.py)
    counters: dict[str, int]
    outcomes: dict[str, dict[str, int]]    # op -> outcome -> count
    events: dict[str, int]                 # member joins/leaves/deaths, recoveries
    requests: list[RequestStats]
    history: list[Sample]
    disk_tiers: list[DiskTierStats] = []
    drains_in_progress: list[dict[str, Any]] = []   # Drains.in_progress(): one per segment being drained
    sample_interval_s: float = 0.0

    @property
    def capacity_bytes(self) -> int:
        return sum(s.capacity_bytes for s in self.segments)

    @property
    def used_bytes(self) -> int:
        return sum(s.used_bytes for s in self.segments)

    def listed_segments(self) -> list[SegmentStats]:
        """The segments with a series of their own in /metrics: the ``MAX_SEGMENT_SERIES`` largest (any
        member can join with a segment, so the series grow with members; an insider joining thousands of
        4 KiB segments must not grow a scrape without bound). The pool totals count every segment."""
        return sorted(self.segments, key=lambda g: (-g.capacity_bytes, g.segment_id))[:MAX_SEGMENT_SERIES]

    def listed_disk_tiers(self) -> list[DiskTierStats]:
        return sorted(self.disk_tiers, key=lambda d: (-d.capacity_bytes, d.segment_id))[:MAX_SEGMENT_SERIES]


class History:
    """Samples of the counters every ``interval_s``, the last ``HISTORY_LEN`` of them."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.samples: collections.deque[Sample] = collections.deque(maxlen=HISTORY_LEN)
        self._next = 0.0

    def record(self, table: ObjectTable, now: float) -> None:
        """Called from housekeeping, under the lock: cheap (no pass over the objects)."""
        if now < self._next:
            return
        self._next = now + self.interval_s
        c, t = table.counters, table
        used = sum(s.allocator.used for s in t.segments.values())
        self.samples.append(Sample(time.time(), c.lookups, c.hits, c.allocs, used))


def rates(samples: list[Sample]) -> list[tuple[float, float | None, float]]:
    """(time, hit ratio of the interval or None without gets, gets+puts per second) between samples."""
    out = []
    for a, b in zip(samples, samples[1:], strict=False):
        dt = max(b.t - a.t, 1e-9)
        gets, hits = b.gets - a.gets, b.hits - a.hits
        out.append((b.t, hits / gets if gets else None, (gets + b.puts - a.puts) / dt))
    return out


def _count_codes(outcomes: collections.Counter[tuple[str, str]], op: str, codes: Iterable[int]) -> None:
    """A batch's codes counted in C first: one update per distinct code, not one per key (a batch of
    one, the usual small put, skips building the Counter: measured 10% of a MetaService's commit)."""
    if isinstance(codes, list) and len(codes) == 1:
        outcomes[op, code_name(codes[0])] += 1
        return
    for code, n in collections.Counter(codes).items():
        outcomes[op, code_name(code)] += n


def count_outcomes(outcomes: collections.Counter[tuple[str, str]], req: object, reply: object) -> None:
    """Per-key outcomes of the data-path requests (called with the reply, under the lock)."""
    match req, reply:
        case p.Exist(), p.Flags(flags=flags):
            found = flags.count(True)
            outcomes["exist", "found"] += found
            outcomes["exist", "missing"] += len(flags) - found
        case p.Lookup(), p.LookupReply(results=results):
            misses = results.count(None)
            outcomes["get", "hit"] += len(results) - misses
            outcomes["get", "miss"] += misses
        case p.Alloc(), p.AllocReply(results=results):
            _count_codes(outcomes, "put", [r.code for r in results])
        case p.Commit(), p.Codes(codes=codes):
            _count_codes(outcomes, "commit", codes)
        case p.ArenaCommit(), p.ArenaReply(codes=codes):   # a small put is decided at its commit; a key
            # stored already goes on to the two-phase put, whose Alloc counts it (local/arena.py)
            _count_codes(outcomes, "put", [c for c in codes if c != errors.OBJECT_ALREADY_EXISTS])
        case p.Remove(), p.Codes(codes=codes):
            _count_codes(outcomes, "remove", codes)
        case p.Info(), p.InfoReply(results=results):
            misses = results.count(None)
            outcomes["query", "found"] += len(results) - misses
            outcomes["query", "missing"] += misses
        case _, p.Error(code=code):
            outcomes[type(req).__name__.lower(), code_name(code)] += 1
