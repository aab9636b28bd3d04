"""Allocation arenas: small puts in one round trip (docs/design.md, "Small puts").

A member that holds a segment may be granted an *arena*: a range of its own segment, taken from the
segment's allocator as one block, where it places small objects itself (like a thread-local
allocation buffer). It copies each object's payload there, then commits the whole batch with one
``ArenaCommit`` carrying (key, offset, size, checksum); only then are the objects in the table,
visible, with generations issued here at commit (``meta/generations.py`` order holds: a generation is
issued when the object becomes visible, as ``Alloc`` + ``Commit`` issue it before).

Invariants:
* An arena lies in its holder's own segment, so an uncommitted write there can only ever reach the
  writer's own space, and a crashed writer's arena dies with its segment.
* A commit is accepted only for the caller's live arena (``id``), each object inside it, 64-byte
  aligned, and overlapping no object committed in it before; anything else is refused per key
  (``ARENA_VOID`` for a wrong arena: the writer falls back to the two-phase put). An insider cannot
  commit over another object.
* Committed objects are ordinary objects: evicted, removed, drained and recovered like any other.
  The space of one freed while its arena is live stays the arena's (its holder may not place there
  again) until the arena is retired; retiring returns every range of the arena not held by a
  committed object to the allocator. An arena is retired when its holder asks for a new one
  (``refill``) or gives it back (``release``, after it sat unused); it vanishes with its segment
  (leave, death, re-join), and a new MetaService life or leader term starts without any, so an
  arena id from before is void.
* No arena is granted in a segment that takes no new objects (``Segment.takes_new``: draining, just
  recovered, or held by its owner), nor one larger than an eighth of the segment.
"""

from __future__ import annotations

import bisect
import secrets
from collections.abc import Callable

from .. import errors
from .. import protocol as p
from ..layout import ALIGN, footprint
from .allocator import aligned
from .objects import Obj, Segment, pack
from .table import ObjectTable


class Arena:
    """A granted range ``[start, end)`` of a segment and the objects committed in it."""

    __slots__ = ("id", "start", "end", "used", "held", "_starts")

    def __init__(self, start: int, end: int) -> None:
        self.id = secrets.randbits(62) or 1   # never reused across MetaService lives (not a counter)
        self.start, self.end = start, end
        self.used: dict[int, int] = {}        # offset -> end of each committed object still holding space
        self.held = 0                         # their bytes: the arena's unheld rest is reserved, not used
        self._starts: list[int] = []          # the same offsets, sorted

    @property
    def reserved(self) -> int:
        """Bytes of the arena that hold no committed object (free for its holder's small puts only)."""
        return self.end - self.start - self.held

    def fits(self, offset: int, end: int) -> bool:
        """Inside the arena, aligned, and clear of every object committed in it."""
        if offset % ALIGN or offset < self.start or end > self.end:
            return False
        i = bisect.bisect_right(self._starts, offset)
        if i and self.used[self._starts[i - 1]] > offset:
            return False
        return i == len(self._starts) or self._starts[i] >= end

    def take(self, offset: int, end: int) -> None:
        bisect.insort(self._starts, offset)
        self.used[offset] = end
        self.held += end - offset

    def release(self, offset: int) -> bool:
        """An object committed here left the table: its space stays the arena's (True), or not ours."""
        end = self.used.pop(offset, None)
        if end is None:
            return False
        self.held -= end - offset
        del self._starts[bisect.bisect_left(self._starts, offset)]
        return True

    def gaps(self) -> list[tuple[int, int]]:
        """(offset, length) of every range not held by a committed object."""
        out, pos = [], self.start
        for s in self._starts:
            if s > pos:
                out.append((pos, s - pos))
            pos = self.used[s]
        if pos < self.end:
            out.append((pos, self.end - pos))
        return out


def grant(t: ObjectTable, seg: Segment, size: int, now: float) -> Arena | None:
    """A new arena of ``size`` bytes in ``seg``, or None. It evicts there only objects about as old as
    the pool's least recently used: while other segments hold older ones, the holder's small puts go
    the two-phase way, placed where the pool's eviction makes room (``Space.alloc_near_coldest``)."""
    if size <= 0 or not seg.takes_new(now) or aligned(size) > seg.allocator.size // 8:
        return None
    off = t.alloc_near_coldest(seg, size, now)
    if off is None:
        return None
    seg.arena = Arena(off, off + aligned(size))
    return seg.arena


def retire(seg: Segment) -> None:
    """Give the arena's free part back to the segment's allocator."""
    a, seg.arena = seg.arena, None
    if a is not None:
        for off, n in a.gaps():
            seg.allocator.free_range(off, n)


def commit(t: ObjectTable, segment_id: int | None, req: p.ArenaCommit, now: float, arena_bytes: int,
           within_quota: Callable[[int], bool] = lambda size: True) -> p.ArenaReply:
    """Commit the objects of ``req`` placed in the caller's arena; retire and refill it when asked.
    ``within_quota(size)``: may the caller keep one more object of that size (the member quotas, as
    for an ``Alloc``; it may evict the caller's own objects to make room)."""
    seg = t.segments.get(segment_id) if segment_id is not None else None
    a = seg.arena if seg is not None else None
    n = len(req.keys)
    if seg is None or a is None or a.id != req.arena or not seg.takes_new(now):
        codes, gens = [errors.ARENA_VOID] * n, [0] * n
    else:
        t.reserve_for(n)   # (may fail, with HA: before any object of the batch is published)
        codes, gens = [], []
        for key, off, size, checksum in zip(req.keys, req.offsets, req.sizes, req.checksums, strict=True):
            code, gen = _place(t, seg, a, key, off, size, checksum, within_quota, now)
            codes.append(code)
            gens.append(gen)
    if seg is not None and (req.refill or req.release) and (a is None or a.id == req.arena or req.arena == 0):
        retire(seg)
        if req.refill:
            grant(t, seg, arena_bytes, now)
    held = seg.arena if seg is not None else None
    if held is None:
        return p.ArenaReply(codes, gens)
    return p.ArenaReply(codes, gens, held.id, held.start, held.end - held.start)


def _place(t: ObjectTable, seg: Segment, a: Arena, key: str, offset: int, size: int, checksum: int,
           within_quota: Callable[[int], bool], now: float) -> tuple[int, int]:
    """Commit one object written at ``offset`` of the arena: (code, generation). It counts in its
    writer's quota (``kept.py``) as a two-phase put's object does; the writer is the segment's owner."""
    t.counters.allocs += 1   # a put asked (``puts_total``), as a two-phase put's Alloc counts it
    cur = t.objects.get(key)
    if cur is not None:
        return (errors.OBJECT_ALREADY_EXISTS if cur.committed else errors.WRITE_IN_PROGRESS), 0
    end = offset + aligned(footprint(size))
    if not a.fits(offset, end):
        return errors.INVALID_PARAM, 0
    if not within_quota(size):
        return errors.QUOTA_EXCEEDED, 0
    gen = t.issue_generation()
    writer = seg.info.segment_id   # a member's segment id is its client id
    slot = t.writer_slot_of(writer)
    obj = Obj(key, pack(size, gen, checksum, p.Location(writer, offset), slot), t.stamp(now))   # used now (``space.py``)
    if slot:
        t.count_kept(writer, obj)
    t.objects[obj.key] = obj
    seg.lru.append(obj)
    a.take(offset, end)
    t.counters.commits += 1
    if t.listener is not None:
        t.listener(True, obj, obj.locations)
    return errors.SUCCESS, gen
