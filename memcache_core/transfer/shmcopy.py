"""A batch of shared-memory copies split over copy threads, piece by piece: the pure-Python loop.

``copy_batch`` maps (pins) the batch's segments, then hands the batch to the native loop
(``shmloop.py``) when it is loaded, else copies it here. On one thread (``copy_each``) each op is copied straight from its pieces, one ``memmove`` per piece:
the least Python work per piece. On several, the batch's pieces become runs (``plan.py``: pieces
that touch in the caller's memory merged) cut into parts of about equal bytes, two per thread; the
calling thread and the copy pool's threads claim parts until none is left (``memmove`` releases the
GIL), so a pool thread that gets no core in time leaves its share to the caller instead of holding
the batch up. Hashed pieces are sliced from one view per op over the span of its pieces.

Checksums stream over an object's bytes in order, so an op copied by one thread from end to end is
hashed next to its copies, in 256 KiB slices (copied, then hashed while still in L2), and its header
(writes) or its verdict (reads) follows at once. An op cut between parts is hashed in order, once,
by whichever thread finishes the last of its parts; a write's header is written only then, after
every byte of its payload.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import xxhash

from ..errors import MemCacheError, TransferFailed
from ..memory import Mapping, view_at
from .native import NativeLoop
from .plan import Run, coalesce, ops_per_part, split_runs
from .shm import ShmTransport, memmove
from .shmloop import copy_native, finish, verify

__all__ = ["copy_batch", "verify"]

if TYPE_CHECKING:
    from .ops import CopyOp

logger = logging.getLogger(__name__)

HASH_SLICE = 256 << 10    # copied then hashed while still in L2
PARTS_PER_THREAD = 2      # parts are claimed, so a thread that starts late takes fewer


class _Batch:
    """One batch's runs, parts and the bookkeeping of ops cut between parts."""

    def __init__(self, ops: list[CopyOp], bases: dict[str, int], reading: bool, nparts: int) -> None:
        self.ops, self.reading, self.bases = ops, reading, bases
        runs: list[Run] = []
        for i, op in enumerate(ops if nparts else []):
            base = bases.get(op.segment.shm_path)
            if base is not None and op.error is None:
                _add_runs(runs, i, op.pieces, base + op.payload_offset, reading)
        self.parts = split_runs(runs, nparts) if nparts else []   # none for copy_each
        self.left = ops_per_part(self.parts, len(ops))
        self.whole = [n == 1 for n in self.left]   # copied end to end by one thread: hash as we go
        self._lock = threading.Lock()
        self._claimed = 0
        self._unfinished = len(self.parts)
        self.finished = threading.Event()
        if not self.parts:
            self.finished.set()

    def copy_each(self) -> None:
        """One thread: each op end to end, straight from its pieces (no runs, no parts)."""
        for i, op in enumerate(self.ops):
            base = self.bases.get(op.segment.shm_path)
            if base is None or op.error is not None:
                continue
            try:
                h = xxhash.xxh3_64() if self.hashing(op) else None
                self._copy_pieces(i, base + op.payload_offset, h)
                self.finish(op, h.intdigest() if h is not None else None)
            except MemCacheError as e:
                op.error = e
            except Exception as e:  # noqa: BLE001 - a copy bug fails the op, never the batch
                logger.exception("shared-memory copy failed")
                op.error = TransferFailed(str(e))

    def _copy_pieces(self, i: int, pos: int, h: xxhash.xxh3_64 | None) -> None:
        move, pieces = memmove, self.ops[i].pieces
        if h is None and self.reading:
            for ptr, n in pieces:
                move(ptr, pos, n)
                pos += n
        elif h is None:
            for ptr, n in pieces:
                move(pos, ptr, n)
                pos += n
        else:
            span, lo = self.view(i)
            for ptr, n in pieces:
                dst, src = (ptr, pos) if self.reading else (pos, ptr)
                if n > HASH_SLICE:
                    self._copy_hashed(h, span, ptr - lo, dst, src, n)
                elif self.reading:
                    move(dst, src, n)
                    h.update(span[ptr - lo:ptr - lo + n])
                else:
                    h.update(span[ptr - lo:ptr - lo + n])
                    move(dst, src, n)
                pos += n

    def work(self) -> None:
        """Copy parts until none is left to claim. The calling thread and the pool threads all run
        this, so a pool thread that gets no core in time leaves its parts to the others."""
        while True:
            with self._lock:
                k, self._claimed = self._claimed, self._claimed + 1
            if k >= len(self.parts):
                return
            try:
                self.copy(self.parts[k])
            finally:
                with self._lock:
                    self._unfinished -= 1
                    if self._unfinished == 0:
                        self.finished.set()

    def hashing(self, op: CopyOp) -> bool:
        return op.hash and (bool(op.checksum) or not self.reading)

    def view(self, i: int) -> tuple[memoryview, int]:
        """A view over the caller's memory the op's pieces lie in, and its first address."""
        lo, n = _span(self.ops[i].pieces)
        return view_at(lo, n), lo

    def copy(self, part: list[Run]) -> None:
        """Copy one part; finish each op whose last part this was. (The per-piece work is this loop:
        kept to a memmove, and for hashed ops a slice and a hash update.)"""
        cur, h, span, lo, reading, move = -1, None, memoryview(b""), 0, self.reading, memmove
        try:
            for i, dst, src, n in part:
                if i != cur:
                    if cur >= 0:
                        self._done(cur, h)
                    cur, op = i, self.ops[i]
                    h = xxhash.xxh3_64() if self.whole[i] and self.hashing(op) else None
                    if h is not None:
                        span, lo = self.view(i)
                if h is None:
                    move(dst, src, n)
                elif n > HASH_SLICE:
                    self._copy_hashed(h, span, (dst if reading else src) - lo, dst, src, n)
                elif reading:
                    move(dst, src, n)
                    h.update(span[dst - lo:dst - lo + n])
                else:
                    h.update(span[src - lo:src - lo + n])
                    move(dst, src, n)
            if cur >= 0:
                self._done(cur, h)
        except Exception as e:  # noqa: BLE001 - a copy bug fails the ops of this part, never the batch
            logger.exception("shared-memory copy failed")
            for i, *_ in part:
                self.ops[i].error = self.ops[i].error or TransferFailed(str(e))

    def _copy_hashed(self, h: xxhash.xxh3_64, span: memoryview, at: int, dst: int, src: int, n: int) -> None:
        """Copy and hash (the source before a write's copy, the destination after a read's) in slices
        that stay in the core's cache between the copy and the hash."""
        for off in range(0, n, HASH_SLICE):
            m = min(HASH_SLICE, n - off)
            if not self.reading:
                h.update(span[at + off:at + off + m])
            memmove(dst + off, src + off, m)
            if self.reading:
                h.update(span[at + off:at + off + m])

    def _done(self, i: int, h: xxhash.xxh3_64 | None) -> None:
        with self._lock:
            self.left[i] -= 1
            last = self.left[i] == 0
        if not last:
            return
        op = self.ops[i]
        if h is None and self.hashing(op):
            h = xxhash.xxh3_64()
            span, lo = self.view(i)
            for ptr, n in coalesce(op.pieces):
                h.update(span[ptr - lo:ptr - lo + n])
        try:
            self.finish(op, h.intdigest() if h is not None else None)
        except MemCacheError as e:
            op.error = e

    def finish(self, op: CopyOp, digest: int | None) -> None:
        finish(op, self.reading, self.bases, digest)


def copy_batch(ops: list[CopyOp], reading: bool, shm: ShmTransport, pool: ThreadPoolExecutor | None,
               threads: int, loop: NativeLoop | None = None) -> None:
    """Copy every op through shared memory on up to ``threads`` threads (this one and the pool's):
    with the native ``loop`` whole objects per thread (``shmloop.py``), else in twice as many parts
    as threads; failures are recorded per op in ``op.error``."""
    with contextlib.ExitStack() as stack:
        maps: dict[str, Mapping] = {}
        unmapped: set[str] = set()
        held: set[tuple[str, int]] = set()
        for op in ops:
            path = op.segment.shm_path
            if path in unmapped:
                continue
            try:
                m = maps.get(path)
                if m is None:
                    m = maps[path] = stack.enter_context(shm.pinned(op.segment))
            except MemCacheError as e:
                unmapped.add(path)
                for other in ops:
                    if other.segment.shm_path == path:
                        other.error = e
                continue
            if reading or not op.epoch or (path, op.epoch) in held:
                continue
            held.add((path, op.epoch))
            try:   # held until every copy of the batch ended: the owner's re-join waits for them
                m.fence.enter(op.epoch, f"write of {op.key!r}")
                stack.callback(m.fence.leave)
            except MemCacheError as e:
                for other in ops:
                    if other.segment.shm_path == path and other.epoch == op.epoch:
                        other.error = e
        bases = {path: m.addr for path, m in maps.items()}
        if loop is not None:
            copy_native(loop, ops, bases, reading, pool, threads)
            return
        if pool is None or threads <= 1:
            _Batch(ops, bases, reading, 0).copy_each()
            return
        batch = _Batch(ops, bases, reading, PARTS_PER_THREAD * threads)
        for i, op in enumerate(ops):   # nothing to copy (no pieces): finish it here
            if batch.left[i] == 0 and op.error is None and op.segment.shm_path in bases:
                batch.left[i] = 1
                batch._done(i, None)
        for _ in range(min(threads, len(batch.parts)) - 1):
            pool.submit(batch.work)   # type: ignore[union-attr]
        batch.work()
        batch.finished.wait()


def _span(pieces: list[tuple[int, int]]) -> tuple[int, int]:
    """(lowest address, length) of the memory the pieces lie in."""
    if not pieces:
        return 0, 0
    lo, hi = pieces[0][0], pieces[0][0] + pieces[0][1]
    for p, n in pieces:
        if p < lo:
            lo = p
        if p + n > hi:
            hi = p + n
    return lo, hi - lo


def _add_runs(runs: list[Run], i: int, pieces: list[tuple[int, int]], pos: int, reading: bool) -> None:
    """Op ``i``'s pieces as runs from segment address ``pos`` on, a piece that starts where the one
    before it ends merged into its run (one pass: this is per-piece work)."""
    end = -1
    for ptr, n in pieces:
        if ptr == end:
            j, d, s, m = runs[-1]
            runs[-1] = (j, d, s, m + n)
        elif reading:
            runs.append((i, ptr, pos, n))
        else:
            runs.append((i, pos, ptr, n))
        pos += n
        end = ptr + n
