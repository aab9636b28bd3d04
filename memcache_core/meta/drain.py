"""Draining a segment: its committed objects move to other segments before its owner leaves.

The MetaService plans and the segment's owner copies: the owner holds the bytes in its own memory, so
it pushes each object to its target with the ordinary put machinery (shared memory or the target's
TCP data server, the checksum computed while copying), then reports. A drain starts with the admin
route ``POST /drain/<segment_id>`` (the owner learns it on its next heartbeat) or when the owner
itself asks before it leaves (``DrainNext``).

Invariants:

* A draining segment takes no new object from the moment the drain starts (``alloc_after`` = inf).
* A move reserves its target space (allocated, not in the table): until the owner reports, the object
  is readable at its source only. Targets: segments that take new objects and hold no replica of the
  object, hosts holding no replica first; one that stays under the high-water mark, in ``spread``
  order (the freer by ratio of two random picks), else one where evicting objects colder than the
  moved one makes room (``placement.copy_target``, ``room.py``: never a hotter or a leased one). So a
  drain keeps the hottest objects, most recently used first, as long as the pool has colder ones.
* A move commits only if the object is still the one planned (same generation, the same source and
  target segments, the target's owner still heartbeating) and the bytes the owner copied have the committed checksum. Then the target
  replaces the source among the object's locations, with a new generation and the carried checksum,
  and only after that is the source space released (after the readers' leases end).
* A move that fails or is refused gives its target space back (kept out of use until the target's
  fence rotated when its writer may still be copying); the object is planned again to another target, at most ``MAX_ATTEMPTS`` times.
* An object no segment has room for (free, or held by colder objects) is dropped at once and counted (unless room may come soon:
  members re-joining a MetaService that just started, or a segment in its re-join grace); so is
  what remains in the segment when its owner leaves. A drain ends ``done`` (segment empty), ``timed_out`` or ``left``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from .. import errors
from .. import protocol as p
from ..layout import footprint
from . import validate
from .objects import new_obj
from .placement import copy_target
from .table import Obj, ObjectTable, Segment

MAX_ATTEMPTS = 3                 # copies of one object that may fail before it is dropped
BATCH_BYTES = 64 << 20           # one DrainNext plans at most this many payload bytes
BATCH_OBJECTS = 1024             # ... and this many objects
HISTORY = 64                     # finished drains of segments that left, kept for the admin routes


@dataclasses.dataclass(eq=False, slots=True)
class Move:
    key: str
    size: int
    generation: int              # the committed object's, when planned
    checksum: int
    source_offset: int
    new_generation: int
    target: Segment
    target_offset: int
    deadline: float


@dataclasses.dataclass(eq=False)
class Drain:
    segment_id: int
    segment: Segment
    reason: str                  # "admin" (POST /drain) or "owner" (asked by the owner: leaving, re-joined)
    started: float
    deadline: float
    started_at: float = dataclasses.field(default_factory=time.time)
    state: str = "draining"      # draining, done, timed_out, left
    ended: float = 0.0
    moves: dict[str, Move] = dataclasses.field(default_factory=dict)
    attempts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    avoid: set[int] = dataclasses.field(default_factory=set)   # targets a copy to failed
    moved_objects: int = 0
    moved_bytes: int = 0
    dropped_objects: int = 0
    dropped_bytes: int = 0
    failed_moves: int = 0

    def snapshot(self, now: float) -> dict[str, Any]:
        seg = self.segment
        return {"segment_id": self.segment_id, "state": self.state, "reason": self.reason,
                "started_at": self.started_at, "elapsed_s": round((self.ended or now) - self.started, 3),
                "timeout_s": round(self.deadline - self.started, 3),
                "objects_left": len(seg.lru) if self.state != "left" else 0,
                "moves_in_flight": len(self.moves), "moved_objects": self.moved_objects,
                "moved_bytes": self.moved_bytes, "dropped_objects": self.dropped_objects,
                "dropped_bytes": self.dropped_bytes, "failed_moves": self.failed_moves}


@dataclasses.dataclass
class Totals:
    moved_objects: int = 0
    moved_bytes: int = 0
    dropped_objects: int = 0
    dropped_bytes: int = 0
    failed_moves: int = 0


class Drains:
    """Every drain of one MetaService; called under the MetaService lock with ``now`` passed in."""

    def __init__(self, table_of: Callable[[], ObjectTable], timeout_s: float, move_timeout_s: float,
                 answering: Callable[[int, float], bool] = lambda sid, now: True, settle_s: float = 0.0,
                 settle_until: float = 0.0) -> None:
        self._table_of = table_of          # the MetaService's table, which an HA leader change replaces
        self.table = table_of()
        self.settle_s = settle_s
        self.settle_until = settle_until   # until then members may still be re-joining (a MetaService start)
        self.answering = answering     # is the segment's owner heartbeating? (a silent one may be dead)
        self.timeout_s = timeout_s
        self.move_timeout_s = move_timeout_s
        self.active: dict[int, Drain] = {}
        self.history: collections.deque[Drain] = collections.deque(maxlen=HISTORY)
        self.totals = Totals()

    # ---- starting, asking, reporting -----------------------------------------------------------------

    def _sync(self, now: float) -> None:
        """Follow the MetaService's table: a new one (an HA leader's reset) knows no drain yet (their
        owners ask again), and its members are still re-joining for a while."""
        t = self._table_of()
        if t is not self.table:
            self.table, self.settle_until = t, now + self.settle_s
            self.active.clear()

    def start(self, segment_id: int, now: float, timeout_s: float = 0.0, reason: str = "admin") -> Drain:
        """Start draining a segment (an unfinished drain of it goes on as it is)."""
        self._sync(now)
        seg = self.table.segments.get(segment_id)
        if seg is None:
            raise errors.KeyNotFound(f"segment {segment_id} is not in the pool")
        cur = self.active.get(segment_id)
        if cur is not None and cur.segment is seg and cur.state in ("draining", "done"):
            return cur
        seg.alloc_after = math.inf
        d = Drain(segment_id, seg, reason, now, now + (timeout_s or self.timeout_s))
        self.active[segment_id] = d
        return d

    def draining(self, segment_id: int | None) -> bool:
        d = self.active.get(segment_id) if segment_id is not None else None
        return d is not None and d.state == "draining"

    def next_batch(self, segment_id: int, timeout_ms: int, now: float) -> p.DrainBatch:
        """The owner asks for work: plan the next moves, or say the drain is over."""
        d = self.start(segment_id, now, timeout_ms / 1000.0, reason="owner")
        if d.state == "draining" and now >= d.deadline:
            self._end(d, "timed_out", now)
        if d.state != "draining":
            return p.DrainBatch([], done=True)
        moves = self._plan(d, now)
        if not moves and not d.moves and not d.segment.lru and not self._pending_in(d):
            self._end(d, "done", now)
            return p.DrainBatch([], done=True)
        return p.DrainBatch(moves, left_ms=int((d.deadline - now) * 1000))

    def report(self, segment_id: int, req: p.DrainDone, now: float) -> list[int]:
        """The owner copied (or failed to copy) its moves: commit each, or give its space back."""
        self._sync(now)
        d = self.active.get(segment_id)
        out = []
        for key, gen, checksum, ok in zip(req.keys, req.generations, req.checksums, req.ok, strict=True):
            m = d.moves.get(key) if d is not None else None
            if d is None or m is None or m.new_generation != gen:
                out.append(errors.STATE_MISMATCH)   # not a move of this drain (a MetaService restart)
                continue
            del d.moves[key]
            out.append(self._finish(d, m, ok, checksum, now))
        return out

    # ---- planning ------------------------------------------------------------------------------------

    def _plan(self, d: Drain, now: float) -> list[p.DrainMove]:
        keys, nbytes = [], 0
        for key in reversed(d.segment.lru):          # most recently used first
            if key in d.moves:
                continue
            keys.append(key)
            nbytes += d.segment.lru[key].size
            if len(keys) >= BATCH_OBJECTS or nbytes >= BATCH_BYTES:
                break
        out = []
        wait = self._room_may_come(now)
        for key in keys:
            obj = d.segment.lru.get(key)
            if obj is None:      # evicted to make room for a hotter one planned before it (``room.py``)
                continue
            src = next(loc for loc in obj.locations if loc.segment_id == d.segment_id)
            gen = self.table.issue_generation()          # (may fail, with HA: before any space is taken)
            placed = (copy_target(self.table, obj, d.avoid, self.answering, now, replacing=d.segment_id)
                      if d.attempts[key] < MAX_ATTEMPTS else False)
            if not isinstance(placed, tuple):
                if placed is False and (not wait or d.attempts[key] >= MAX_ATTEMPTS):
                    self._drop(d, obj, src, now)
                continue                                  # room may come: ask again later
            target, off = placed
            m = Move(key, obj.size, obj.generation, obj.checksum, src.offset, gen, target, off,
                     now + self.move_timeout_s)
            d.moves[key] = m
            out.append(p.DrainMove(key, obj.size, src.offset, obj.generation, obj.checksum, m.new_generation,
                                   p.Location(target.info.segment_id, off), target.fence))
        return out

    def _room_may_come(self, now: float) -> bool:
        """Could a target appear soon? Right after a MetaService start (members still re-joining), or
        while a re-joined segment waits out its grace or is held. Then an object without room waits, not dropped."""
        return now < self.settle_until or any(s.alloc_after < math.inf and (now < s.alloc_after or s.held)
                                              for s in self.table.segments.values())

    def _pending_in(self, d: Drain) -> bool:
        """Is a put into the segment still uncommitted (it would commit into the draining segment)?"""
        return self.table.pending > 0 and any(
            not o.committed and any(loc.segment_id == d.segment_id for loc in o.locations)
            for o in self.table.objects.values())

    # ---- finishing moves -------------------------------------------------------------------------------

    def _finish(self, d: Drain, m: Move, ok: bool, checksum: int, now: float) -> int:
        t = self.table
        obj = t.objects.get(m.key)
        src = p.Location(d.segment_id, m.source_offset)
        tid = m.target.info.segment_id
        live = t.segments.get(d.segment_id) is d.segment and t.segments.get(tid) is m.target
        same = (obj is not None and obj.committed and obj.generation == m.generation and src in obj.locations
                and all(loc.segment_id != tid for loc in obj.locations))   # (a repair may have put a copy there)
        silent = not self.answering(tid, now)   # the target's owner may be dead: the copy would die with it
        if not ok or silent or not live or not same:
            self._release_target(m, now, quarantine=False)
            if not ok or silent:                  # plan it again, on another target
                d.failed_moves += 1
                self.totals.failed_moves += 1
                d.attempts[m.key] += 1
                if not ok:                        # (a silent one is skipped only while it stays silent)
                    d.avoid.add(tid)
            return errors.ERROR if not ok or silent else errors.STATE_MISMATCH
        assert obj is not None
        if m.checksum and checksum != m.checksum:    # the source bytes are not the committed ones
            self._release_target(m, now, quarantine=False)
            t.corrupt(m.key, m.generation, now)
            self._count_dropped(d, m.size)
            return errors.CHECKSUM_MISMATCH
        if d.segment.lru.get(obj.key) is obj:   # out of the source's LRU list before the location goes
            del d.segment.lru[obj.key]
        obj.locations = [p.Location(m.target.info.segment_id, m.target_offset) if loc == src else loc
                         for loc in obj.locations]
        obj.set_version(m.new_generation, m.checksum or checksum)
        m.target.lru[m.key] = obj
        self._release(d.segment, obj, src, m.generation, m.checksum, now)
        d.moved_objects += 1
        d.moved_bytes += m.size
        self.totals.moved_objects += 1
        self.totals.moved_bytes += m.size
        return errors.SUCCESS

    def _release(self, seg: Segment, obj: Obj, loc: p.Location, generation: int, checksum: int,
                 now: float) -> None:
        """Free one location of an object that lives on elsewhere (or left), after readers' leases."""
        if seg.lru.get(obj.key) is obj:
            del seg.lru[obj.key]
        seg.record_removed(p.ObjectReport(obj.key, loc.offset, obj.size, generation, checksum))
        if obj.lease_until > now:
            self.table.doomed.append(new_obj(obj.key, obj.size, generation, [loc], checksum,
                                             lease_until=obj.lease_until))
        else:
            seg.allocator.free_range(loc.offset, footprint(obj.size))

    def _release_target(self, m: Move, now: float, quarantine: bool) -> None:
        self.table.release_reserved(m.target, m.key, m.size, m.new_generation, m.checksum, m.target_offset,
                                    quarantine, now)

    def _drop(self, d: Drain, obj: Obj, src: p.Location, now: float) -> None:
        if len(obj.locations) == 1:
            self.table.drop(obj, now)
        else:                                        # the other replicas keep the object
            self._release(d.segment, obj, src, obj.generation, obj.checksum, now)   # (its LRU list first)
            obj.locations = [loc for loc in obj.locations if loc != src]
        self._count_dropped(d, obj.size)

    def _count_dropped(self, d: Drain, size: int, n: int = 1) -> None:
        d.dropped_objects += n
        d.dropped_bytes += size
        self.totals.dropped_objects += n
        self.totals.dropped_bytes += size

    # ---- ends ------------------------------------------------------------------------------------------

    def _end(self, d: Drain, state: str, now: float) -> None:
        d.state, d.ended = state, now

    def segment_left(self, segment_id: int, now: float) -> None:
        """The segment leaves the pool (before the table drops it): what is still in it is dropped."""
        self._sync(now)
        d = self.active.pop(segment_id, None)
        if d is None:
            return
        for m in d.moves.values():
            self._release_target(m, now, quarantine=True)
        d.moves.clear()
        if d.segment is self.table.segments.get(segment_id):
            left = list(d.segment.lru.values())
            self._count_dropped(d, sum(o.size for o in left), len(left))
        if d.state == "draining":
            self._end(d, "left", now)
        self.history.append(d)

    def housekeeping(self, now: float) -> None:
        """End drains past their deadline; give back the space of moves nobody reported in time."""
        self._sync(now)
        for d in self.active.values():
            if d.state == "draining" and now >= d.deadline:
                self._end(d, "timed_out", now)
            for key in [k for k, m in d.moves.items() if m.deadline <= now]:
                self._release_target(d.moves.pop(key), now, quarantine=True)
                d.attempts[key] += 1

    # ---- requests -------------------------------------------------------------------------------------

    def handle(self, req: p.DrainNext | p.DrainDone, segment_id: int | None, now: float) -> p.Reply:
        """``DrainNext`` / ``DrainDone`` of a member, acting on its own segment only."""
        if segment_id is None:
            return p.Error(errors.INVALID_PARAM, "drain: this member holds no segment")
        if isinstance(req, p.DrainNext):
            validate.timeout_ms(req.timeout_ms)
            return self.next_batch(segment_id, req.timeout_ms, now)
        validate.batch(req.keys, req.generations, req.checksums, req.ok)
        validate.generations(req.generations)
        validate.checksums(req.checksums)
        return p.Codes(self.report(segment_id, req, now))

    # ---- views -----------------------------------------------------------------------------------------

    def find(self, segment_id: int, now: float) -> dict[str, Any] | None:
        d = self.active.get(segment_id) or next((h for h in reversed(self.history)
                                                 if h.segment_id == segment_id), None)
        return d.snapshot(now) if d is not None else None

    def in_progress(self, now: float) -> list[dict[str, Any]]:
        """The drains still running, as ``/drain/<id>`` shows each (the status page lists them)."""
        return [d.snapshot(now) for d in self.active.values() if d.state == "draining"]

    def all(self, now: float) -> list[dict[str, Any]]:
        return [d.snapshot(now) for d in [*self.history, *self.active.values()]]

    def stats(self) -> dict[str, int]:
        """The drain figures the metrics show (under the MetaService lock, with the snapshot)."""
        t = self.totals
        return {"draining_segments": sum(d.state == "draining" for d in self.active.values()),
                "moved_objects": t.moved_objects, "moved_bytes": t.moved_bytes,
                "dropped_objects": t.dropped_objects, "dropped_bytes": t.dropped_bytes,
                "failed_moves": t.failed_moves}
