"""Room for a copy by pushing out colder objects: a drain's move or a repair's copy that finds no
segment with free room under the high-water mark (``placement.copy_target``) evicts, in one segment,
objects last used before the object it copies, as a put evicts to make room for itself.

How hot an object is: ``last_use``, the end of its last read lease, or its commit when it was not
read since (a read counts as a use until its lease ends); a recovered object's is 0 (unknown: the
coldest, and it pushes nothing out). It is comparable across segments, where LRU order is not.

Invariants:

* Only committed, unleased objects last used strictly before the copied object are evicted: never a
  hotter one, never a leased one; PENDING objects are in no LRU list, so never one of those.
* Only what the copy needs to fit under the high-water mark, coldest first: the segment's LRU list
  from its least recent end, past leased objects (at most ``LOOKAHEAD`` looked at), until the first
  one that is not colder. Nothing is evicted unless the objects found free enough (planned first,
  then evicted). So a copy costs O(1) walking where nothing is colder, and a drain of cold objects
  into a hot pool stays cheap under the MetaService lock.
* Of the segments that may take the copy, the one whose coldest such object is the coldest goes
  first: the pool's coldest objects make room, wherever they lie.
* An evicted object is evicted as eviction does (``Space.evict``: every DRAM copy; kept on disk when its
  provider has its record), and counted with the evictions.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..layout import footprint
from .allocator import aligned
from .table import Obj, ObjectTable, Segment

LOOKAHEAD = 256      # objects looked at from the least recent end of a segment's list, per copy


def last_use(obj: Obj) -> float:
    """When the object was last in use (monotonic seconds of the MetaService; 0: unknown)."""
    return obj.lease_until


def _colder(seg: Segment, than: float, now: float) -> Iterable[Obj]:
    """The segment's unleased objects last used before ``than``, least recent first: past leased ones
    and those in its arena (at most ``LOOKAHEAD`` objects looked at), up to the first unleased one that is not colder (the
    list is in order of use: what follows is as hot, give or take a lease, and is left alone)."""
    for n, obj in enumerate(seg.lru.values()):
        if n >= LOOKAHEAD:
            return
        if obj.lease_until > now or _in_arena(seg, obj):
            continue
        if obj.lease_until >= than:
            return
        yield obj


def _in_arena(seg: Segment, obj: Obj) -> bool:
    """Does the object lie in the segment's live arena (its space would go back to the arena, not
    to the allocator: evicting it makes no room for a copy)?"""
    a = seg.arena
    if a is None:
        return False
    sid = seg.info.segment_id
    return any(loc.segment_id == sid and a.start <= loc.offset < a.end for loc in obj.locations)


def victims(table: ObjectTable, seg: Segment, need: int, than: float, now: float) -> list[Obj] | None:
    """The colder objects whose eviction lets ``need`` more bytes into ``seg`` under the high-water
    mark ([] when they fit already; None when the colder objects found are not enough)."""
    a = seg.allocator
    over = a.used + need - table.high * a.size
    out: list[Obj] = []
    if over <= 0:
        return out
    for obj in _colder(seg, than, now):
        out.append(obj)
        over -= aligned(footprint(obj.size))
        if over <= 0:
            return out
    return None


def evicting(table: ObjectTable, obj: Obj, segments: list[Segment], now: float) -> tuple[Segment, int] | None:
    """Space for a copy of ``obj`` in one of ``segments`` (they may take it: no replica there, owner
    answering), made by evicting objects colder than ``obj``; the coldest segment first. Returns
    (segment, offset), or None when no segment has enough colder objects."""
    need = aligned(footprint(obj.size))
    heat = last_use(obj)
    coldest: list[tuple[float, int, Segment]] = []
    for i, s in enumerate(segments):
        if s.allocator.size < need:
            continue
        first = next(iter(_colder(s, heat, now)), None)
        if first is not None:
            coldest.append((last_use(first), i, s))
    for _, _, s in sorted(coldest, key=lambda c: c[:2]):
        out = victims(table, s, need, heat, now)
        if out is None:
            continue
        for v in out:
            table.evict(v, now)
        off = s.allocator.alloc(need)
        while off is None:   # enough bytes, not in one range: one colder object more at a time
            more = next(iter(_colder(s, heat, now)), None)
            if more is None:
                break
            table.evict(more, now)
            off = s.allocator.alloc(need)
        if off is not None:
            return s, off
    return None
