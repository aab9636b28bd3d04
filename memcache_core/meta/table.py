"""The object table: key -> object, the segments that hold them, LRU eviction and read leases.

Invariants (docs/design.md explains each):
* PENDING objects (allocated, not committed) are invisible to lookup and exist.
* A leased object is never evicted and its space is never reused until the lease ends; removing a
  leased object hides it at once and frees its space when the lease ends.
* Exist does not lease and does not touch LRU order.
* Eviction frees least-recently-used committed, unleased objects: the pool's, across segments, when a
  put finds no segment with room under its high-water mark (``space.py``); a segment's own when it is
  above its high-water mark, until it is at its low-water mark. An object's ``lease_until`` is the end
  of its last read lease, or its commit time: when it was last used.
* A key whose put is PENDING is neither free nor present: a second writer is told so
  (WRITE_IN_PROGRESS), never that its put succeeded.
* Space holds the object's header and payload (``layout.footprint``); sizes here are payload sizes.
* Replicas of an object are on distinct segments, on distinct hosts when the pool has them; an object
  keeps living while one replica is left. ``under`` holds the committed objects with fewer replicas
  than their put asked for (placed partially, or a replica's segment died or was corrupt); re-replication
  (``repair.py``) copies them again.
Time is passed in (``now``, monotonic seconds) so the logic is testable without sleeping.

The data model (``Obj``, ``Segment``, ``Counters``) is in ``objects.py``, a segment's LRU list in ``lru.py``
(an object leaves a segment's list before it loses its location there); choosing segments, allocating,
evicting and freeing space in ``space.py``, get / exist / leases in ``lookups.py``, removals and taking
objects and replicas out in ``removals.py``, segments joining with their objects in ``reports.py`` (mixins
of ``ObjectTable``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .. import errors
from ..layout import footprint
from ..records import Location, ObjectReport
from . import generations
from .allocator import aligned
from .kept import WRITER_SLOTS, Kept
from .lookups import Lookups
from .objects import FIRST_SEGMENT, Counters, Extra, Obj, PendingObj, Segment, pack, with_checksum
from .removals import Removals
from .reports import GvaSlots, Reporting, Reports
from .space import STAMP_S, Space

logger = logging.getLogger(__name__)


MAX_UNCONFIRMED_SEGMENTS = 1024   # dead segments whose unconfirmed removals are kept (oldest forgotten first)
MAX_UNCONFIRMED_RECORDS = 1 << 16  # disk records removed while their owner was dead (oldest forgotten first)


class _Drawn:
    """An iterator's items, drawn only as far as some pass needs them and kept for the next passes."""

    def __init__(self, it: Iterator[Segment]) -> None:
        self._it = it
        self._seen: list[Segment] = []

    def __iter__(self) -> Iterator[Segment]:
        i = 0
        while True:
            if i == len(self._seen):
                nxt = next(self._it, None)
                if nxt is None:
                    return
                self._seen.append(nxt)
            yield self._seen[i]
            i += 1


class ObjectTable(Kept, Lookups, Removals, Reports, Space):
    def __init__(self, high: float, low: float, lease_ttl_s: float, pending_timeout_s: float,
                 first_generation: int) -> None:
        self.high, self.low = high / 100.0, low / 100.0
        self.lease_ttl_s = lease_ttl_s
        self.pending_timeout_s = pending_timeout_s
        self.objects: dict[str, Obj] = {}
        self.segments: dict[int, Segment] = {}
        self.doomed: list[Obj] = []     # removed while leased: space freed when the lease ends
        self.counters = Counters()
        self.pending = 0                # objects allocated, not committed (kept so /metrics needs no scan)
        self.pending_of: dict[int, list[int]] = {}   # writer -> [its pending objects, their bytes] (quotas)
        # writer -> [its committed objects in the table, their payload bytes] (``kept.py``); each such
        # writer has a slot its objects carry (``Obj.writer_slot``), given back when it holds none
        self.kept_of: dict[int, list[int]] = {}
        self.slot_of: dict[int, int] = {}       # writer -> its slot
        self.writer_in: dict[int, int] = {}     # slot -> writer
        self._free_slots = list(range(WRITER_SLOTS, 0, -1))
        # committed objects with fewer replicas than asked for, in the order re-replication visits them
        self.under: collections.OrderedDict[str, Obj] = collections.OrderedDict()
        # KV events: (stored?, object, the locations concerned); called before the table forgets them
        self.listener: Callable[[bool, Obj, Sequence[Location]], None] | None = None
        self._next_gen = first_generation   # the last generation issued (or seen in a report)
        # generations are issued at or below a ceiling reserved ahead (``meta/generations.py``): in
        # memory without HA (members carry it), in etcd with HA (``ha.GenerationReservation``)
        self.gen_ceiling = 0
        self.serials = 0   # segments added so far: each gets the next (``confirmed`` tells incarnations apart)
        self.reserve: Callable[[int, int], tuple[int, int]] = generations.in_memory
        # segment id -> {(key, offset): generation} of removals the owner had not confirmed (cleared the
        # header) when its segment left the table: if it re-joins with them, they are refused
        self.unconfirmed: collections.OrderedDict[int, dict[tuple[str, int], int]] = collections.OrderedDict()
        # (key, generation) of disk records a dead owner had not confirmed deleting (``removed_records``)
        self.unconfirmed_records: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self.disk_tiers: dict[int, Any] = {}          # segment id -> meta.disk.DiskTier
        self.disk_drops: dict[int, list[ObjectReport]] = {}   # records each tier should delete
        self.disk_wanted: dict[int, list[ObjectReport]] = {}  # records each tier should promote (meta/disk.py)
        self.promoting: dict[tuple[str, int], tuple[int, int, float, int]] = {}   # meta/disk.py
        self._lease_for: tuple[float, float] = (-1.0, 0.0)   # (now, lease end): one float per batch
        self._stamp_for = -1.0   # the commit time objects committed within ``STAMP_S`` of it share
        self.held: dict[str, dict[int, tuple[int, float]]] = {}   # GVA path's leases: key -> caller -> (gen, end)
        self.leases_of: dict[int, int] = {}   # caller -> how many of ``held``'s leases it has (a quota)
        self.gva_slots = GvaSlots()   # segments' numbers in GVAs (``reports.py``)
        self.reporting: dict[int, Reporting] = {}   # segments whose owner reports more objects
        self.member_quota = (0, 0)   # (member_max_objects, member_max_bytes) recovered objects count in
        self.lent: dict[str, tuple[int, Obj]] = {}   # objects another member leases (``kept.py``)
        self.lent_of: dict[int, list[int]] = {}      # writer -> [its lent objects, their bytes]

    # ---- segments -------------------------------------------------------------------------------

    def drop_segment(self, segment_id: int) -> int:
        """Forget a dead segment: its objects lose that replica, and vanish if it was the last."""
        seg = self.segments.get(segment_id)
        if seg is None:
            return 0
        if self.listener is not None:   # KV events: each copy there is removed (host still known here)
            for obj in list(self.objects.values()):
                copies = [loc for loc in obj.locations if loc.segment_id == segment_id]
                if copies and obj.committed:
                    self.listener(False, obj, copies)
        del self.segments[segment_id]
        self.reporting.pop(segment_id, None)
        self.gva_slots.free(seg.info.gva_slot)
        lost = 0
        gone = {(e.obj.key, e.obj.offset): e.obj.generation for e in seg.journal if not e.added and not e.disk}
        for e in seg.journal:   # disk records it never confirmed deleting: refused wherever they re-join
            if e.disk and e.seq > seg.acked:
                self.unconfirmed_records[(e.obj.key, e.obj.generation)] = None
        while len(self.unconfirmed_records) > MAX_UNCONFIRMED_RECORDS:
            self.unconfirmed_records.popitem(last=False)
        if gone:   # removals its owner never confirmed: refused if it re-joins with them (``add_segment``)
            self.unconfirmed[segment_id] = gone
            while len(self.unconfirmed) > MAX_UNCONFIRMED_SEGMENTS:
                self.unconfirmed.popitem(last=False)
        self.disk_tiers.pop(segment_id, None)
        self.disk_drops.pop(segment_id, None)
        self.disk_wanted.pop(segment_id, None)
        for obj in list(self.objects.values()):
            on_disk = obj.disk is not None and obj.disk[0] == segment_id
            if on_disk:
                obj.disk = None   # the provider is gone: so is its disk tier (it reports it again on re-joining)
            if any(loc.segment_id == segment_id for loc in obj.locations) or on_disk:
                obj.locations = [loc for loc in obj.locations if loc.segment_id != segment_id]
                if not obj.locations and obj.disk is None:
                    self._unlink(obj)
                    lost += 1
                else:
                    self._mark(obj)   # lives on in its other replicas
        self.doomed = [o for o in self.doomed if any(loc.segment_id in self.segments for loc in o.locations)]
        return lost

    # ---- put: alloc / commit / abort -------------------------------------------------------------

    def alloc(self, client_id: int, key: str, size: int, replicas: int, order: Iterable[int],
              now: float, preferred: Sequence[int] = ()) -> tuple[int, int, list[Location]]:
        """Reserve space for a new object. Returns (code, generation, locations); for a key already
        committed, OBJECT_ALREADY_EXISTS with that object's generation and locations.

        ``order`` is the placement policy's segment order (drawn lazily, as far as needed); the
        ``preferred`` segments are taken first whatever their host. Fewer segments with room than
        ``replicas``: the object is placed on those there are (partial placement, counted as
        under-replicated once committed); none: OUT_OF_MEMORY, or OVER_CAPACITY when it fits in none.
        """
        self.counters.allocs += 1
        cur = self.objects.get(key)
        if cur is not None:   # where a committed one lies: a writer of its host may know its owner dead
            return ((errors.OBJECT_ALREADY_EXISTS, cur.generation, cur.locations) if cur.committed
                    else (errors.WRITE_IN_PROGRESS, 0, []))
        if size <= 0:
            return errors.INVALID_PARAM, 0, []
        size_in_segment = footprint(size)
        self._reserve_ahead()   # (may fail, with HA: before any space is taken)
        accepts = lambda ids: (self.segments[s] for s in ids  # noqa: E731
                               if s in self.segments and self.segments[s].takes_new(now))
        candidates = _Drawn(accepts(order))
        chosen = self._choose(list(accepts(preferred)), candidates, replicas, size_in_segment, now)
        if not chosen:
            self.counters.alloc_failures += 1
            segs = list(candidates)
            too_big = segs and all(aligned(size_in_segment) > s.allocator.size for s in segs)
            return (errors.OVER_CAPACITY if too_big else errors.OUT_OF_MEMORY), 0, []
        self._next_gen += 1
        gen = self._next_gen
        locs = [Location(seg.info.segment_id, off) for seg, off in chosen]
        obj = PendingObj(key, pack(size, gen, 0, locs[0]), owner=client_id,
                         pending_deadline=now + self.pending_timeout_s)
        if len(locs) > 1 or replicas != 1:
            obj.more = Extra(replicas=replicas, rest=tuple(locs[1:]))
        self.objects[key] = obj
        self.pending += 1
        held = self.pending_of.setdefault(client_id, [0, 0])
        held[0] += 1
        held[1] += size * len(locs)
        return errors.SUCCESS, gen, locs

    def _settled(self, obj: Obj) -> None:
        """A pending object was committed or left the table: its writer's quota is given back."""
        held = self.pending_of.get(obj.owner)
        if held is not None:
            held[0] -= 1
            held[1] -= obj.size * len(obj.locations)
            if held[0] <= 0:
                del self.pending_of[obj.owner]

    def commit(self, client_id: int, key: str, generation: int, now: float, checksum: int = 0) -> int:
        obj = self.objects.get(key)
        if obj is None or obj.generation != generation or obj.owner not in (client_id, 0):
            return errors.STATE_MISMATCH  # aborted (timed out, writer declared dead), replaced, not ours
        if obj.committed:
            return errors.SUCCESS
        # the committed object replaces the pending one (its writer and deadline are no longer kept);
        # keyed by the object's own string: the request's is a copy
        self._settled(obj)
        writer = obj.owner
        slot = self.writer_slot_of(writer)
        used = self._stamp_for   # its time of use, as eviction compares across segments (``stamp`` unrolled)
        if not 0.0 <= now - used < STAMP_S:
            used = self._stamp_for = now
        obj = self.objects[obj.key] = Obj(obj.key, with_checksum(obj.packed, checksum, slot), used, obj.more)
        if slot:
            self.count_kept(writer, obj)
        self.pending -= 1
        if obj.more is None:   # one location, one replica asked for: never under-replicated
            self.segments[(obj.packed & FIRST_SEGMENT) - 1].lru.append(obj)
        else:
            for loc in obj.locations:
                self.segments[loc.segment_id].lru.append(obj)
            self._mark(obj)
        self.counters.commits += 1
        if self.listener is not None:
            self.listener(True, obj, obj.locations)
        return errors.SUCCESS

    def abort(self, client_id: int, key: str, generation: int) -> None:
        obj = self.objects.get(key)
        if obj is not None and obj.generation == generation and not obj.committed and obj.owner == client_id:
            self._unlink(obj)

    def reclaim(self, now: float, dead_clients: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Abort PENDING objects past their deadline or whose writer died; end expired leases."""
        n = 0
        for obj in [o for o in self.objects.values() if not o.committed
                    and (o.pending_deadline <= now or o.owner in dead_clients)]:
            # the writer may still be copying (frozen, not dead): its space stays out of use until the
            # segment's owner rotated its fence (``Segment.fence_out``)
            self._unlink(obj, keep_space=True)
            for loc in obj.locations:
                if (seg := self.segments.get(loc.segment_id)) is not None:
                    seg.fence_out(loc.offset, footprint(obj.size))
            n += 1
        self.counters.pending_reclaimed += n
        if self.doomed:
            still = []
            for obj in self.doomed:
                if obj.lease_until > now:
                    still.append(obj)
                else:
                    self._free_space(obj)
            self.doomed = still
        return n

    # ---- internals -----------------------------------------------------------------------------------

    @property
    def under_replicated(self) -> int:
        return len(self.under)

    # ---- for drains (meta/drain.py) ------------------------------------------------------------------

    def issue_generation(self) -> int:
        """A new generation, as an allocation gets (a drained object's copy at its new place)."""
        return self._issue()

    def bump_generation(self, seen: int) -> None:
        """Generations issued from now on are above ``seen`` (a reported object's, or the ceiling a
        re-joining member heard from a previous MetaService)."""
        self._next_gen = max(self._next_gen, seen)

    def _issue(self) -> int:
        """The next generation."""
        self._reserve_ahead()
        self._next_gen += 1
        return self._next_gen

    def _reserve_ahead(self, n: int = 0) -> None:
        """Reserve the next block when half of this one is used (or a report lifted the counter), or
        would be after ``n`` more generations."""
        if self._next_gen + n >= self.gen_ceiling - generations.BLOCK // 2:
            self._next_gen, self.gen_ceiling = self.reserve(self._next_gen, self.gen_ceiling)

    def reserve_for(self, n: int) -> None:
        """Reserve now what issuing ``n`` generations needs, so that a batch committing ``n`` objects
        cannot fail half-way (with HA a reservation may fail: it then fails before anything is placed)."""
        self._reserve_ahead(n)

    def alloc_in(self, seg: Segment, size_in_segment: int, now: float) -> int | None:
        """Space in one segment, evicting if needed (a promotion from its owner's disk tier)."""
        if seg.allocator.size < aligned(size_in_segment):
            return None
        return self._alloc_in(seg, size_in_segment, now, evict=True)

    def drop(self, obj: Obj, now: float) -> None:
        """Take a committed object out of the pool (a drain could not place it anywhere)."""
        self._unlink(obj, now)

    def release_reserved(self, seg: Segment, key: str, size: int, generation: int, checksum: int, offset: int,
                         quarantine: bool, now: float) -> None:
        """Give back space reserved for a copy that will not be added (its owner is told to forget a
        header written there); once the segment's fence rotated when the copy may still be writing into
        it (``Segment.fence_out``). A segment that left the pool took its space along: nothing to do."""
        if self.segments.get(seg.info.segment_id) is not seg:
            return
        seg.record_removed(ObjectReport(key, offset, size, generation, checksum))
        if quarantine:
            seg.fence_out(offset, footprint(size))
        else:
            seg.allocator.free_range(offset, footprint(size))

    # ---- for repairs (meta/repair.py) ----------------------------------------------------------------

    def add_replica(self, obj: Obj, loc: Location) -> None:
        """A committed object's new copy, made and checked, becomes one of its replicas."""
        obj.locations = [*obj.locations, loc]
        self.segments[loc.segment_id].lru[obj.key] = obj
        self._mark(obj)
        if self.listener is not None:   # KV events: the new replica is stored
            self.listener(True, obj, [loc])

