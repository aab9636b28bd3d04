"""Space in the segments of the object table: choosing segments for a put's replicas, allocating in
one (evicting when asked), LRU eviction down to the low-water mark, and freeing an object's space.
A mixin of ``ObjectTable`` (``table.py`` holds the state and the object lifecycle)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..layout import footprint
from ..records import Location
from .allocator import aligned
from .objects import Counters, Obj, Segment

DISK_LOOKAHEAD = 256     # how far eviction looks down the LRU list for an object already on disk


class Space:
    """Allocation and eviction over ``ObjectTable``'s segments (a mixin; the table sets the state)."""

    high: float
    low: float
    segments: dict[int, Segment]
    counters: Counters
    disk_tiers: dict[int, Any]

    if TYPE_CHECKING:   # the table's own (``removals.py``), used here
        def _unlink(self, obj: Obj, now: float = 0.0, keep_space: bool = False) -> None: ...

        def _drop_replica(self, obj: Obj, loc: Location, now: float) -> None: ...

    def _choose(self, pinned: list[Segment], candidates: Iterable[Segment], replicas: int, size: int,
                now: float) -> list[tuple[Segment, int]]:
        """Up to ``replicas`` distinct segments with room, in this order of passes: pinned ones (without,
        then with eviction); then segments on hosts not yet holding a replica; then any segment.
        Segments smaller than the object are skipped (never evicted for nothing)."""
        chosen: list[tuple[Segment, int]] = []
        hosts: set[str] = set()
        need = aligned(size)

        def take(segs: Iterable[Segment], evict: bool, distinct_host: bool) -> None:
            for seg in segs:
                if len(chosen) == replicas:
                    return
                if seg.allocator.size < need or any(seg is c for c, _ in chosen) \
                        or (distinct_host and seg.info.host_id in hosts):
                    continue
                off = self._alloc_in(seg, size, now, evict)
                if off is not None:
                    chosen.append((seg, off))
                    hosts.add(seg.info.host_id)

        for evict in (False, True):
            take(pinned, evict, False)
        for distinct_host in (True, False):
            for evict in (False, True):
                take(candidates, evict, distinct_host)
        return chosen

    def _alloc_in(self, seg: Segment, size: int, now: float, evict: bool) -> int | None:
        a = seg.allocator
        if not evict:
            if a.used + aligned(size) > self.high * a.size:
                return None
            return a.alloc(size)
        if a.used + aligned(size) > self.high * a.size:
            self.evict_segment(seg, now, target=max(0, int(self.low * a.size) - aligned(size)))
        off = a.alloc(size)
        while off is None and self._evict_one(seg, now):
            off = a.alloc(size)
        return off
    # ---- eviction ------------------------------------------------------------------------------------

    def evict_all(self, now: float) -> int:
        n = 0
        for seg in self.segments.values():
            if seg.allocator.used > self.high * seg.allocator.size:
                n += self.evict_segment(seg, now, target=int(self.low * seg.allocator.size))
        return n

    def evict_segment(self, seg: Segment, now: float, target: int) -> int:
        n = 0
        while seg.allocator.used > target and self._evict_one(seg, now):
            n += 1
        return n

    def _evict_one(self, seg: Segment, now: float) -> bool:
        obj = self._victim(seg, now)
        if obj is None:
            return False
        self.evict(obj, now)
        return True

    def evict(self, obj: Obj, now: float) -> None:
        """Evict one committed, unleased object (all its DRAM copies; kept on disk when it has a record)."""
        self.counters.evictions += 1
        self.counters.evicted_bytes += obj.size
        if obj.disk is not None and obj.disk[0] in self.disk_tiers:
            self.counters.evictions_to_disk += 1
            self.to_disk_only(obj, now)
        else:
            self._unlink(obj, now)

    def _victim(self, seg: Segment, now: float) -> Obj | None:
        """The least recently used unleased object; in a segment with a disk tier, the least recently
        used one among the first ``DISK_LOOKAHEAD`` that already has its disk record (evicting it loses
        nothing), when there is one."""
        first = None
        with_disk = seg.info.segment_id in self.disk_tiers
        head = seg.lru.first()
        if head is not None and not with_disk and head.lease_until <= now:
            return head   # (the common case, without walking)
        for n, obj in enumerate(seg.lru.values()):
            if obj.lease_until > now:
                continue
            if first is None:
                first = obj
                if not with_disk:
                    break
            if obj.disk is not None:
                return obj
            if n >= DISK_LOOKAHEAD:
                break
        return first

    def to_disk_only(self, obj: Obj, now: float) -> None:
        """Drop every DRAM copy of an object that has a disk record: it stays visible, served from disk."""
        for loc in list(obj.locations):
            self._drop_replica(obj, loc, now)
    def _free_space(self, obj: Obj) -> None:
        for loc in obj.locations:
            seg = self.segments.get(loc.segment_id)
            if seg is not None and not (seg.arena is not None and seg.arena.release(loc.offset)):
                seg.allocator.free_range(loc.offset, footprint(obj.size))
