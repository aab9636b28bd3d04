"""The data model of the object table: an object (``Obj``, ``PendingObj``), a segment with its allocator,
LRU list and journal of removed objects (``Segment``), and the table's ``Counters``.

A million objects fill a table, so every byte counts (benchmarks/bench_meta_memory.py): an object is
four pointers and two LRU links (64 bytes) and one int that packs its size, generation, checksum and
first location (64 bytes), where separate int objects, a location list and a ``Location`` took ~300.
What few objects have (more replicas, a disk record) is in ``Extra``."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import msgspec

from ..fence import new_token
from ..records import Found, JournalEntry, Location, ObjectReport, SegmentInfo
from .allocator import Allocator
from .lru import OUT, Links, Lru

MAX_JOURNAL = 1_000_000

# ``Obj.packed``, lowest bits first: the first location's segment id + 1 (64 bits; 0: no location),
# size (48), the first location's offset (48), generation (64), checksum (64), then the writer's slot
# (12: the quota of what a member keeps, ``ObjectTable.kept_of``; 0: counted against no one), in bits
# the int holds anyway (300 bits, ten 30-bit digits). Wider values are refused, never truncated. (The
# segment id is lowest: a read finds it with one ``&``.)
_M48, _M64 = (1 << 48) - 1, (1 << 64) - 1
_SIZE, _OFF, _GEN, _SUM, _WRITER = 64, 112, 160, 224, 288
WRITER_SLOTS = (1 << 12) - 1   # writers that can hold objects at once (slot 0 is nobody's)
FIRST_SEGMENT = _M64   # for the table's read path: (packed & FIRST_SEGMENT) - 1, when not 0


def pack(size: int, generation: int, checksum: int, first: Location | None, writer_slot: int = 0) -> int:
    sid1, off = (first.segment_id + 1, first.offset) if first is not None else (0, 0)
    if (size | off) >> 48 or (sid1 | generation | checksum) >> 64 or not 0 <= writer_slot <= WRITER_SLOTS:
        raise ValueError(f"object field out of range: size {size}, generation {generation}, "
                         f"checksum {checksum}, location {first}, writer slot {writer_slot}")
    return sid1 | size << _SIZE | off << _OFF | generation << _GEN | checksum << _SUM | writer_slot << _WRITER


def with_checksum(packed: int, checksum: int, writer_slot: int = 0) -> int:
    """A pending object's ``packed`` (checksum 0) with the checksum its writer committed and the slot
    its committed object is counted under."""
    if checksum >> 64 or not 0 <= writer_slot <= WRITER_SLOTS:
        raise ValueError(f"checksum or writer slot out of range: {checksum}, {writer_slot}")
    return packed | checksum << _SUM | writer_slot << _WRITER


class Extra(msgspec.Struct, gc=False):
    """What few objects have; an object whose extras are all defaults holds none (``Obj.more`` None)."""

    replicas: int = 1                  # replicas the put asked for
    rest: tuple[Location, ...] = ()    # locations after the first
    links: tuple[Links, ...] = ()      # LRU links in the segments of ``rest``, one per location there
    disk: tuple[int, int] | None = None     # (segment id of the provider holding a disk record, its generation)
    disk_offered: float = 0.0          # offered to that provider's disk writer; not again before this time

    def __post_init__(self) -> None:
        if len(self.links) != len(self.rest):
            self.links = tuple(Links() for _ in self.rest)

    def idle(self) -> bool:
        return (self.replicas == 1 and not self.rest and not self.links
                and self.disk is None and self.disk_offered == 0.0)



class Obj(msgspec.Struct, eq=False, gc=False):
    """One committed object. Not tracked by the garbage collector (no reference cycles: LRU links are
    keys, not objects), which saves 16 bytes each and keeps full collections from walking them."""

    key: str
    packed: int                        # size, generation, checksum, first location (``pack``)
    # the end of its last read lease; its commit time until it is read (leased: later than now), so it
    # is also when the object was last in use, comparable across segments (``space.py``, ``room.py``); 0:
    # recovered
    lease_until: float = 0.0
    more: Extra | None = None
    prev: str | None = OUT             # LRU links in the first location's segment (``lru.py``)
    next: str | None = OUT
    committed: ClassVar[bool] = True
    owner: ClassVar[int] = 0
    pending_deadline: ClassVar[float] = 0.0

    @property
    def size(self) -> int:
        return self.packed >> _SIZE & _M48

    @property
    def generation(self) -> int:
        return self.packed >> _GEN & _M64

    @property
    def checksum(self) -> int:
        return self.packed >> _SUM & _M64

    @property
    def writer_slot(self) -> int:
        """Whose quota this committed object counts in (``ObjectTable.kept_of``); 0: no one's."""
        return self.packed >> _WRITER

    @property
    def first_segment(self) -> int | None:
        sid1 = self.packed & _M64
        return sid1 - 1 if sid1 else None

    @property
    def locations(self) -> list[Location]:
        """A fresh list: assign ``locations`` to change them (``Obj.locations.append`` changes nothing)."""
        v = self.packed
        sid1 = v & _M64
        first = [Location(sid1 - 1, v >> _OFF & _M48)] if sid1 else []
        return first + list(self.more.rest) if self.more is not None else first

    @locations.setter
    def locations(self, locs: list[Location]) -> None:
        """Change the locations. The caller took the object out of the LRU lists of locations it drops
        (and adds it to those of new ones after); links of kept ones move with the first location."""
        more = self._extra()
        nodes = {loc.segment_id: (n.prev, n.next) for loc, n in zip(more.rest, more.links, strict=True)}
        first = self.first_segment
        if first is not None:
            nodes[first] = (self.prev, self.next)
        self.prev, self.next = nodes.get(locs[0].segment_id, (OUT, OUT)) if locs else (OUT, OUT)
        more.rest = tuple(locs[1:])
        more.links = tuple(Links(*nodes.get(loc.segment_id, (OUT, OUT))) for loc in locs[1:])
        self.packed = pack(self.size, self.generation, self.checksum, locs[0] if locs else None, self.writer_slot)
        self._tidy()

    def found(self) -> Found:
        """The object as a lookup answers it (its fields decoded once)."""
        v = self.packed
        sid1 = v & _M64
        locs = [Location(sid1 - 1, v >> _OFF & _M48)] if sid1 else []
        more = self.more
        if more is None:
            return Found(v >> _SIZE & _M48, v >> _GEN & _M64, locs, v >> _SUM & _M64, 0)
        return Found(v >> _SIZE & _M48, v >> _GEN & _M64, locs + list(more.rest), v >> _SUM & _M64,
                     more.disk[0] if more.disk is not None else 0)

    def set_version(self, generation: int, checksum: int) -> None:
        locs = self.locations
        self.packed = pack(self.size, generation, checksum, locs[0] if locs else None, self.writer_slot)

    @property
    def replicas(self) -> int:
        return self.more.replicas if self.more is not None else 1

    @replicas.setter
    def replicas(self, n: int) -> None:
        self._extra().replicas = n
        self._tidy()

    @property
    def disk(self) -> tuple[int, int] | None:
        return self.more.disk if self.more is not None else None

    @disk.setter
    def disk(self, v: tuple[int, int] | None) -> None:
        self._extra().disk = v
        self._tidy()

    @property
    def disk_offered(self) -> float:
        return self.more.disk_offered if self.more is not None else 0.0

    @disk_offered.setter
    def disk_offered(self, v: float) -> None:
        self._extra().disk_offered = v
        self._tidy()

    def links(self, segment_id: int) -> Obj | Links:
        """This object's LRU links in one of its segments: its own for the first location."""
        if self.more is not None:
            for loc, n in zip(self.more.rest, self.more.links, strict=True):
                if loc.segment_id == segment_id:
                    return n
        return self

    def _extra(self) -> Extra:
        if self.more is None:
            self.more = Extra()
        return self.more

    def _tidy(self) -> None:
        if self.more is not None and self.more.idle():
            self.more = None


PENDING_LEASE = float("-inf")   # a pending object's ``lease_until`` (never leased): ``committed`` in one slot


class PendingObj(Obj, gc=False):
    """An object allocated and not committed yet: its writer and its deadline. Commit replaces it
    with an ``Obj`` (pending objects are never in an LRU list). Its ``lease_until`` is ``PENDING_LEASE``,
    so the hottest check (Exist) reads a slot, not the class attribute ``committed``."""

    lease_until: float = PENDING_LEASE
    owner: int = 0                   # type: ignore[misc]   # client that allocated it
    pending_deadline: float = 0.0    # type: ignore[misc]
    committed: ClassVar[bool] = False


def new_obj(key: str, size: int, generation: int, locations: list[Location], checksum: int = 0,
            lease_until: float = 0.0, replicas: int = 1, disk: tuple[int, int] | None = None,
            writer_slot: int = 0) -> Obj:
    """A committed object (recovered from reports, a disk record, or a copy whose space waits)."""
    obj = Obj(key, pack(size, generation, checksum, locations[0] if locations else None, writer_slot), lease_until)
    if len(locations) > 1 or replicas != 1 or disk is not None:
        obj.more = Extra(replicas=replicas, rest=tuple(locations[1:]), disk=disk)
    return obj


class Segment:
    def __init__(self, info: SegmentInfo, allocator: Allocator, objects: dict[str, Obj],
                 alloc_after: float = 0.0) -> None:
        self.info = info
        self.allocator = allocator
        self.lru: Lru[Obj] = Lru(info.segment_id, objects)   # committed objects here, least recent first
        self.journal: list[JournalEntry] = []
        self.journal_seq = 0
        self.acked = 0                  # the owner has applied the journal up to here (cleared those headers)
        self.serial = 0                 # this incarnation of the segment (``ObjectTable.add_segment``)
        self.alloc_after = alloc_after  # recovered segments wait out writers of the previous MetaService
        self.arena: Any = None          # the owner's allocation arena (meta/arena.py), if it holds one
        self.fence = new_token()        # this join's fence token: every grant of space here carries it (fence.py)
        self.held = False               # its owner waits out writes of an earlier join (Join/Heartbeat.held)
        self.rotates = False            # its owner rotates its fence when asked (Join.rotates; an older one never)
        self.rotate_to = 0              # the fence token asked for (HeartbeatReply.rotate), not confirmed yet
        self.fenced: list[tuple[int, int]] = []   # reclaimed ranges (offset, bytes): free once the fence rotated

    def takes_new(self, now: float) -> bool:
        """May new space be granted here (an Alloc's placement, an arena, a GVA grant, a drain's or a
        repair's copy, a promotion from disk): not draining or in its grace (``alloc_after``), and not
        held by its owner (writes granted before its join may still be in flight: local/hold.py)."""
        return self.alloc_after <= now and not self.held

    def fence_out(self, offset: int, nbytes: int) -> None:
        """Keep a reclaimed range out of use (a grant that timed out: its writer may be frozen, not dead,
        and its token still opens the fence) until the owner rotated its fence to a new token; ask for
        that rotation (docs/design.md, "Cleanup of half-written objects"). An owner that cannot rotate
        (an older build) keeps the range out of use until its segment re-joins or leaves."""
        self.fenced.append((offset, nbytes))
        if self.rotates and not self.rotate_to:
            self.rotate_to = new_token()

    def rotated(self, token: int) -> int:
        """The owner says its fence is open to ``token`` alone (every write of another token ended): once
        that is the token asked for, grants carry it and the fenced ranges are free. Bytes freed."""
        if not token or token != self.rotate_to:
            return 0
        self.fence, self.rotate_to = token, 0
        for offset, nbytes in self.fenced:
            self.allocator.free_range(offset, nbytes)
        freed, self.fenced = sum(n for _, n in self.fenced), []
        return freed

    def record_removed(self, report: ObjectReport, disk: bool = False) -> None:
        """Tell the owner (on its next heartbeat) that this object is gone, so it clears the header;
        ``disk``: so its disk tier deletes its record of the object (and drops a copy still queued)."""
        self.journal_seq += 1
        self.journal.append(JournalEntry(self.journal_seq, False, report, disk))
        if len(self.journal) > MAX_JOURNAL:
            del self.journal[: len(self.journal) - MAX_JOURNAL]

    def journal_since(self, ack: int) -> list[JournalEntry]:
        """The entries after ``ack``, which the owner says it applied (those before are dropped)."""
        if ack > self.acked:   # (acked <= journal_seq always: the owner cannot ack what was not sent)
            self.acked = min(ack, self.journal_seq)
        if not self.journal:   # every heartbeat of a quiet segment: no list to scan or copy
            return []
        if self.journal[0].seq <= ack:
            keep = next((i for i, e in enumerate(self.journal) if e.seq > ack), len(self.journal))
            del self.journal[:keep]
        return list(self.journal)

@dataclasses.dataclass
class Counters:
    allocs: int = 0
    commits: int = 0
    lookups: int = 0
    hits: int = 0
    exists: int = 0
    removes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    alloc_failures: int = 0
    pending_reclaimed: int = 0
    integrity_failures: int = 0
    superseded: int = 0             # objects dropped because a re-joining member held a newer generation
    evictions_to_disk: int = 0      # evictions that kept the object on its disk tier
    disk_drops: int = 0             # disk-only objects gone for good (their tier dropped the record)
    disk_hits: int = 0              # lookups that found an object on disk only
    promotions: int = 0             # disk-only objects brought back into DRAM
    uncounted_writes: int = 0       # commits counted against no member's quota: every writer slot was held
