"""A provider's disk tier: one record file per object under ``disk_path`` (format: ``disk_record.py``).

* **Index** in memory (key -> record), least recently used first; rebuilt at start by reading every
  record's header block (``scan``), so a provider restarted on the same directory reports its disk
  objects to the MetaService at ``Join``. Payloads are verified when read, not at the scan.
* **Writes** run on one background thread from a bounded queue (``QUEUE_BYTES``): ``offer`` never
  blocks (what does not fit is skipped and counted), so a put never waits on the disk. The writer
  copies the object out of the segment, hashes it and compares with the committed checksum (the DRAM
  copy may have been evicted and its space reused meanwhile: then nothing is written), makes room by
  dropping least-recently-used records when the tier is full, and writes the record under a temporary
  name, renamed into place. ``disk_write_limit`` caps its bytes per second.
* **Reads** (``read``) are bounded to ``READ_THREADS`` at once and verify the header and the payload
  checksum; a mismatch is a miss: counted, logged with key and path, the record deleted.
* **Direct I/O** with page-aligned buffers where the filesystem takes ``O_DIRECT``; elsewhere (tmpfs)
  buffered I/O, said once in the log.
* **Errors** (disk full, I/O error) are counted and logged (at most every ``LOG_EVERY_S``); a failed
  write leaves the object DRAM-only, a failed read is a miss (``DiskIOError``). Nothing raises out of
  the writer thread.
* **One provider per directory**: an exclusive ``flock`` on ``disk_path/LOCK`` (``disk_files.py``, with
  the scan and the direct-I/O probe).
* **Held directories**: ``disk_path`` is opened once, safely (``disk_files.open_tier_dirs``), and every
  record is opened, renamed and deleted relative to that descriptor, never by path again.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
import time

import xxhash

from ..errors import ChecksumMismatch, DiskIOError, KeyNotFound
from ..layout import footprint as segment_footprint
from ..layout import payload_offset
from ..memory import Mapping
from ..records import ObjectReport
from . import disk_record as rec
from .aligned import Aligned, AlignedPool
from .disk_counters import DiskCounters
from .disk_files import (
    NOFOLLOW,
    O_DIRECT,
    Record,
    open_tier_dirs,
    scan_records,
    supports_direct,
    take_lock,
    unlink,
)

logger = logging.getLogger(__name__)

QUEUE_BYTES = 64 << 20     # bytes of background writes queued at most; offers beyond are skipped
READ_THREADS = 4           # disk reads served at once
LOG_EVERY_S = 10.0
MAX_REPORTED = 1 << 20     # records a Join may carry (meta/validate.py MAX_REPORTS)
MAX_REMOVED = 1 << 14      # removed objects remembered against a copy being written


class DiskStore:
    def __init__(self, path: str, capacity: int, write_limit: int = 0, mac_key: bytes | None = None) -> None:
        self.root = os.path.abspath(path)
        self.objects_dir = os.path.join(self.root, "objects")   # for messages: files are reached by ``_dirs``
        self.mac_key = mac_key     # binds records to the pool (disk_record.py); None with auth off
        self._dirs = open_tier_dirs(self.root)
        self._fd = self._dirs.objects_fd
        try:
            self._lock_fd: int | None = take_lock(self._dirs)
        except BaseException:
            self._dirs.close()
            raise
        self.capacity = capacity
        self.write_limit = write_limit
        self.direct = supports_direct(self._fd, self.objects_dir)
        self.index: collections.OrderedDict[str, Record] = collections.OrderedDict()
        self.used = 0
        self.counters = DiskCounters()
        self._mu = threading.Lock()
        self._added: list[ObjectReport] = []
        self._dropped: list[ObjectReport] = []
        self._queue: collections.deque[tuple[ObjectReport, Mapping]] = collections.deque()
        # (key, generation) of objects removed lately: a copy of one being written is not kept (``remove``)
        self._removed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self.queued_bytes = 0
        self._cv = threading.Condition(self._mu)
        self._reads = threading.BoundedSemaphore(READ_THREADS)
        self._buffers = AlignedPool(READ_THREADS + 2)
        self._stop = False
        self._next_write = 0.0
        self._logged: dict[str, float] = {}
        self.on_written: list = []      # callables run after each write (the sync thread's wake-up)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="memcache-disk-writer", daemon=True)
        self._writer.start()

    # ---- reporting -------------------------------------------------------------------------------

    def reports(self) -> list[ObjectReport]:
        """Every record, for a Join (which supersedes the changes not yet synced). A Join carries at most
        ``MAX_REPORTED`` records: beyond that the least recently used are deleted (and said so)."""
        with self._mu:
            self._added, self._dropped = [], []
            extra = len(self.index) - MAX_REPORTED
            gone = [self.index.popitem(last=False) for _ in range(max(0, extra))]
            self.used -= sum(r.footprint for _, r in gone)
            out = [ObjectReport(k, 0, r.size, r.generation, r.checksum) for k, r in self.index.items()]
        for key, _r in gone:
            unlink(self._fd, rec.name_of(key))
        if gone:
            logger.warning("disk tier %s: %d records over the %d a provider reports were deleted", self.root,
                           len(gone), MAX_REPORTED)
        return out

    def take_changes(self) -> tuple[list[ObjectReport], list[ObjectReport]]:
        with self._mu:
            added, self._added = self._added, []
            dropped, self._dropped = self._dropped, []
            return added, dropped

    def restore_changes(self, added: list[ObjectReport], dropped: list[ObjectReport]) -> None:
        """Changes a sync could not deliver: sent again with the next one."""
        with self._mu:
            self._added[:0] = added
            self._dropped[:0] = dropped

    def room(self) -> int:
        return max(0, QUEUE_BYTES - self.queued_bytes)

    def holds(self, key: str) -> bool:
        with self._mu:
            return key in self.index

    # ---- writes ----------------------------------------------------------------------------------

    def offer(self, reports: list[ObjectReport], segment: Mapping) -> int:
        """Queue copies of these objects of ``segment``; never blocks. Returns how many were queued."""
        n = 0
        with self._cv:
            for r in reports:
                if self.queued_bytes + r.size > QUEUE_BYTES or self._stop:
                    self.counters.writes_skipped += 1
                    continue
                self._queue.append((r, segment))
                self.queued_bytes += r.size
                n += 1
            if n:
                self._cv.notify()
        return n

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                r, segment = self._queue.popleft()
            try:
                self._write(r, segment)
            except Exception:   # a bug must not end the writer
                logger.exception("disk tier: writing %r failed", r.key)
            finally:
                with self._cv:
                    self.queued_bytes -= r.size
            for cb in self.on_written:
                cb()
            self._throttle(r.size)

    def _throttle(self, nbytes: int) -> None:
        if not self.write_limit:
            return
        now = time.monotonic()
        self._next_write = max(now, self._next_write) + nbytes / self.write_limit
        with self._cv:
            self._cv.wait_for(lambda: self._stop, max(0.0, self._next_write - now))

    def _write(self, r: ObjectReport, segment: Mapping) -> None:
        fp = rec.footprint(r.size)
        if (not r.checksum or r.offset < 0 or r.offset + segment_footprint(r.size) > segment.size
                or fp > self.capacity):
            self.counters.writes_skipped += 1
            return
        with self._mu:
            cur = self.index.get(r.key)
            if cur is not None and cur.generation == r.generation:
                return
        buf = self._buffers.take(fp)
        try:
            mv = buf.view()
            ctypes.memmove(buf.addr + rec.BLOCK, segment.addr + payload_offset(r.offset), r.size)   # GIL released
            got = xxhash.xxh3_64_intdigest(mv[rec.BLOCK:rec.BLOCK + r.size])
            if got != r.checksum:
                self.counters.writes_stale += 1   # evicted and its space reused meanwhile
                return
            mv[:rec.BLOCK] = rec.pack_header(r.key, r.generation, r.size, got, self.mac_key)
            self._make_room(fp)
            tmp = self._write_file(r.key, mv)
        finally:
            mv.release()
            buf.close()
        if tmp is None:
            return
        with self._mu:   # renamed into place under the lock: a ``remove`` is either before (no record) or after
            if (r.key, r.generation) in self._removed:
                unlink(self._fd, tmp)
                return
            if not self._rename(r.key, tmp):
                return
            old = self.index.pop(r.key, None)
            self.used += fp - (old.footprint if old is not None else 0)
            self.index[r.key] = Record(r.generation, r.size, got)
            self._added.append(ObjectReport(r.key, 0, r.size, r.generation, got))
            self.counters.writes += 1
            self.counters.write_bytes += r.size

    def _write_file(self, key: str, data: memoryview) -> str | None:
        """The record written under a temporary name (returned), or None after an error (counted)."""
        final = rec.name_of(key)
        tmp = final + ".tmp"
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(final), 0o700, dir_fd=self._fd)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW | (O_DIRECT if self.direct else 0),
                         0o600, dir_fd=self._fd)
            try:
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], done)
            finally:
                os.close(fd)
        except OSError as e:
            self._write_failed(key, tmp, e)
            return None
        return tmp

    def _rename(self, key: str, tmp: str) -> bool:
        try:
            os.rename(tmp, tmp[:-len(".tmp")], src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as e:
            self._write_failed(key, tmp, e)
            return False
        return True

    def _write_failed(self, key: str, tmp: str, e: OSError) -> None:
        self.counters.write_errors += 1
        self._log("write", f"disk tier: cannot write {key!r} to {os.path.join(self.objects_dir, tmp)}: "
                           f"{e.strerror or e} ({self.counters.write_errors} write errors so far); it stays in "
                           f"DRAM only")
        unlink(self._fd, tmp)

    def _make_room(self, fp: int) -> None:
        """Drop least-recently-used records for good until ``fp`` more bytes fit."""
        with self._mu:
            while self.index and self.used + fp > self.capacity:
                key, r = self.index.popitem(last=False)
                self.used -= r.footprint
                unlink(self._fd, rec.name_of(key))
                self._dropped.append(ObjectReport(key, 0, r.size, r.generation, r.checksum))
                self.counters.lru_drops += 1

    def remove(self, reports: list[ObjectReport]) -> None:
        """Objects that left the pool (the owner's journal): delete their records, drop their queued
        copies, and refuse a copy being written now (compare on the generation). Returns once the files
        are gone, so a remove acknowledged after this never finds its record again after a restart."""
        gone = {(r.key, r.generation) for r in reports}
        with self._mu:
            for g in gone:
                self._removed[g] = None
            while len(self._removed) > MAX_REMOVED:
                self._removed.popitem(last=False)
            kept = collections.deque(q for q in self._queue if (q[0].key, q[0].generation) not in gone)
            self.queued_bytes -= sum(q[0].size for q in self._queue) - sum(q[0].size for q in kept)
            self._queue = kept
        self.drop(reports)

    def drop(self, reports: list[ObjectReport]) -> None:
        """Delete records of objects that left the pool (compare-and-delete on the generation)."""
        for r in reports:
            with self._mu:
                cur = self.index.get(r.key)
                if cur is None or cur.generation != r.generation:
                    continue
                del self.index[r.key]
                self.used -= cur.footprint
            unlink(self._fd, rec.name_of(r.key))

    # ---- reads -----------------------------------------------------------------------------------

    def read(self, key: str, size: int, checksum: int) -> tuple[Aligned, memoryview]:
        """The record's verified payload: (its buffer, to close when done; a view of the payload).

        KeyNotFound when no record of this object is here; ChecksumMismatch when its bytes fail (the
        record is deleted); DiskIOError when the disk fails."""
        with self._mu:
            r = self.index.get(key)
            if r is None or r.size != size or (checksum and r.checksum != checksum):
                raise KeyNotFound(f"{key!r} ({size} bytes) is not on the disk tier {self.root}")
            self.index.move_to_end(key)
        rel = rec.name_of(key)
        path = os.path.join(self.objects_dir, rel)
        buf = self._buffers.take(r.footprint)
        try:
            with self._reads:
                self._read_file(key, rel, path, buf.view())
            self._verify(key, path, r, buf.view())
        except BaseException:
            buf.close()
            raise
        self.counters.reads += 1
        self.counters.read_bytes += size
        return buf, buf.view()[rec.BLOCK:rec.BLOCK + size]

    def _read_file(self, key: str, rel: str, path: str, mv: memoryview) -> None:
        try:
            fd = os.open(rel, os.O_RDONLY | NOFOLLOW | (O_DIRECT if self.direct else 0), dir_fd=self._fd)
        except FileNotFoundError as e:
            self._forget(key)
            raise KeyNotFound(f"{key!r}: its record {path} is gone") from e
        except OSError as e:
            self.counters.read_errors += 1
            raise DiskIOError(f"disk tier: cannot open {path} for {key!r}: {e.strerror}") from e
        try:
            got = 0
            while got < len(mv):
                n = os.preadv(fd, [mv[got:]], got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            self.counters.read_errors += 1
            raise DiskIOError(f"disk tier: reading {path} for {key!r} failed: {e.strerror}") from e
        finally:
            os.close(fd)

    def _verify(self, key: str, path: str, r: Record, mv: memoryview) -> None:
        h = rec.unpack_header(mv[:rec.BLOCK], self.mac_key)
        why = None
        if h is None or h != (key, r.generation, r.size, r.checksum):
            why = "its header does not match"
        elif xxhash.xxh3_64_intdigest(mv[rec.BLOCK:rec.BLOCK + r.size]) != r.checksum:
            why = "its payload fails the checksum"
        if why is None:
            return
        self.counters.integrity_failures += 1
        logger.error("disk tier integrity failure: %r in %s: %s; the record is discarded", key, path, why)
        self._forget(key, r)
        raise ChecksumMismatch(f"{key!r} on the disk tier ({path}): {why}")

    def _forget(self, key: str, r: Record | None = None) -> None:
        """Take a record out (corrupt or gone) and report it dropped."""
        with self._mu:
            cur = self.index.get(key)
            if cur is None or (r is not None and cur is not r):
                return
            del self.index[key]
            self.used -= cur.footprint
            self._dropped.append(ObjectReport(key, 0, cur.size, cur.generation, cur.checksum))
        unlink(self._fd, rec.name_of(key))

    # ---- start / stop ------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the record headers (oldest file first = least recently used)."""
        t0 = time.monotonic()
        found, bad = scan_records(self._fd, self.objects_dir, self.mac_key)
        for _mtime, key, r in sorted(found, key=lambda x: x[0]):
            self.index[key] = r
            self.used += r.footprint
        self._make_room(0)
        self._dropped = []
        logger.info("disk tier %s: %d records (%d bytes of %d) found in %.3fs, %d unreadable ones removed; "
                    "%s I/O", self.root, len(self.index), self.used, self.capacity, time.monotonic() - t0, bad,
                    "direct" if self.direct else "buffered")

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        self._writer.join(timeout=10)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
            self._dirs.close()

    def _log(self, what: str, msg: str) -> None:
        now = time.monotonic()
        if now >= self._logged.get(what, 0.0):
            self._logged[what] = now + LOG_EVERY_S
            logger.warning(msg)
