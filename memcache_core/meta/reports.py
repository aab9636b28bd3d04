"""Segments joining the table with the objects their owners report (after a MetaService restart, an
HA failover, or a member declared dead that re-joins), in bounded batches: a ``Join`` carries at most
``protocol.MAX_KEYS`` reports and ``Report`` requests carry the rest, so a segment of millions of
objects never holds the MetaService's loop for long. Until its last batch the segment takes no new
object (``REPORTING``): space not reported yet may hold objects. A mixin of ``ObjectTable``.
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from .. import errors
from ..layout import footprint
from ..records import Location, ObjectReport, SegmentInfo
from .allocator import Allocator
from .objects import Counters, Obj, Segment, new_obj

logger = logging.getLogger(__name__)

REPORTING = 1e18   # ``Segment.alloc_after`` of a segment whose owner reports more objects: no new object
class Reporting:
    """A segment's recovery in batches (``ObjectTable.add_segment`` with ``more``, then ``report``)."""

    __slots__ = ("alloc_after", "pos", "recovering", "removed", "taken")

    def __init__(self, removed: dict[tuple[str, int], int], recovering: bool, alloc_after: float) -> None:
        self.removed = removed          # removals the owner had not confirmed: reports of them are refused
        self.recovering = recovering
        self.alloc_after = alloc_after  # when the segment takes new objects, once every report is in
        self.pos = 0                    # where the last object taken ends (reports come in rising offsets)
        self.taken: list[tuple[int, str]] = []   # (generation, key) of the objects counted: a min-heap


class GvaSlots:
    """The pool's numbers for segments in GVAs (``SegmentInfo.gva_slot``, 14 bits): issued at join, the
    same in every process, so a GVA names one object in all of them. A number freed by a segment that
    left is issued again only after every number never issued, then the longest free first."""

    LAST = (1 << 14) - 1

    def __init__(self) -> None:
        self.next = 1
        self.freed: collections.deque[int] = collections.deque()

    def issue(self) -> int:
        if self.next <= self.LAST:
            self.next += 1
            return self.next - 1
        return self.freed.popleft() if self.freed else 0

    def free(self, slot: int) -> None:
        if slot:
            self.freed.append(slot)


class Reports:
    """Segments and their reported objects joining ``ObjectTable`` (a mixin; the table sets the state)."""

    objects: dict[str, Obj]
    segments: dict[int, Segment]
    counters: Counters
    kept_of: dict[int, list[int]]
    unconfirmed: dict[int, dict[tuple[str, int], int]]
    reporting: dict[int, Reporting]
    member_quota: tuple[int, int]
    gva_slots: GvaSlots
    serials: int
    _next_gen: int

    listener: Callable[[bool, Obj, Sequence[Location]], None] | None

    if TYPE_CHECKING:   # the table's other mixins'
        def _unlink(self, obj: Obj, now: float = 0.0, keep_space: bool = False) -> None: ...
        def _mark(self, obj: Obj) -> None: ...
        def writer_slot_of(self, writer: int) -> int: ...
        def count_kept(self, writer: int, obj: Obj) -> None: ...

    def add_segment(self, info: SegmentInfo, reports: Iterable[ObjectReport] = (),
                    alloc_after: float = 0.0, recovering: bool = True, now: float = 0.0,
                    more: bool = False) -> list[ObjectReport]:
        """Add a segment (with the objects its owner reports after a MetaService restart, or after it
        was declared dead and re-joins). ``more``: further reports follow (``report``, a bounded batch
        a request); the segment takes no new object until the last (its unreported space is unknown).

        The newest generation of a key wins, whatever order the members re-join in (generations
        order writes across MetaService lifetimes and leader terms: ``meta/generations.py``):
        * a report of the table's generation (and size) is one more replica of that object;
        * a report of a newer generation than the table's committed object means the key was
          written again after that object (a remove and a re-put the other holder never heard of):
          the table's object is dropped (its owners are told to forget it, its space is freed once
          its lease ends) and the report is taken;
        * a report of an older generation, or of a key whose put is in flight, is refused.
        ``recovering``: the table is being rebuilt from the members' reports (a MetaService start):
        every replica reported counts. Otherwise a copy of an object that already holds as many
        replicas as asked for (re-replication replaced it meanwhile) is surplus and refused.
        A report that matches a removal this segment's owner had not confirmed when it was declared
        dead (``unconfirmed``) is refused: that object was removed. So is one that overlaps an object
        reported before it (reports are taken in rising offsets). A recovered object counts against the
        member whose segment holds it (``member_quota``): past the quota the oldest generations it
        reported give way to newer ones (``_room``).
        Returns the reports that were refused (their owner is told to forget them).
        """
        info = msgspec.structs.replace(info, gva_slot=self.gva_slots.issue())
        state = Reporting(self.unconfirmed.pop(info.segment_id, {}), recovering, alloc_after)
        seg = Segment(info, Allocator.building(info.size), self.objects, REPORTING if more else alloc_after)
        self.serials += 1
        seg.serial = self.serials
        self.segments[info.segment_id] = seg
        refused = self._take_reports(seg, state, reports, now)
        if more:
            self.reporting[info.segment_id] = state
        else:
            seg.allocator.built(state.pos)
        return refused

    def report(self, segment_id: int, reports: Iterable[ObjectReport], last: bool, now: float) -> list[ObjectReport]:
        """More of a re-joining segment's objects (``add_segment`` with ``more``); ``last``: the final
        batch: the segment takes new objects from then on (after the grace it joined with). Raises
        InvalidParameter for a segment that is not reporting."""
        state, seg = self.reporting.get(segment_id), self.segments.get(segment_id)
        if state is None or seg is None:
            raise errors.InvalidParameter(f"segment {segment_id} is not reporting objects (it joined with "
                                          f"all of them, or re-joined since)")
        refused = self._take_reports(seg, state, reports, now)
        if last:
            del self.reporting[segment_id]
            seg.allocator.built(state.pos)
            if seg.alloc_after == REPORTING:   # (a drain that started meanwhile keeps it closed)
                seg.alloc_after = state.alloc_after
        return refused

    def _take_reports(self, seg: Segment, state: Reporting, reports: Iterable[ObjectReport],
                      now: float) -> list[ObjectReport]:
        sid = seg.info.segment_id
        refused: list[ObjectReport] = []
        for r in sorted(reports, key=lambda r: r.offset):
            cur = self.objects.get(r.key)
            newer = cur is not None and cur.committed and r.generation > cur.generation
            same = cur is not None and (cur.committed and cur.generation == r.generation and cur.size == r.size
                                        and (state.recovering or len(cur.locations) < cur.replicas)
                                        and all(loc.segment_id != sid for loc in cur.locations))
            if state.removed.get((r.key, r.offset)) == r.generation or not (cur is None or newer or same):
                refused.append(r)
                continue
            end = seg.allocator.take(state.pos, r.offset, footprint(r.size))
            if end is None:
                logger.warning("segment %d reported %r at offset %d, overlapping an object reported before "
                               "it or past the segment: refused", sid, r.key, r.offset)
                refused.append(r)
                continue
            state.pos = end
            if newer and cur is not None:
                logger.info("segment %d reports a newer generation of %r than the table's %d: that older "
                            "object is dropped", sid, cur.key, cur.generation)
                self.counters.superseded += 1
                self._unlink(cur, now)
            loc = Location(sid, r.offset)
            if not same or cur is None:
                if not self._room(sid, state, r, now):
                    seg.allocator.free_range(r.offset, footprint(r.size))
                    refused.append(r)
                    continue
                slot = self.writer_slot_of(sid)   # counted against the member whose segment holds it
                cur = new_obj(r.key, r.size, r.generation, [loc], r.checksum, writer_slot=slot)
                self.objects[r.key] = cur
                if slot:
                    self.count_kept(sid, cur)
                    heapq.heappush(state.taken, (r.generation, r.key))
                self._next_gen = max(self._next_gen, r.generation + 1)
            else:
                cur.locations = [*cur.locations, loc]
            if self.listener is not None:   # in the pool again: KV events say so, as for a commit
                self.listener(True, cur, [loc])
            cur.replicas = max(cur.replicas, len(cur.locations))  # recovered: as many as were reported
            self._mark(cur)   # a holder declared dead that re-joins gives the object its replica back
            seg.lru[cur.key] = cur
        return refused

    def _room(self, sid: int, state: Reporting, r: ObjectReport, now: float) -> bool:
        """May the member keep one more object of ``r.size`` bytes (``member_quota``)? At its quota, the
        oldest objects (lowest generations: written longest ago) it recovered in this join make room
        for a newer one, so what survives is what was written last; False: ``r`` is older than all."""
        max_objects, max_bytes = self.member_quota
        if max_bytes and r.size > max_bytes:
            return False
        while True:
            kept = self.kept_of.get(sid, (0, 0))
            if not ((max_objects and kept[0] >= max_objects) or (max_bytes and kept[1] + r.size > max_bytes)):
                return True
            while state.taken:
                g, k = state.taken[0]
                oldest = self.objects.get(k)
                if oldest is not None and oldest.committed and oldest.generation == g:
                    break
                heapq.heappop(state.taken)   # removed or replaced since
            else:
                return False
            if g >= r.generation:
                return False
            heapq.heappop(state.taken)
            self.counters.evictions += 1
            self.counters.evicted_bytes += oldest.size
            self._unlink(oldest, now)
