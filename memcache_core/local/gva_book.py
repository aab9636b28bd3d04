"""What a client knows of the GVA path's objects in one session (``gva.py`` explains GVAs): each object
described or allocated (``GvaObject``), the GVAs issued for it, what the MetaService granted for it
and until when (``Granted``), and each replica's running checksum of the ranges copied in (``Digest``)."""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Callable, Sequence

import xxhash

from ..errors import InvalidParameter, StateMismatch
from ..layout import payload_offset
from ..memory import view_at
from .membership import Pieces, Session

OFFSET_BITS, SLOT_BITS, TAG_BITS = 42, 14, 8
_OFFSET_MASK, _SLOT_MASK = (1 << OFFSET_BITS) - 1, (1 << SLOT_BITS) - 1
MAX_BOOK = 1 << 18        # keys remembered per session; the oldest are forgotten beyond it (their GVAs: -3000)


@dataclasses.dataclass(frozen=True, slots=True)
class GvaObject:
    """One object replica a GVA may point into: ``lo`` .. ``lo + size`` are its payload's bytes."""

    key: str
    generation: int
    segment_id: int
    offset: int            # where the object's header starts in the segment
    size: int
    pending: bool          # allocated by this client, not finished
    fence: int = 0         # pending: the fence token its space was granted under (a write carries it: fence.py)

    @property
    def lo(self) -> int:
        return payload_offset(self.offset)


@dataclasses.dataclass(slots=True)
class Granted:
    """What the MetaService granted for one replica: copies may start locally until ``until``; ``end``
    is the lease end (reads) it was granted under, both on this process's monotonic clock."""

    until: float
    end: float
    connects: int       # the RPC client's connections opened when it was asked (a new one: maybe a restart)


class Digest:
    """The XXH3-64 of one replica's payload, fed while its ranges arrive in order from byte 0."""

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_64()
        self.whole: int | None = None   # the digest the copy loop computed over the whole payload at once
        self.next = 0                   # bytes hashed so far (the next range must start here)
        self.in_order = True            # False once a range came out of order: read back at finish
        self.lock = threading.Lock()

    def add(self, start: int, pieces: Pieces, digest: int | None) -> None:
        """``pieces`` were copied to ``start``; ``digest``: their XXH3-64 when the copy computed it
        (a copy of the whole payload)."""
        with self.lock:
            if not self.in_order or start != self.next:
                self.in_order = False
                return
            if digest is not None and start == 0:
                self.whole = digest
            else:
                for ptr, n in pieces:
                    self.hasher.update(view_at(ptr, n))
            self.next += sum(n for _, n in pieces)

    def value(self, size: int) -> int | None:
        """The payload's digest when every byte was hashed in order, else None."""
        with self.lock:
            if not self.in_order or self.next != size:
                return None
            return self.whole if self.whole is not None else self.hasher.intdigest()


class GvaBook:
    """The objects this client described in one session, indexed by segment and payload start, with
    what was granted for them and the digests of those it is writing."""

    def __init__(self, session: Session, slot_of: Callable[[int], int]) -> None:
        self.session = session
        self.slot_of = slot_of   # segment id -> the pool's number for it (``SegmentInfo.gva_slot``; 0: none)
        self.tag = (session.epoch & ((1 << TAG_BITS) - 1)) or 1
        self.slots: dict[int, int] = {}            # segment id -> slot (the pool's: the same in every process)
        self.segment_of: dict[int, int] = {}       # slot -> segment id
        self.by_key: dict[str, list[GvaObject]] = {}
        self.starts: dict[int, list[int]] = {}     # segment id -> sorted payload starts
        self.at: dict[tuple[int, int], GvaObject] = {}
        self.grants: dict[str, dict[tuple[int, int, bool], Granted]] = {}   # key -> (gen, segment, write)
        self.digests: dict[str, dict[int, Digest]] = {}                     # key -> segment -> digest
        self.lock = threading.Lock()

    def add(self, objs: list[GvaObject]) -> list[int]:
        """Remember a key's replicas (replacing what was known of the key); their GVAs (0: none)."""
        slots = {o.segment_id: self.slot_of(o.segment_id) for o in objs}   # (may ask the MetaService)
        with self.lock:
            if objs:
                self._forget(objs[0].key)
            gvas = [self._add(o, slots[o.segment_id]) for o in objs]
            while len(self.by_key) > MAX_BOOK:
                self._forget(next(iter(self.by_key)))
            return gvas

    def _add(self, o: GvaObject, slot: int) -> int:
        if not 0 < slot <= _SLOT_MASK:
            return 0
        if self.slots.get(o.segment_id) != slot:
            left = self.segment_of.get(slot)
            if left is not None:   # the segment that had this number left the pool: its GVAs are void
                for k in {obj.key for (sid, _), obj in self.at.items() if sid == left}:
                    self._forget(k)
                self.slots.pop(left, None)
            self.slots[o.segment_id], self.segment_of[slot] = slot, o.segment_id
        if o.lo + o.size > _OFFSET_MASK:
            return 0
        starts = self.starts.setdefault(o.segment_id, [])
        i = max(0, bisect.bisect_left(starts, o.lo) - 1)
        stale = []
        while i < len(starts) and starts[i] < o.lo + o.size:   # space reused since: what lay there is gone
            old = self.at[(o.segment_id, starts[i])]
            if o.lo < old.lo + old.size:
                stale.append(old.key)
            i += 1
        for k in stale:
            self._forget(k)
        bisect.insort(starts, o.lo)
        self.at[(o.segment_id, o.lo)] = o
        self.by_key.setdefault(o.key, []).append(o)
        return self.tag << (OFFSET_BITS + SLOT_BITS) | slot << OFFSET_BITS | o.lo

    def gva_of(self, o: GvaObject) -> int:
        """The GVA of a replica described here (0: none)."""
        with self.lock:
            slot = self.slots.get(o.segment_id)
            if slot is None or o not in self.by_key.get(o.key, ()):
                return 0
            return self.tag << (OFFSET_BITS + SLOT_BITS) | slot << OFFSET_BITS | o.lo

    def forget(self, keys: Sequence[str]) -> None:
        with self.lock:
            for k in keys:
                self._forget(k)

    def _forget(self, key: str) -> None:
        self.grants.pop(key, None)
        self.digests.pop(key, None)
        for o in self.by_key.pop(key, ()):
            self.at.pop((o.segment_id, o.lo), None)
            starts = self.starts[o.segment_id]
            i = bisect.bisect_left(starts, o.lo)
            if i < len(starts) and starts[i] == o.lo:
                del starts[i]

    def grant(self, objs: Sequence[GvaObject], write: bool, until: Sequence[float], end: Sequence[float],
              connects: int) -> None:
        """Remember what the MetaService granted for these replicas (still described here)."""
        with self.lock:
            for o, u, e in zip(objs, until, end, strict=True):
                if o in self.by_key.get(o.key, ()):
                    self.grants.setdefault(o.key, {})[(o.generation, o.segment_id, write)] = Granted(u, e, connects)

    def granted(self, objs: Sequence[GvaObject], write: bool, now: float, connects: int) -> float | None:
        """If every replica's copy may start now on what was granted: the shortest time (seconds) to
        the end it was granted under; else None (ask the MetaService)."""
        left = float("inf")
        with self.lock:
            for o in objs:
                g = self.grants.get(o.key, {}).get((o.generation, o.segment_id, write))
                if g is None or g.until <= now or g.connects != connects:
                    return None
                left = min(left, g.end - now)
        return left

    def revoke(self, keys: Sequence[str], write: bool) -> None:
        with self.lock:
            for k in keys:
                mine = self.grants.get(k, {})
                for g in [g for g in mine if g[2] == write]:
                    del mine[g]

    def digest(self, o: GvaObject) -> Digest:
        with self.lock:
            return self.digests.setdefault(o.key, {}).setdefault(o.segment_id, Digest())

    def objects(self, key: str) -> list[GvaObject]:
        with self.lock:
            return list(self.by_key.get(key, ()))

    def resolve(self, gva: int, n: int) -> tuple[GvaObject, int]:
        """The object replica whose payload holds ``[gva, gva + n)``, and where the range starts in it."""
        if not isinstance(gva, int) or not isinstance(n, int) or gva <= 0 or gva >> 64 or n <= 0:
            raise InvalidParameter(f"GVA {gva!r} with size {n!r}: a GVA is a positive 64-bit int, the size positive")
        if gva >> (OFFSET_BITS + SLOT_BITS) != self.tag:
            raise StateMismatch(f"GVA {gva:#x} is of another MetaService session (restarted since): "
                                f"call batch_get_key_info again")
        off = gva & _OFFSET_MASK
        with self.lock:
            sid = self.segment_of.get(gva >> OFFSET_BITS & _SLOT_MASK)
            starts = self.starts.get(sid, []) if sid is not None else []
            i = bisect.bisect_right(starts, off) - 1
            o = self.at.get((sid, starts[i])) if i >= 0 and sid is not None else None
        if o is None or off + n > o.lo + o.size:
            raise InvalidParameter(f"GVA {gva:#x} with size {n} does not lie inside an object described by "
                                   f"batch_get_key_info in this session")
        return o, off - o.lo
