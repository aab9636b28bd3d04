"""A provider's disk tier in the pool: syncing with the MetaService, serving disk reads, promotion.

* **Sync** (a thread, every ``SYNC_INTERVAL_S`` at most, sooner after writes): report the records
  written and dropped, the tier's state and the writer queue's room; queue the copies the MetaService
  asks for (``offload``) and delete the records of objects that left the pool (``drop``).
* **Reads**: a reader whose object is on disk only asks the provider (``read_disk``): through the data
  server (``transfer/disk_wire.py``), or directly when the reader is the provider itself. The
  provider verifies the record; the reader verifies the bytes in its own buffer as for DRAM reads.
* **Promotion**: an object the provider served from disk ``PROMOTE_AFTER`` times within
  ``PROMOTE_WINDOW_S`` is brought back into its DRAM segment in the background; ``prefetch`` does
  it at once. A promotion asks the MetaService for space in the provider's own segment (``Promote``),
  copies the verified record there (header last) and reports it (``Promoted``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import xxhash

from .. import errors
from .. import protocol as p
from ..auth import disk_record_key
from ..config import parse_size
from ..errors import ChecksumMismatch, KeyNotFound, MemCacheError
from ..fence import tokens
from ..layout import pack_header, payload_offset
from ..memory import view_at
from ..rpc import expect
from ..transfer.disk_wire import OP_DISK_READ, OP_PROMOTE
from . import disk_record
from .aligned import Aligned
from .disk import DiskStore
from .session import Member, Pieces, clip

logger = logging.getLogger(__name__)

SYNC_INTERVAL_S = 0.1
MIN_SYNC_GAP_S = 0.02
PROMOTE_AFTER = 2          # disk reads of one object ...
PROMOTE_WINDOW_S = 60.0    # ... within this long bring it back into DRAM
MAX_PROMOTE_QUEUE = 1024
READ_STREAMS = 4           # disk reads of one batch from one provider run in this many parts at once
PARALLEL_BYTES = 1 << 20   # smaller batches are read in one part


class Provider(Member, Protocol):
    """A member with the disk tier under its segment, if it has one (``disk_path``)."""

    disk: DiskTier | None


class DiskTier:
    def __init__(self, svc: Member) -> None:
        cfg = svc.config
        self.svc = svc
        self.policy = cfg.disk_write_policy
        self.store = DiskStore(cfg.disk_path, parse_size(cfg.disk_size, "disk_size"),
                               parse_size(cfg.disk_write_limit, "disk_write_limit"),
                               disk_record_key(svc.secret) if svc.secret is not None else None)
        self._wake = threading.Event()
        self.store.on_written.append(self._wake.set)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hits: dict[str, tuple[int, float]] = {}
        self._to_promote: dict[str, tuple[int, int]] = {}   # key -> (size, checksum)
        self._lock = threading.Lock()
        self.promotion_failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="memcache-disk-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.store.close()

    # ---- sync ------------------------------------------------------------------------------------

    def poke(self) -> None:
        """Sync soon (a put of ours may have filled our segment towards its offload mark)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(SYNC_INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self.sync():
                    self._wake.set()   # copies were asked for: ask again as soon as they are queued
                self._promote_queued()
            except Exception:   # a bug must not end the sync
                logger.exception("disk tier sync failed")
            self._stop.wait(MIN_SYNC_GAP_S)

    def counters(self) -> dict[str, int]:
        c = dict(vars(self.store.counters))
        c["objects"] = len(self.store.index)
        c["used_bytes"] = self.store.used
        c["queued_bytes"] = self.store.queued_bytes
        c["promotion_failures"] = self.promotion_failures
        return c

    def sync(self) -> bool:
        """One exchange with the MetaService; True when it asked for copies."""
        st = self.store
        added, dropped = st.take_changes()
        try:
            work = expect(self.svc.member_call(lambda s: p.DiskSync(
                s.client_id, s.token, self.policy, st.capacity, st.used, st.room(), added, dropped,
                self.counters())), p.DiskWork)
        except MemCacheError as e:
            st.restore_changes(added, dropped)
            logger.debug("disk sync: %s", e)
            return False
        st.drop(work.drop)
        if work.promote:   # the admin's /memory/prefetch: promote them with the next queued ones
            with self._lock:
                for r in work.promote[:max(0, MAX_PROMOTE_QUEUE - len(self._to_promote))]:
                    self._to_promote[r.key] = (r.size, r.checksum)
            self._wake.set()
        if work.offload and self.svc.segment is not None:
            return st.offer(work.offload, self.svc.segment) > 0
        return False

    # ---- reads served here -------------------------------------------------------------------------

    def read(self, key: str, size: int, checksum: int) -> tuple[Aligned, memoryview]:
        """For the data server: a verified record (counts the hit for promotion)."""
        out = self.store.read(key, size, checksum)
        self._note_hit(key, size, checksum)
        return out

    def read_into(self, items: list[tuple[str, int, int, Pieces]]) -> list[MemCacheError | None]:
        errs: list[MemCacheError | None] = []
        for key, size, checksum, pieces in items:
            try:
                buf, view = self.read(key, size, checksum)
            except MemCacheError as e:
                errs.append(e)
                continue
            pos = buf.addr + disk_record.BLOCK
            for ptr, n in pieces:
                ctypes.memmove(ptr, pos, n)   # releases the GIL
                pos += n
            view.release()
            buf.close()
            errs.append(None)
        return errs

    def _note_hit(self, key: str, size: int, checksum: int) -> None:
        now = time.monotonic()
        with self._lock:
            n, since = self._hits.get(key, (0, now))
            if now - since > PROMOTE_WINDOW_S:
                n, since = 0, now
            n += 1
            if n >= PROMOTE_AFTER and len(self._to_promote) < MAX_PROMOTE_QUEUE:
                self._to_promote[key] = (size, checksum)
                self._hits.pop(key, None)
                self._wake.set()
            else:
                self._hits[key] = (n, since)
            if len(self._hits) > 100_000:
                self._hits.clear()

    # ---- promotion ---------------------------------------------------------------------------------

    def _promote_queued(self) -> None:
        with self._lock:
            todo, self._to_promote = self._to_promote, {}
        if todo:
            self.promote_local([(k, s, c) for k, (s, c) in todo.items()])

    def promote_local(self, items: list[tuple[str, int, int]]) -> list[int]:
        """Bring records of this tier back into our own segment. A code per object (0: in DRAM now)."""
        if len(items) > p.MAX_KEYS:   # one request carries at most MAX_KEYS keys
            return [c for i in range(0, len(items), p.MAX_KEYS) for c in self.promote_local(items[i:i + p.MAX_KEYS])]
        if not items or self.svc.segment is None:
            return [errors.OBJECT_NOT_EXISTS] * len(items)
        t0 = time.monotonic()
        try:
            answer, granted_in = self.svc.member_call_in(
                lambda s: p.Promote(s.client_id, s.token, [k for k, _, _ in items]))
            res = expect(answer, p.AllocReply).results
        except MemCacheError as e:
            return [e.code] * len(items)
        codes, done = [], []
        for (key, size, checksum), r in zip(items, res, strict=True):
            if r.code != errors.SUCCESS:
                codes.append(errors.SUCCESS if r.code == errors.OBJECT_ALREADY_EXISTS else r.code)
                continue
            off = r.locations[0].offset
            # as a put: once half the pending timeout has passed, the space may be given back; do not write
            late = time.monotonic() - t0 >= self.svc.session.pending_timeout_s / 2
            try:
                fence = tokens(r.fences, 1, granted_in.epoch, f"promotion of {key!r}")[0]
            except MemCacheError as e:
                logger.info("%s", e)
                late, fence = True, 0
            ok = not late and self._copy_in(key, size, checksum, r.generation, off, fence)
            done.append((key, off, ok))
            codes.append(errors.SUCCESS if ok else errors.DISK_IO_ERROR)
        return self._report_promoted(done, codes, items)

    def _copy_in(self, key: str, size: int, checksum: int, generation: int, off: int, epoch: int) -> bool:
        """Copy a record into the space granted in our segment under fence token ``epoch`` (refused by
        the segment's fence if we re-joined since: ``fence.py``)."""
        seg = self.svc.segment
        assert seg is not None
        try:
            buf, view = self.store.read(key, size, checksum)
        except MemCacheError as e:
            logger.info("promotion of %r: %s", key, e)
            self.promotion_failures += 1
            return False
        try:
            seg.fence.enter(epoch, f"promotion of {key!r}")
        except MemCacheError as e:
            logger.info("%s", e)
            view.release()
            buf.close()
            self.promotion_failures += 1
            return False
        try:
            ctypes.memmove(seg.addr + payload_offset(off), buf.addr + disk_record.BLOCK, size)
            got = checksum or xxhash.xxh3_64_intdigest(view)
            header = pack_header(key, generation, size, got)
            seg.view(off, len(header))[:] = header   # last: a valid header means a whole payload
        finally:
            seg.fence.leave()
            view.release()
            buf.close()
        return True

    def _report_promoted(self, done: list[tuple[str, int, bool]], codes: list[int],
                         items: list[tuple[str, int, int]]) -> list[int]:
        if not done:
            return codes
        try:
            answers = expect(self.svc.member_call(lambda s: p.Promoted(
                s.client_id, s.token, [k for k, _, _ in done], [o for _, o, _ in done], [ok for _, _, ok in done])),
                p.Codes).codes
        except MemCacheError as e:
            answers = [e.code] * len(done)
        by_key = dict(zip([k for k, _, _ in done], answers, strict=True))
        self.store.counters.promotions += sum(1 for c in answers if c == errors.SUCCESS)
        return [by_key.get(k, c) if c == errors.SUCCESS else c for (k, _, _), c in zip(items, codes, strict=True)]


def read_disk(svc: Provider, keys: list[str], pieces: list[Pieces], found: list[p.Found | None],
              idx: list[int], verify: bool) -> dict[int, MemCacheError | None]:
    """Read the objects of keys ``idx`` from the providers holding their records, straight into
    ``pieces``: each key's outcome (None: read)."""
    read: dict[int, MemCacheError | None] = {}
    by_owner: dict[int, list[int]] = {}
    for i in idx:
        f = found[i]
        if f is None or not f.disk:
            read[i] = KeyNotFound(f"{keys[i]!r} has no copy left")
            continue
        by_owner.setdefault(f.disk, []).append(i)
    for sid, owned in by_owner.items():
        items = [(keys[i], found[i].size, found[i].checksum, clip(pieces[i], found[i].size))  # type: ignore[union-attr]
                 for i in owned]
        errs = _read_from(svc, sid, items)
        for i, e, item in zip(owned, errs, items, strict=True):
            if e is None and verify and item[2] and _digest(item[3]) != item[2]:
                e = ChecksumMismatch(f"{keys[i]!r} read from the disk tier of {sid}: wrong checksum in the reader")
            read[i] = e
    return read


def _read_from(svc: Provider, sid: int, items: list) -> list[MemCacheError | None]:
    """Read ``items`` from provider ``sid``, in up to ``READ_STREAMS`` parts at once (the provider
    reads records in parallel; a direct read releases the GIL)."""
    parts = [items[i::READ_STREAMS] for i in range(min(READ_STREAMS, len(items)))]
    if len(parts) == 1 or sum(size for _, size, _, _ in items) < PARALLEL_BYTES:
        return _read_part(svc, sid, items)
    errs: list[MemCacheError | None] = [None] * len(items)
    for i, got in enumerate(_pool().map(lambda part: _read_part(svc, sid, part), parts)):
        errs[i::READ_STREAMS] = got
    return errs


def _read_part(svc: Provider, sid: int, items: list) -> list[MemCacheError | None]:
    if svc.disk is not None and sid == svc.client_id:
        return svc.disk.read_into(items)
    try:
        assert svc.engine is not None
        return svc.engine.tcp.disk_request(svc.segment_info(sid).data_addr, OP_DISK_READ, items, sid)
    except MemCacheError as e:
        return [e] * len(items)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The threads that read disk records for this process's readers (shared, created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(READ_STREAMS, thread_name_prefix="memcache-disk-read")
        return _POOL


def promote_remote(svc: Provider, sid: int, items: list[tuple[str, int, int]]) -> list[int]:
    """Ask provider ``sid`` to bring these records of its disk tier into its DRAM segment."""
    if svc.disk is not None and sid == svc.client_id:
        return svc.disk.promote_local(items)
    try:
        assert svc.engine is not None
        errs = svc.engine.tcp.disk_request(svc.segment_info(sid).data_addr, OP_PROMOTE,
                                           [(k, s, c, []) for k, s, c in items], sid)
    except MemCacheError as e:
        return [e.code] * len(items)
    return [errors.SUCCESS if e is None else e.code for e in errs]


def _digest(pieces: Pieces) -> int:
    h = xxhash.xxh3_64()
    for ptr, n in pieces:
        h.update(view_at(ptr, n))
    return h.intdigest()
