"""The GVA path (memcache_hybrid's layer-wise calls): allocate objects, copy byte ranges in and out of
them through global virtual addresses, finish them, lease them.

A GVA (global virtual address) names one byte of one object replica, 64 bits:

```
 63      56 55          42 41                                   0
| session | segment slot |  offset of the byte in the segment     |
```

* offset (42 bits, 4 TiB): where the byte lies in the segment (the object's payload, after its header),
  so ``gva + n`` is the n-th byte of the object, as callers expect to address a layer's slice;
* slot (14 bits, from 1): this client's number for the segment, issued the first time one of its
  objects is described (``batch_get_key_info``), so no GVA is 0;
* session (8 bits): of the MetaService epoch this client joined, so a GVA from before a MetaService
  restart (or an HA failover) is refused at once.

A GVA is resolved here against the objects this client was told about in this session (``GvaBook``)
to (key, generation, segment, payload range); a GVA that names none of them is refused (-3000). The
MetaService then decides, before every copy, whether that range may be written or read now
(``meta/gva.py``: owner, state, generation, bounds, lease or pending deadline); nothing is copied for a
batch with a refused range. Checksums: ranges are written without one; ``finish`` reads the object
back, writes it whole with its checksum and header (the ordinary write path), then commits it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from .. import errors
from .. import protocol as p
from ..errors import InvalidParameter, MemCacheError, StateMismatch, check_keys
from ..layout import payload_offset
from ..rpc import expect
from ..transfer import CopyOp
from .membership import Membership, Pieces, Session, in_batches
from .reads import LEASE_SAFETY

logger = logging.getLogger(__name__)

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

    @property
    def lo(self) -> int:
        return payload_offset(self.offset)


class GvaBook:
    """The objects this client described in one session, indexed by segment and payload start."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.tag = (session.epoch & ((1 << TAG_BITS) - 1)) or 1
        self.slots: dict[int, int] = {}            # segment id -> slot
        self.segment_of: dict[int, int] = {}       # slot -> segment id
        self.by_key: dict[str, list[GvaObject]] = {}
        self.starts: dict[int, list[int]] = {}     # segment id -> sorted payload starts
        self.at: dict[tuple[int, int], GvaObject] = {}
        self.lock = threading.Lock()

    def add(self, objs: list[GvaObject]) -> list[int]:
        """Remember a key's replicas (replacing what was known of the key); their GVAs (0: none)."""
        with self.lock:
            if objs:
                self._forget(objs[0].key)
            gvas = [self._add(o) for o in objs]
            while len(self.by_key) > MAX_BOOK:
                self._forget(next(iter(self.by_key)))
            return gvas

    def _add(self, o: GvaObject) -> int:
        slot = self.slots.get(o.segment_id)
        if slot is None:
            slot = len(self.slots) + 1
            if slot > _SLOT_MASK:
                return 0
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

    def forget(self, keys: Sequence[str]) -> None:
        with self.lock:
            for k in keys:
                self._forget(k)

    def _forget(self, key: str) -> None:
        for o in self.by_key.pop(key, ()):
            self.at.pop((o.segment_id, o.lo), None)
            starts = self.starts[o.segment_id]
            i = bisect.bisect_left(starts, o.lo)
            if i < len(starts) and starts[i] == o.lo:
                del starts[i]

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


class Gva(Membership):
    """``LocalService``'s GVA path (a mixin)."""

    _gva_book: GvaBook | None
    _replica_order: Callable[[list[p.Location]], list[p.Location]]   # reads.py: nearest replica first

    def _book(self) -> GvaBook:
        s = self.session
        book = self._gva_book
        if book is None or book.session is not s:
            book = self._gva_book = GvaBook(s)   # a new session: every GVA of the old one is stale
        return book

    @in_batches(aligned=1)
    def gva_alloc(self, keys: Sequence[str], sizes: Sequence[int]) -> list[MemCacheError | None]:
        """Reserve objects to be written range by range (PENDING: invisible until ``gva_finish``)."""
        check_keys(list(keys))
        if len(keys) != len(sizes) or len(set(keys)) != len(keys):
            raise InvalidParameter("batch_alloc: keys and sizes differ in length, or a key is repeated")
        for s in sizes:
            if not isinstance(s, int) or s <= 0:
                raise InvalidParameter(f"batch_alloc: size {s!r} must be a positive int")
        reply = expect(self._member_call(lambda s: p.Alloc(s.client_id, s.token, list(keys), list(sizes))),
                       p.AllocReply)
        book = self._book()
        out: list[MemCacheError | None] = []
        for k, n, r in zip(keys, sizes, reply.results, strict=True):
            if r.code != errors.SUCCESS:
                out.append(errors.error_from_code(r.code, f"batch_alloc of {k!r} ({n} bytes) refused"))
                continue
            book.add([GvaObject(k, r.generation, loc.segment_id, loc.offset, n, True) for loc in r.locations])
            out.append(None)
        return out

    @in_batches()
    def gva_info(self, keys: Sequence[str]) -> list[tuple[p.Found | None, list[int]]]:
        """Each key's object (committed, or allocated here and not finished) and a GVA per DRAM
        replica, nearest first (none for a copy held on a disk tier only)."""
        check_keys(list(keys))
        reply = expect(self._member_call(lambda s: p.Info(s.client_id, s.token, list(keys))), p.InfoReply)
        book = self._book()
        out: list[tuple[p.Found | None, list[int]]] = []
        for k, f, pending in zip(keys, reply.results, reply.pending, strict=True):
            if f is None:
                book.forget([k])
                out.append((None, []))
                continue
            f.locations = self._replica_order(f.locations)
            locs = f.locations
            out.append((f, book.add([GvaObject(k, f.generation, loc.segment_id, loc.offset, f.size, pending)
                                     for loc in locs])))
        return out

    @in_batches()
    def gva_lease(self, keys: Sequence[str], ttl_ms: int) -> list[int]:
        """Lease committed objects to this client for ``ttl_ms`` (0: the pool's lease_ttl_ms)."""
        check_keys(list(keys))
        book = self._book()
        gens = [next((o.generation for o in book.objects(k) if not o.pending), 0) for k in keys]
        ttl = ttl_ms or int(self.session.lease_ttl_s * 1000)
        return expect(self._member_call(lambda s: p.Lease(s.client_id, s.token, list(keys), gens, ttl)),
                      p.Codes).codes

    @in_batches()
    def gva_unlease(self, keys: Sequence[str]) -> list[int]:
        check_keys(list(keys))
        return expect(self._member_call(lambda s: p.Lease(s.client_id, s.token, list(keys), [0] * len(keys), 0)),
                      p.Codes).codes

    @in_batches(aligned=1)
    def gva_copy(self, gvas: Sequence[int], pieces: Sequence[Pieces], write: bool | None) -> None:
        """Copy each local pieces list (laid end to end) to or from the object bytes from ``gvas[i]`` on.
        ``write`` None: the direction each object's state implies. Raises for the whole batch; nothing
        is copied unless every range is granted."""
        assert self.engine is not None
        if len(gvas) != len(pieces):
            raise InvalidParameter(f"{len(gvas)} GVAs and {len(pieces)} buffer lists")
        book = self._book()
        spans = [book.resolve(g, sum(n for _, n in ps)) for g, ps in zip(gvas, pieces, strict=True)]
        writes = {o.pending if write is None else write for o, _ in spans}
        if len(writes) != 1:
            raise InvalidParameter("batch_copy with AUTO: the GVAs name both unfinished and finished objects")
        writing = writes.pop()
        left_s = self._grant(spans, [sum(n for _, n in ps) for ps in pieces], writing)
        ops = []
        for (o, start), ps in zip(spans, pieces, strict=True):
            n = sum(size for _, size in ps)
            ops.append(CopyOp(self._segment(o.segment_id), o.offset, list(ps), n, o.key, o.generation,
                              start=start, with_header=False))
        t0 = time.monotonic()
        (self.engine.write if writing else self.engine.read)(ops)
        failed = next((op.error for op in ops if op.error is not None), None)
        if failed is not None:
            raise failed
        if not writing and time.monotonic() - t0 > left_s * LEASE_SAFETY:
            self._confirm_objects([o for o, _ in spans])

    def _grant(self, spans: list[tuple[GvaObject, int]], sizes: list[int], write: bool) -> float:
        """Ask the MetaService whether every range may be copied now; the shortest time left (seconds)."""
        def ask(s: Session) -> p.Grant:
            return p.Grant(s.client_id, s.token, [o.key for o, _ in spans], [o.generation for o, _ in spans],
                           [o.segment_id for o, _ in spans], [st for _, st in spans],
                           [st + n for (_, st), n in zip(spans, sizes, strict=True)], write)
        reply = expect(self._member_call(ask), p.Granted)
        for (o, start), code in zip(spans, reply.codes, strict=True):
            if code != errors.SUCCESS:
                raise errors.error_from_code(code, f"{'write into' if write else 'read from'} {o.key!r} "
                                                   f"(generation {o.generation}) at {start} refused")
        return min(reply.left_ms, default=0) / 1000.0

    def _confirm_objects(self, objs: list[GvaObject]) -> None:
        """A read outlived its lease: the objects must still be the ones read."""
        flags = expect(self.rpc.call(p.Validate([o.key for o in objs], [o.generation for o in objs]),
                                     idempotent=True), p.Flags).flags
        if not all(flags):
            raise errors.LeaseExpired("an object changed while a slow copy held an expired lease")

    @in_batches(aligned=1)
    def gva_finish(self, keys: Sequence[str], results: Sequence[int]) -> list[MemCacheError | None]:
        """Publish (result 0) or abort (non-zero) objects allocated with ``gva_alloc``: a published
        object is read back, written whole with its checksum and header, then committed."""
        check_keys(list(keys))
        if len(keys) != len(results) or len(set(keys)) != len(keys):
            raise InvalidParameter("batch_write_finish: keys and results differ in length, or a key is repeated")
        book = self._book()
        objs = {k: next((o for o in book.objects(k) if o.pending), None) for k in keys}
        out: list[MemCacheError | None] = [None] * len(keys)
        publish, abort = [], []
        for i, (k, r) in enumerate(zip(keys, results, strict=True)):
            o = objs[k]
            if o is None:
                out[i] = errors.KeyNotFound(f"{k!r} was not allocated by batch_alloc in this session, or is finished")
            elif r == 0:
                publish.append(i)
            else:
                abort.append(i)
        s = self.session
        if abort:
            self._abort(s, [o for o in (objs[keys[i]] for i in abort) if o is not None])
        if publish:
            self._publish(keys, objs, publish, out, s)
        book.forget(keys)
        return out

    def _publish(self, keys: Sequence[str], objs: dict[str, GvaObject | None], idx: list[int],
                 out: list[MemCacheError | None], s: Session) -> None:
        assert self.engine is not None
        todo = [(i, objs[keys[i]]) for i in idx]
        spans = [(o, 0) for _, o in todo if o is not None]
        try:
            self._grant(spans, [o.size for o, _ in spans], True)
        except MemCacheError as e:
            for i, _ in todo:
                out[i] = e
            return
        scratch = [np.empty(o.size, np.uint8) for o, _ in spans]
        reads = [CopyOp(self._segment(o.segment_id), o.offset, [(b.ctypes.data, o.size)], o.size, o.key,
                        o.generation) for (o, _), b in zip(spans, scratch, strict=True)]
        self.engine.read(reads)
        writes = [CopyOp(r.segment, r.offset, r.pieces, r.nbytes, r.key, r.generation, hash=self.config.checksum)
                  for r in reads if r.error is None]
        self.engine.write(writes)
        written = {w.key: w for w in writes if w.error is None}
        failed = [o for o, _ in spans if o.key not in written]
        if failed:
            self._abort(s, failed)
        done = [o for o, _ in spans if o.key in written]
        codes = expect(self.rpc.call(p.Commit(s.client_id, s.token, [o.key for o in done],
                                              [o.generation for o in done],
                                              [written[o.key].checksum for o in done])), p.Codes).codes if done else []
        code_of = dict(zip([o.key for o in done], codes, strict=True))
        errs = {op.key: op.error for op in [*reads, *writes] if op.error is not None}
        for i, _ in todo:
            k = keys[i]
            if k in errs:
                out[i] = errs[k]
            elif code_of.get(k, errors.SUCCESS) != errors.SUCCESS:
                out[i] = errors.error_from_code(code_of[k], f"batch_write_finish of {k!r} refused")

    def _abort(self, s: Session, objs: list[GvaObject]) -> None:
        try:
            self.rpc.call(p.Abort(s.client_id, s.token, [o.key for o in objs], [o.generation for o in objs]))
        except MemCacheError as e:
            logger.warning("abort of %d objects not delivered (%s); the MetaService reclaims them", len(objs), e)
