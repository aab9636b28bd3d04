"""Reads of the object table: lookup (one key, or a batch get's keys answered as ``Found``), read
leases and LRU touches, exist and validate. A mixin of ``ObjectTable`` (``table.py`` holds the state)."""

from __future__ import annotations

from ..records import Found
from .objects import FIRST_SEGMENT, Counters, Obj, Segment


class Lookups:
    """Lookups over ``ObjectTable``'s objects (a mixin; the table sets the state)."""

    objects: dict[str, Obj]
    segments: dict[int, Segment]
    counters: Counters
    lease_ttl_s: float
    _lease_for: tuple[float, float]

    def lookup(self, key: str, now: float, lease: bool) -> Obj | None:
        self.counters.lookups += 1
        obj = self.objects.get(key)
        if obj is None or not obj.committed:
            return None
        self.counters.hits += 1
        if not obj.locations:
            self.counters.disk_hits += 1
        if lease:
            self._touch(obj, self._lease_end(now))
        return obj

    def lookup_many(self, keys: list[str], now: float, lease: bool) -> list[Found | None]:  # noqa: C901
        """``lookup`` of each key, answered as the protocol's ``Found`` (a batch get's hot path)."""
        objects, segments, disk_hits = self.objects, self.segments, 0
        out: list[Found | None] = []
        end = self._lease_end(now) if lease else 0.0
        for k in keys:
            obj = objects.get(k)
            if obj is None or not obj.committed:
                out.append(None)
                continue
            if not lease:
                pass
            elif obj.more is None and (sid1 := obj.packed & FIRST_SEGMENT):   # ``_touch`` unrolled
                if end > obj.lease_until:
                    obj.lease_until = end
                segments[sid1 - 1].lru.touch(obj)
            else:
                self._touch(obj, end)
            found = obj.found()
            disk_hits += not found.locations
            out.append(found)
        c = self.counters
        c.lookups += len(keys)
        c.hits += len(keys) - out.count(None)
        c.disk_hits += disk_hits
        return out

    def lease(self, obj: Obj, lease_end: float) -> None:
        """Lease a committed object until ``lease_end`` (the GVA path's ``batch_add_lease``, ``gva.py``)."""
        self._touch(obj, lease_end)

    def _lease_end(self, now: float) -> float:
        if self._lease_for[0] is not now:   # the keys of one request share their lease end
            self._lease_for = (now, now + self.lease_ttl_s)
        return self._lease_for[1]

    def _touch(self, obj: Obj, lease_end: float) -> None:
        """A leased read: the lease never shrinks, and the object becomes the most recent in its segments."""
        if lease_end > obj.lease_until:
            obj.lease_until = lease_end
        if obj.more is None:   # one location (or none: on disk only)
            sid = obj.first_segment
            if sid is not None:
                self.segments[sid].lru.touch(obj)
        else:
            for loc in obj.locations:
                self.segments[loc.segment_id].lru.touch(obj)

    def exists(self, key: str) -> bool:
        obj = self.objects.get(key)
        return obj is not None and obj.committed

    def validate(self, key: str, generation: int) -> bool:
        obj = self.objects.get(key)
        return obj is not None and obj.committed and obj.generation == generation
