"""Re-replication: objects holding fewer replicas than their put asked for get copies again.

An object loses a replica when its holder dies or leaves without a drain, or when a reader finds
that copy corrupt; a put placed on fewer segments than it asked for (the pool had too few with
room) starts out short. While one replica lives, the MetaService plans a copy of it and the
holder's owner makes it: it pushes the bytes from its own segment to space reserved in another
segment, with the ordinary put machinery and the checksum computed while copying (as a drain's
move; ``local/drain.py``), and reports (``RepairDone``). Readers see the new replica only once the
MetaService has checked that report and added it to the object's locations.

Invariants:

* A copy comes from a holder whose owner answers and whose segment is not being drained (the drain
  moves that replica; the object is repaired from where it lands). It goes to space reserved by
  ``placement.copy_target``: a segment that takes new objects and holds no replica, hosts without a
  replica first; one under the high-water mark in ``spread`` order (freer by ratio, with randomness
  from the OS: never all onto the first segment to join), else, when the survivors are full, one
  where evicting objects colder than this one makes room (``room.py``: never a hotter or leased one).
* Repair copies are spread over the segments with room, whenever they joined: the segment holding
  each copy a repair made is remembered (``made``), and while one holds two more than a segment with
  room, one moves there (``Copy.replaces``: a copy from its holder that, once checked, replaces the
  holder's replica), never onto a segment or host holding another replica; repairs come first.
* The copy carries the object's own generation and checksum in its header: it is a replica, so a
  MetaService restarted later recovers it as one.
* A copy is added only if the object is still the one planned (committed, same generation, the
  source still among its locations, the target not a holder yet, the target's owner answering), still
  short of replicas (a holder declared dead may have re-joined with its copy meanwhile) and its
  checksum is the committed one. A source that fails its checksum is a corrupt replica: it is
  dropped as a reader's report would drop it. Otherwise the reserved space is given back
  (out of use until the target's fence rotated when the copy may still be running: the holder left,
  or never reported in time).
* One copy per object at a time; at most ``IN_FLIGHT_OBJECTS`` objects and ``IN_FLIGHT_BYTES``
  bytes in flight in the pool (repairs yield to the engines' own traffic). An object whose copy
  failed rests ``REST_S`` before it is planned again.
* Nothing is planned while members may still be re-joining a MetaService that just started: the
  replicas they report would be copied twice. After that, a member declared dead that re-joins
  with a copy of an object repaired meanwhile has that copy refused as surplus (its space is free
  again, its owner told to forget it): the object keeps the replica count its put asked for.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator

from .. import errors
from .. import protocol as p
from ..layout import footprint
from . import validate
from .allocator import aligned
from .placement import copy_takers, copy_target
from .table import ObjectTable, Segment

MADE = 1 << 16                  # repair copies remembered per segment (the oldest forgotten first)
IN_FLIGHT_OBJECTS = 1024        # copies planned and not reported yet, in the whole pool
IN_FLIGHT_BYTES = 256 << 20     # ... and their payload bytes
SCAN = 1024                     # under-replicated objects looked at per housekeeping pass
GIVE_UP = 64                    # ... ending it after this many in a row found no room
REST_S = 10.0                   # an object whose copy failed is not planned again before this


@dataclasses.dataclass(eq=False, slots=True)
class Copy:
    key: str
    size: int
    generation: int
    checksum: int
    source: Segment
    source_offset: int
    target: Segment
    target_offset: int
    deadline: float
    handed_out: bool = False     # the holder has it (its copy may be running)
    replaces: bool = False       # a spreading move: the copy replaces the source replica (``_spread``)

    def move(self) -> p.DrainMove:
        return p.DrainMove(self.key, self.size, self.source_offset, self.generation, self.checksum,
                           self.generation, p.Location(self.target.info.segment_id, self.target_offset),
                           self.target.fence)


@dataclasses.dataclass
class Totals:
    repaired_objects: int = 0
    repaired_bytes: int = 0
    failed_copies: int = 0
    spread_objects: int = 0      # repair copies moved to a segment holding fewer of them


class Repairs:
    """Re-replication of one MetaService; called under its lock with ``now`` passed in."""

    def __init__(self, table_of: Callable[[], ObjectTable], copy_timeout_s: float,
                 answering: Callable[[int, float], bool], draining: Callable[[int], bool],
                 settle_s: float, settle_until: float, enabled: bool = True) -> None:
        self._table_of = table_of        # the MetaService's table, which an HA leader change replaces
        self.table = table_of()
        self.copy_timeout_s = copy_timeout_s
        self.answering = answering
        self.draining = draining
        self.settle_s, self.settle_until = settle_s, settle_until
        self.enabled = enabled
        self.copies: dict[str, Copy] = {}                            # key -> its copy in flight
        self.queued: dict[int, list[Copy]] = collections.defaultdict(list)   # source segment -> not handed out
        self.resting: dict[str, float] = {}                          # key -> not planned before then
        self.made: dict[int, dict[str, int]] = {}   # segment -> {key: generation} of the repair copies it holds
        self.in_flight_bytes = 0
        self.totals = Totals()

    def _sync(self, now: float) -> None:
        """Follow the MetaService's table: a new one (an HA leader's reset) has no copy planned."""
        t = self._table_of()
        if t is not self.table:
            self.table, self.settle_until = t, now + self.settle_s
            self.copies.clear()
            self.queued.clear()
            self.resting.clear()
            self.made.clear()
            self.in_flight_bytes = 0

    def settling(self, now: float) -> bool:
        """May members still be re-joining a table that is being rebuilt (a start, a new HA leader)?"""
        self._sync(now)
        return now < self.settle_until

    # ---- planning --------------------------------------------------------------------------------

    def plan(self, now: float) -> None:
        """Plan copies of under-replicated objects, then moves that spread repair copies (a housekeeping
        pass), within the in-flight bounds."""
        self._sync(now)
        if not self.enabled or self.settling(now):
            return
        for key in [k for k, until in self.resting.items() if until <= now]:
            del self.resting[key]
        self._repair(now)
        self._spread(now)      # (after the repairs: they come first within the in-flight bounds)

    def _repair(self, now: float) -> None:
        """Plan a copy of each under-replicated object visited that has a source and a target."""
        t = self.table
        if not t.under:
            return
        takers, misses = copy_takers(t, now), 0
        for _ in range(min(SCAN, len(t.under)) if takers else 0):
            if misses >= GIVE_UP:                    # the pool has no room for copies now
                return
            if len(self.copies) >= IN_FLIGHT_OBJECTS or self.in_flight_bytes >= IN_FLIGHT_BYTES:
                return
            key, obj = next(iter(t.under.items()))
            t.under.move_to_end(key)                 # the next pass looks at the others first
            if key in self.copies or key in self.resting:
                continue
            sources = [t.segments[loc.segment_id] for loc in obj.locations
                       if self.answering(loc.segment_id, now) and not self.draining(loc.segment_id)]
            if not sources:
                continue
            placed = copy_target(t, obj, set(), self.answering, now, takers=takers)
            if not isinstance(placed, tuple):
                misses += 1
                continue                             # no room now: looked at again on a later pass
            misses = 0
            src = sources[0]
            src_off = next(loc.offset for loc in obj.locations if loc.segment_id == src.info.segment_id)
            c = Copy(key, obj.size, obj.generation, obj.checksum, src, src_off, *placed, now + self.copy_timeout_s)
            self.copies[key] = c
            self.queued[src.info.segment_id].append(c)
            self.in_flight_bytes += c.size

    def wanted(self, segment_id: int | None) -> bool:
        """Has the owner of this segment copies to make (told on its heartbeat)?"""
        return segment_id is not None and bool(self.queued.get(segment_id))

    def next_batch(self, segment_id: int, now: float) -> p.DrainBatch:
        """The holder asks: hand out its queued copies (an empty batch: nothing to do now)."""
        self._sync(now)
        batch = self.queued.pop(segment_id, [])
        for c in batch:
            c.handed_out = True
            c.deadline = now + self.copy_timeout_s
        return p.DrainBatch([c.move() for c in batch], done=not batch)

    def _spread(self, now: float) -> None:
        """Move repair copies from the segment holding the most of them to one with room holding the
        fewest (a provider that joined after the repair), until no two differ by more than one. Each
        move is a copy from that holder that replaces its replica (``Copy.replaces``)."""
        t = self.table
        for sid in [sid for sid in self.made if sid not in t.segments]:
            del self.made[sid]
        if not self.made:
            return
        counts = collections.Counter({sid: len(keys) for sid, keys in self.made.items()})
        for m in self.copies.values():   # moves in flight count where they go
            if m.replaces:
                counts[m.source.info.segment_id] -= 1
                counts[m.target.info.segment_id] += 1
        sources = [t.segments[sid] for sid in self.made
                   if self.answering(sid, now) and not self.draining(sid)]
        roomy = [s for s in copy_takers(t, now) if self.answering(s.info.segment_id, now)]
        movable: dict[tuple[int, int], Iterator[Copy]] = {}   # (source, target) -> its next moves
        while sources and roomy and len(self.copies) < IN_FLIGHT_OBJECTS and self.in_flight_bytes < IN_FLIGHT_BYTES:
            src = max(sources, key=lambda s: counts[s.info.segment_id])
            fewer = sorted((s for s in roomy if counts[src.info.segment_id] - counts[s.info.segment_id] > 1),
                           key=lambda s: counts[s.info.segment_id])
            c: Copy | None = None
            for dst in fewer:
                pair = (src.info.segment_id, dst.info.segment_id)
                if pair not in movable:
                    movable[pair] = self._movable(src, dst, now, counts)
                c = next(movable[pair], None)
                if c is not None:
                    break
            if c is None:                # even, or nothing of src can go where there are fewer
                sources.remove(src)
                continue
            counts[src.info.segment_id] -= 1
            counts[c.target.info.segment_id] += 1

    def _movable(self, src: Segment, dst: Segment, now: float, counts: collections.Counter[int]) -> Iterator[Copy]:
        """Plan moves of ``src``'s repair copies to ``dst``, one per ``next`` (room without eviction, no
        replica there, on a host holding no other replica); copies no longer there are forgotten (and
        no longer counted)."""
        t, sid = self.table, src.info.segment_id
        made = self.made[sid]
        for key, gen in list(made.items()):
            obj = t.objects.get(key)
            here = next((loc for loc in obj.locations if loc.segment_id == sid), None) if obj is not None else None
            if obj is None or not obj.committed or obj.generation != gen or here is None:
                if made.pop(key, None) is not None:   # removed, evicted, moved or written again since
                    counts[sid] -= 1
                continue
            if key in self.copies or key in self.resting:
                continue
            others = {t.segments[loc.segment_id].info.host_id for loc in obj.locations
                      if loc.segment_id != sid and loc.segment_id in t.segments}
            need = aligned(footprint(obj.size))
            if (any(loc.segment_id == dst.info.segment_id for loc in obj.locations)
                    or (dst.info.host_id in others and src.info.host_id not in others)
                    or dst.allocator.used + need > t.high * dst.allocator.size):
                continue
            off = dst.allocator.alloc(need)
            if off is None:
                return
            c = Copy(key, obj.size, obj.generation, obj.checksum, src, here.offset, dst, off,
                     now + self.copy_timeout_s, replaces=True)
            self.copies[key] = c
            self.queued[sid].append(c)
            self.in_flight_bytes += c.size
            yield c

    # ---- reports ---------------------------------------------------------------------------------

    def report(self, segment_id: int, req: p.RepairDone, now: float) -> list[int]:
        self._sync(now)
        out = []
        for key, gen, checksum, ok in zip(req.keys, req.generations, req.checksums, req.ok, strict=True):
            c = self.copies.get(key)
            if c is None or not c.handed_out or c.source.info.segment_id != segment_id or c.generation != gen:
                out.append(errors.STATE_MISMATCH)    # not a copy asked of this member (a restart, a replay)
                continue
            self._forget(c)
            out.append(self._finish(c, ok, checksum, now))
        self.plan(now)   # the holder asks again at once: have its next copies ready, not a pass later
        return out

    def _finish(self, c: Copy, ok: bool, checksum: int, now: float) -> int:
        t = self.table
        obj = t.objects.get(c.key)
        tid, sid = c.target.info.segment_id, c.source.info.segment_id
        live = t.segments.get(tid) is c.target and t.segments.get(sid) is c.source
        holders = {loc.segment_id for loc in obj.locations} if obj is not None else set()
        src = p.Location(sid, c.source_offset)
        same = (obj is not None and obj.committed and obj.generation == c.generation
                and src in obj.locations and tid not in holders
                and (c.replaces or len(obj.locations) < obj.replicas))   # (a holder that came back may have made it whole)
        silent = not self.answering(tid, now)   # the target's owner may be dead: the copy would die with it
        if not ok or silent or not live or not same:
            self._release_target(c, now)
            if not ok or silent:
                self.totals.failed_copies += 1
                self.resting[c.key] = now + REST_S
            return errors.ERROR if not ok else errors.STATE_MISMATCH
        assert obj is not None
        if c.checksum and checksum != c.checksum:   # the holder's bytes are not the committed ones
            self._release_target(c, now)
            t.corrupt(c.key, c.generation, now, sid)
            return errors.CHECKSUM_MISMATCH
        if c.replaces:
            t.move_replica(obj, src, p.Location(tid, c.target_offset), now)
            self.made.get(sid, {}).pop(c.key, None)
            self.totals.spread_objects += 1
        else:
            t.add_replica(obj, p.Location(tid, c.target_offset))
            self.totals.repaired_objects += 1
            self.totals.repaired_bytes += c.size
        made = self.made.setdefault(tid, {})
        made[c.key] = c.generation
        if len(made) > MADE:
            del made[next(iter(made))]
        return errors.SUCCESS

    # ---- ends ------------------------------------------------------------------------------------

    def _forget(self, c: Copy) -> None:
        if self.copies.get(c.key) is c:
            del self.copies[c.key]
            self.in_flight_bytes -= c.size

    def _unqueue(self, c: Copy) -> None:
        sid = c.source.info.segment_id
        q = self.queued[sid]
        q.remove(c)
        if not q:
            del self.queued[sid]

    def _release_target(self, c: Copy, now: float, quarantine: bool = False) -> None:
        """Give the reserved space back (after a while when the copy may still be writing into it)."""
        self.table.release_reserved(c.target, c.key, c.size, c.generation, c.checksum, c.target_offset,
                                    quarantine, now)

    def segment_left(self, segment_id: int, now: float) -> None:
        """A segment leaves the pool (before the table drops it): copies from or to it end."""
        self._sync(now)
        self.queued.pop(segment_id, None)
        self.made.pop(segment_id, None)
        for c in [c for c in self.copies.values()
                  if segment_id in (c.source.info.segment_id, c.target.info.segment_id)]:
            self._forget(c)
            if not c.handed_out and c.source.info.segment_id != segment_id:
                self._unqueue(c)
            self._release_target(c, now, quarantine=c.handed_out)

    def housekeeping(self, now: float) -> None:
        """Give back the space of copies nobody made in time, then plan more."""
        self._sync(now)
        for c in [c for c in self.copies.values() if c.deadline <= now]:
            self._forget(c)
            if not c.handed_out:
                self._unqueue(c)
            self._release_target(c, now, quarantine=c.handed_out)
            self.totals.failed_copies += 1
            self.resting[c.key] = now + REST_S
        self.plan(now)

    # ---- requests and views ------------------------------------------------------------------------

    def handle(self, req: p.RepairNext | p.RepairDone, segment_id: int | None, now: float) -> p.Reply:
        """``RepairNext`` / ``RepairDone`` of a member, about copies from its own segment only."""
        if segment_id is None:
            return p.Error(errors.INVALID_PARAM, "repair: this member holds no segment")
        if isinstance(req, p.RepairNext):
            return self.next_batch(segment_id, now)
        validate.batch(req.keys, req.generations, req.checksums, req.ok)
        validate.generations(req.generations)
        validate.checksums(req.checksums)
        return p.Codes(self.report(segment_id, req, now))

    def stats(self) -> dict[str, int]:
        t = self.totals
        return {"repairs_in_flight": len(self.copies), "repaired_objects": t.repaired_objects,
                "repaired_bytes": t.repaired_bytes, "repair_failed_copies": t.failed_copies,
                "repair_spread_objects": t.spread_objects}
