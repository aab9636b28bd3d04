"""The GVA path (memcache_hybrid's layer-wise calls): allocate objects, copy byte ranges in and out of
them through global virtual addresses, finish them, lease them.

A GVA (global virtual address) names one byte of one object replica, 64 bits:

```
 63      56 55          42 41                                   0
| session | segment slot |  offset of the byte in the segment     |
```

* offset (42 bits, 4 TiB): where the byte lies in the segment (the object's payload, after its header),
  so ``gva + n`` is the n-th byte of the object, as callers expect to address a layer's slice;
* slot (14 bits, from 1): the pool's number for the segment (``SegmentInfo.gva_slot``), issued by the
  MetaService when the segment joins, so a GVA is the same value in every process of the pool and
  names one object in all of them (before, each client numbered the segments it met from 1: two
  processes' GVAs of two objects could be the same value); no GVA is 0;
* session (8 bits): of the MetaService epoch this client joined, so a GVA from before a MetaService
  restart (or an HA failover) is refused at once.

A GVA is resolved here against the objects this client was told about in this session (``GvaBook``)
to (key, generation, segment, payload range); a GVA that names none of them is refused (-3000). The
MetaService decides whether that range may be written or read (``meta/gva.py``: owner, state,
generation, bounds, lease or pending deadline); nothing is copied for a batch with a refused range.

Grants last (``Grants``): what the MetaService answered holds until a time it guarantees, so copies
inside it proceed without asking again. A write is granted at ``batch_alloc`` (or by a ``Grant``
round trip) until half the pending timeout after the request left: the MetaService reclaims a pending
object only at its deadline, and keeps its space out of use until the target's owner rotated its
fence, which refuses a copy of that grant. A read is granted at
``batch_add_lease`` until the lease's end. Both are capped at ``lease_ttl_ms`` after the request left
(a restarted MetaService knows no pending
object and no lease, and a write granted before it, or before the target's owner was declared dead and
re-joined, is refused by the target segment's write fence, ``fence.py``, once its owner re-joined: each
copy carries the fence token of the target's join its space was granted in), and void
once the client opened a new MetaService connection (the sign of a restart) or the session changed.
Past that, one ``Grant`` round trip renews them. Removing a lease, finishing or aborting an object, or
describing a key again drops what was granted for it.

Checksums: each replica's XXH3-64 is computed from what is copied in, while ranges arrive in order from
the first byte (by the copy loop itself for a copy of the whole object, else over the source after
each copy); ``finish`` then writes only the header and commits. A replica written out of order (or a
range written twice) is read back once at ``finish`` to hash it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from .. import errors
from .. import protocol as p
from ..errors import InvalidParameter, MemCacheError, check_keys
from ..fence import tokens
from ..layout import HEADER_BYTES, pack_header
from ..rpc import expect
from ..transfer import CopyOp
from .gva_book import GvaBook, GvaObject
from .membership import Membership, Pieces, Session, in_batches
from .reads import LEASE_SAFETY

logger = logging.getLogger(__name__)


class Gva(Membership):
    """``LocalService``'s GVA path (a mixin)."""

    _gva_book: GvaBook | None
    _replica_order: Callable[[list[p.Location]], list[p.Location]]   # reads.py: nearest replica first

    def _book(self) -> GvaBook:
        s = self.session
        book = self._gva_book
        if book is None or book.session is not s:
            book = self._gva_book = GvaBook(s, self._gva_slot)   # a new session: every old GVA is stale
        return book

    def _gva_slot(self, segment_id: int) -> int:
        """The pool's number for a segment in GVAs (0: none: it left the pool, or has no number)."""
        try:
            return self.segment_info(segment_id).gva_slot
        except errors.PeerUnavailable:
            return 0

    def _grant_cap(self, t0: float) -> float:
        """No grant outlives this (a write granted before the target's owner re-joined or rotated its fence
        is refused by the target segment's fence: ``fence.py``)."""
        return t0 + self.session.lease_ttl_s

    @in_batches(aligned=1)
    def gva_alloc(self, keys: Sequence[str], sizes: Sequence[int]) -> list[MemCacheError | None]:
        """Reserve objects to be written range by range (PENDING: invisible until ``gva_finish``);
        writing them is granted until half the pending timeout from now."""
        check_keys(list(keys))
        if len(keys) != len(sizes) or len(set(keys)) != len(keys):
            raise InvalidParameter("batch_alloc: keys and sizes differ in length, or a key is repeated")
        for s in sizes:
            if not isinstance(s, int) or s <= 0:
                raise InvalidParameter(f"batch_alloc: size {s!r} must be a positive int")
        t0 = time.monotonic()
        answer, granted_in = self.member_call_in(lambda s: p.Alloc(s.client_id, s.token, list(keys), list(sizes)))
        reply = expect(answer, p.AllocReply)
        connects = self.rpc.connects   # read after the call: the connection the reply came on counts
        book = self._book()
        if book.session is not granted_in:   # re-joined again meanwhile: these objects are of no session held
            return [errors.StateMismatch(f"batch_alloc of {k!r}: the MetaService restarted during the call")
                    for k in keys]
        pending_s = book.session.pending_timeout_s
        until = min(t0 + pending_s / 2, self._grant_cap(t0))   # as a Grant: half the timeout must be left
        out: list[MemCacheError | None] = []
        for k, n, r in zip(keys, sizes, reply.results, strict=True):
            if r.code != errors.SUCCESS:
                out.append(errors.error_from_code(r.code, f"batch_alloc of {k!r} ({n} bytes) refused"))
                continue
            try:
                fences = tokens(r.fences, len(r.locations), book.session.epoch, f"batch_alloc of {k!r}")
            except MemCacheError as e:
                out.append(e)
                continue
            objs = [GvaObject(k, r.generation, loc.segment_id, loc.offset, n, True, fence)
                    for loc, fence in zip(r.locations, fences, strict=True)]
            book.add(objs)
            book.grant(objs, True, [until] * len(objs), [t0 + pending_s] * len(objs), connects)
            out.append(None)
        return out

    @in_batches()
    def gva_info(self, keys: Sequence[str]) -> list[tuple[p.Found | None, list[int]]]:
        """Each key's object (committed, or allocated here and not finished) and a GVA per DRAM
        replica, nearest first (none for a copy held on a disk tier only)."""
        check_keys(list(keys))
        reply = expect(self.member_call(lambda s: p.Info(s.client_id, s.token, list(keys))), p.InfoReply)
        book = self._book()
        out: list[tuple[p.Found | None, list[int]]] = []
        fences = reply.fences or [[] for _ in keys]   # (none: a MetaService before join tokens)
        if len(fences) != len(keys):
            raise InvalidParameter(f"the MetaService answered {len(fences)} fence lists for {len(keys)} keys")
        for k, f, pending, fs in zip(keys, reply.results, reply.pending, fences, strict=True):
            if f is None:
                book.forget([k])
                out.append((None, []))
                continue
            marks = dict(zip(f.locations, tokens(fs, len(f.locations), book.session.epoch, f"gva_info of {k!r}")
                             if pending else [0] * len(f.locations), strict=True))
            f.locations = self._replica_order(f.locations)
            known = book.objects(k)
            objs = [GvaObject(k, f.generation, loc.segment_id, loc.offset, f.size, pending, marks[loc])
                    for loc in f.locations]
            if known == objs:   # described again as it was: keep its GVAs, grants and digests
                out.append((f, [book.gva_of(o) for o in objs]))
            else:
                out.append((f, book.add(objs)))
        return out

    @in_batches()
    def gva_lease(self, keys: Sequence[str], ttl_ms: int) -> list[int]:
        """Lease committed objects to this client for ``ttl_ms`` (0: the pool's lease_ttl_ms); reading
        the replicas described here is granted until the lease ends."""
        check_keys(list(keys))
        book = self._book()
        objs = [[o for o in book.objects(k) if not o.pending] for k in keys]
        gens = [os_[0].generation if os_ else 0 for os_ in objs]
        ttl = ttl_ms or int(self.session.lease_ttl_s * 1000)
        t0 = time.monotonic()
        codes = expect(self.member_call(lambda s: p.Lease(s.client_id, s.token, list(keys), gens, ttl)),
                       p.Codes).codes
        connects = self.rpc.connects
        # the MetaService may grant less than asked (``gva_lease_max_ms``), never less than lease_ttl_ms
        # (nor than asked): trust the lease that long; a Grant round trip learns its real end after that
        until = end = min(t0 + ttl / 1000.0, self._grant_cap(t0))
        leased = [o for os_, code in zip(objs, codes, strict=True) if code == errors.SUCCESS for o in os_]
        book.grant(leased, False, [until] * len(leased), [end] * len(leased), connects)
        return codes

    @in_batches()
    def gva_unlease(self, keys: Sequence[str]) -> list[int]:
        check_keys(list(keys))
        self._book().revoke(keys, write=False)   # the right to copy out ends now, whatever the reply
        return expect(self.member_call(lambda s: p.Lease(s.client_id, s.token, list(keys), [0] * len(keys), 0)),
                      p.Codes).codes

    @in_batches(aligned=1)
    def gva_copy(self, gvas: Sequence[int], pieces: Sequence[Pieces], write: bool | None) -> None:
        """Copy each local pieces list (laid end to end) to or from the object bytes from ``gvas[i]`` on.
        ``write`` None: the direction each object's state implies. Raises for the whole batch; nothing
        is copied unless every range is granted (by what was granted before, or by a ``Grant`` now)."""
        assert self.engine is not None
        if len(gvas) != len(pieces):
            raise InvalidParameter(f"{len(gvas)} GVAs and {len(pieces)} buffer lists")
        book = self._book()
        sizes = [sum(n for _, n in ps) for ps in pieces]
        spans = [book.resolve(g, n) for g, n in zip(gvas, sizes, strict=True)]
        writes = {o.pending if write is None else write for o, _ in spans}
        if len(writes) != 1:
            raise InvalidParameter("batch_copy with AUTO: the GVAs name both unfinished and finished objects")
        writing = writes.pop()
        left_s = book.granted([o for o, _ in spans], writing, time.monotonic(), self.rpc.connects)
        if left_s is None:
            left_s = self._grant(book, spans, sizes, writing)
        hashing = writing and self.config.checksum
        ops = [CopyOp(self.segment_info(o.segment_id), o.offset, list(ps), n, o.key, o.generation,
                      hash=hashing and start == 0 and n == o.size, start=start, with_header=False,
                      epoch=o.fence if writing else 0)   # the token of the join its space was granted in
               for (o, start), ps, n in zip(spans, pieces, sizes, strict=True)]
        t0 = time.monotonic()
        (self.engine.write if writing else self.engine.read)(ops)
        failed = next((op.error for op in ops if op.error is not None), None)
        if failed is not None:
            if writing:   # some ranges may hold part of the bytes: their digests cannot follow them
                for o, _ in spans:
                    book.digest(o).in_order = False
            raise failed
        if hashing:
            for (o, start), op in zip(spans, ops, strict=True):
                book.digest(o).add(start, op.pieces, op.checksum if op.hash else None)
        if not writing and time.monotonic() - t0 > left_s * LEASE_SAFETY:
            self._confirm_objects([o for o, _ in spans])

    def _grant(self, book: GvaBook, spans: list[tuple[GvaObject, int]], sizes: list[int], write: bool) -> float:
        """Ask the MetaService whether every range may be copied now and remember what it granted;
        the shortest time (seconds) to the end it was granted under."""
        def ask(s: Session) -> p.Grant:
            return p.Grant(s.client_id, s.token, [o.key for o, _ in spans], [o.generation for o, _ in spans],
                           [o.segment_id for o, _ in spans], [st for _, st in spans],
                           [st + n for (_, st), n in zip(spans, sizes, strict=True)], write)
        t0 = time.monotonic()
        reply = expect(self.member_call(ask), p.Granted)
        connects = self.rpc.connects
        for (o, start), code in zip(spans, reply.codes, strict=True):
            if code != errors.SUCCESS:
                raise errors.error_from_code(code, f"{'write into' if write else 'read from'} {o.key!r} "
                                                   f"(generation {o.generation}) at {start} refused")
        left = [ms / 1000.0 for ms in reply.left_ms]
        margin = book.session.pending_timeout_s / 2 if write else 0.0   # a write needs half the timeout left
        book.grant([o for o, _ in spans], write, [min(t0 + x - margin, self._grant_cap(t0)) for x in left],
                   [t0 + x for x in left], connects)
        return min(left, default=0.0)

    def _confirm_objects(self, objs: list[GvaObject]) -> None:
        """A read outlived its lease: the objects must still be the ones read."""
        flags = expect(self.rpc.call(p.Validate([o.key for o in objs], [o.generation for o in objs]),
                                     idempotent=True), p.Flags).flags
        if not all(flags):
            raise errors.LeaseExpired("an object changed while a slow copy held an expired lease")

    @in_batches(aligned=1)
    def gva_finish(self, keys: Sequence[str], results: Sequence[int]) -> list[MemCacheError | None]:
        """Publish (result 0) or abort (non-zero) objects allocated with ``gva_alloc``: a published
        object gets its header (with the digest of what was copied in) and is committed."""
        check_keys(list(keys))
        if len(keys) != len(results) or len(set(keys)) != len(keys):
            raise InvalidParameter("batch_write_finish: keys and results differ in length, or a key is repeated")
        book = self._book()
        objs = {k: [o for o in book.objects(k) if o.pending] for k in keys}
        out: list[MemCacheError | None] = [None] * len(keys)
        publish, abort = [], []
        for i, (k, r) in enumerate(zip(keys, results, strict=True)):
            if not objs[k]:
                out[i] = errors.KeyNotFound(f"{k!r} was not allocated by batch_alloc in this session, or is finished")
            elif r == 0:
                publish.append(i)
            else:
                abort.append(i)
        s = self.session
        if abort:
            self._abort(s, [objs[keys[i]][0] for i in abort])
        if publish:
            self._publish(book, keys, objs, publish, out, s)
        book.forget(keys)
        return out

    def _publish(self, book: GvaBook, keys: Sequence[str], objs: dict[str, list[GvaObject]], idx: list[int],
                 out: list[MemCacheError | None], s: Session) -> None:
        """Header, then commit, for each object: its checksum from the digests fed while it was copied
        in (a replica written out of order is read back once to hash it); all replicas must agree."""
        assert self.engine is not None
        reps = [o for i in idx for o in objs[keys[i]]]
        whole = [(o, 0) for o in reps]
        try:
            if book.granted(reps, True, time.monotonic(), self.rpc.connects) is None:
                self._grant(book, whole, [o.size for o in reps], True)
        except MemCacheError as e:
            for i in idx:
                out[i] = e
            return
        sums: dict[GvaObject, int] = {}
        if self.config.checksum:
            unordered = []
            for o in reps:
                d = book.digest(o).value(o.size)
                if d is None:
                    unordered.append(o)
                else:
                    sums[o] = d
            sums.update(self._read_back(unordered))
        errs: dict[str, MemCacheError] = {}
        checksum: dict[str, int] = {}
        for o in reps:
            d = sums.get(o, 0) if self.config.checksum else 0
            if o in sums or not self.config.checksum:
                if checksum.setdefault(o.key, d) != d:
                    errs[o.key] = errors.ChecksumMismatch(f"{o.key!r}: its replicas were written with different bytes")
            else:
                errs.setdefault(o.key, errors.TransferFailed(f"{o.key!r}: reading it back to hash it failed"))
        headers = [np.frombuffer(pack_header(o.key, o.generation, o.size, checksum[o.key]), np.uint8)
                   for o in reps if o.key not in errs]
        ops = [CopyOp(self.segment_info(o.segment_id), o.offset, [(h.ctypes.data, HEADER_BYTES)], HEADER_BYTES, o.key,
                      o.generation, start=-HEADER_BYTES, with_header=False,   # the header's place, after the payload
                      epoch=o.fence)
               for o, h in zip([o for o in reps if o.key not in errs], headers, strict=True)]
        self.engine.write(ops)
        for op in ops:
            if op.error is not None:
                errs.setdefault(op.key, op.error)
        failed = [objs[k][0] for k in errs]
        if failed:
            self._abort(s, failed)
        done = [k for k in dict.fromkeys(o.key for o in reps) if k not in errs]
        codes = expect(self.rpc.call(p.Commit(s.client_id, s.token, done, [objs[k][0].generation for k in done],
                                              [checksum[k] for k in done])), p.Codes).codes if done else []
        code_of = dict(zip(done, codes, strict=True))
        # after the commit: a replica whose owner has died since lives in a file that leaves the pool with it
        stored = [op for op in ops if code_of.get(op.key) == errors.SUCCESS]
        gone = self.owners_gone(s, {op.segment.segment_id: op.segment for op in stored})
        for op in stored:
            if op.segment.segment_id in gone:
                errs.setdefault(op.key, errors.PeerUnavailable(
                    f"batch_write_finish of {op.key!r}: the owner of segment {op.segment.segment_id} died"))
        for i in idx:
            k = keys[i]
            if k in errs:
                out[i] = errs[k]
            elif code_of.get(k, errors.SUCCESS) != errors.SUCCESS:
                out[i] = errors.error_from_code(code_of[k], f"batch_write_finish of {k!r} refused")

    def _read_back(self, objs: list[GvaObject]) -> dict[GvaObject, int]:
        """The digests of replicas written out of order: each read back once (those that fail: absent)."""
        if not objs:
            return {}
        assert self.engine is not None
        scratch = [np.empty(o.size, np.uint8) for o in objs]
        reads = [CopyOp(self.segment_info(o.segment_id), o.offset, [(b.ctypes.data, o.size)], o.size, o.key,
                        o.generation) for o, b in zip(objs, scratch, strict=True)]
        self.engine.read(reads)
        return {o: xxhash.xxh3_64_intdigest(b.data) for o, b, r in zip(objs, scratch, reads, strict=True) if r.error is None}

    def _abort(self, s: Session, objs: list[GvaObject]) -> None:
        try:
            self.rpc.call(p.Abort(s.client_id, s.token, [o.key for o in objs], [o.generation for o in objs]))
        except MemCacheError as e:
            logger.warning("abort of %d objects not delivered (%s); the MetaService reclaims them", len(objs), e)
