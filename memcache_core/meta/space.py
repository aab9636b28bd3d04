"""Space in the segments of the object table: choosing segments for a put's replicas, allocating in
one (evicting when asked), LRU eviction, and freeing an object's space. A mixin of ``ObjectTable``
(``table.py`` holds the state and the object lifecycle).

Recency is compared across segments by each object's ``lease_until``: the time of its commit, or the
end of its last read lease (a read counts as a use until its lease ends), so a put that finds no
segment with room evicts the pool's least recently used objects, whichever segments hold them
(``evict_coldest``), not the oldest of the segment it was placed in first."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..layout import footprint
from ..records import Location
from .allocator import aligned
from .objects import Counters, Obj, Segment

DISK_LOOKAHEAD = 256     # how far eviction looks down the LRU list for an object already on disk
STAMP_S = 0.001          # objects committed within this long share one float as their time of use (its bytes)
AGE_SLACK = 0.05         # space in one given segment evicts there objects this near the pool's oldest (of its age)


class Space:
    """Allocation and eviction over ``ObjectTable``'s segments (a mixin; the table sets the state)."""

    high: float
    low: float
    segments: dict[int, Segment]
    counters: Counters
    disk_tiers: dict[int, Any]
    _stamp_for: float

    def stamp(self, now: float) -> float:
        """A committed object's time of use: ``now``, or the float of a commit less than ``STAMP_S``
        before (shared, so a million objects committed one a request do not hold a million floats)."""
        if not 0.0 <= now - self._stamp_for < STAMP_S:
            self._stamp_for = now
        return self._stamp_for

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
            take(candidates, False, distinct_host)
            if len(chosen) < replicas:   # no segment with room: evict the pool's coldest, then place again
                taken = {id(c) for c, _ in chosen}
                among = [s for s in candidates if need <= self.high * s.allocator.size and id(s) not in taken
                         and not (distinct_host and s.info.host_id in hosts)]
                if among and self._evict_coldest(int((self.high - self.low) * among[0].allocator.size) + need,
                                                  now, among, need):
                    take(candidates, False, distinct_host)
            take(candidates, True, distinct_host)   # (still none: the first segment that fits evicts its own)
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

    def evict_coldest(self, nbytes: int, now: float, among: Iterable[Segment] | None = None) -> int:
        """Make room for ``nbytes`` pool-wide: evict the least recently used committed, unleased
        objects across the segments ``among`` (default: all), the oldest first whichever segment holds
        it, until ``nbytes`` bytes of segment space are free again or nothing more can be evicted.
        Returns the bytes freed (space in several segments; an object's replicas all go at once)."""
        return self._evict_coldest(nbytes, now, list(self.segments.values()) if among is None else list(among))

    def _evict_coldest(self, nbytes: int, now: float, among: list[Segment], room_for: int = 0) -> int:
        """``evict_coldest``; with ``room_for``, go on until one of the segments ``among`` also has room
        for that many bytes under its high-water mark."""
        heap: list[tuple[float, int, Segment]] = []
        for seg in among:
            stamp = self._coldest(seg, now)
            if stamp is not None:
                heap.append((stamp, seg.info.segment_id, seg))
        heapq.heapify(heap)
        ids = {seg.info.segment_id for seg in among}
        stale: set[int] = set()   # segments whose oldest went with an object evicted through another
        freed, high = 0, self.high
        room = room_for == 0
        while heap and (freed < nbytes or not room):
            stamp, sid, seg = heap[0]
            obj = self._victim(seg, now) if sid not in stale else None
            if obj is None:
                stale.discard(sid)
                stamp_now = self._coldest(seg, now)
                if stamp_now is None:
                    heapq.heappop(heap)
                else:
                    heapq.heapreplace(heap, (stamp_now, sid, seg))
                continue
            if obj.more is None:   # one location: this segment's
                a = seg.allocator
                before = a.used
                self.evict(obj, now)
                freed += before - a.used
                room = room or a.used + room_for <= high * a.size
            else:
                held = [self.segments[loc.segment_id] for loc in obj.locations if loc.segment_id in ids]
                before = sum(s.allocator.used for s in held)
                self.evict(obj, now)
                freed += before - sum(s.allocator.used for s in held)
                room = room or any(s.allocator.used + room_for <= high * s.allocator.size for s in held)
                stale.update(s.info.segment_id for s in held if s is not seg)
            stamp_now = self._coldest(seg, now)
            if stamp_now is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (stamp_now, sid, seg))
        return freed

    def alloc_near_coldest(self, seg: Segment, size: int, now: float) -> int | None:
        """Space in this segment under its high-water mark, evicting there (down to its low-water mark)
        only objects last used no later than the pool's least recently used one plus ``AGE_SLACK`` of
        that one's age: about what one LRU list for the pool would evict. None when the segment could
        make room only by evicting more recent objects than other segments hold."""
        a, need = seg.allocator, aligned(size)
        if a.used + need > self.high * a.size:
            stamps = [c for s in self.segments.values() if (c := self._coldest(s, now)) is not None]
            if stamps:
                bound = min(stamps) + AGE_SLACK * (now - min(stamps))
                target = max(0, int(self.low * a.size) - need)
                while a.used > target and (c := self._coldest(seg, now)) is not None and c <= bound:
                    self._evict_one(seg, now)
            if a.used + need > self.high * a.size:
                return None
        return a.alloc(size)

    def _coldest(self, seg: Segment, now: float) -> float | None:
        """When the segment's least recently used unleased object was last used (``lease_until``)."""
        head = seg.lru.first()
        if head is not None and head.lease_until <= now:
            return head.lease_until   # (the common case, without walking)
        for obj in seg.lru.values():
            if obj.lease_until <= now:
                return obj.lease_until
        return None

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
