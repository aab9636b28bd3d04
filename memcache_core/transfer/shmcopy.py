"""A batch of shared-memory copies split over copy threads, piece by piece.

The batch's pieces become runs (``plan.py``) cut into parts of about equal bytes, two per thread; the
calling thread and the copy pool's threads claim parts until none is left (``memmove`` releases the
GIL), so a pool thread that gets no core in time leaves its share to the caller instead of holding
the batch up. Per-piece Python
work is kept small: one view per op over the span of its pieces, sliced per piece for hashing.

Checksums stream over an object's bytes in order, so an op copied by one thread from end to end is
hashed piece by piece next to its copies, as before, and its header (writes) or its verdict (reads)
follows at once. An op cut between parts is hashed in order, once, by whichever thread finishes the
last of its parts (the bytes were just copied and are still in the cache); a write's header is
written only then, after every byte of its payload.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import xxhash

from ..errors import ChecksumMismatch, MemCacheError, TransferFailed
from ..memory import view_at
from .plan import Run, coalesce, ops_per_part, split_runs
from .shm import ShmTransport, memmove

if TYPE_CHECKING:
    from .engine import CopyOp

logger = logging.getLogger(__name__)

HASH_SLICE = 256 << 10    # copied then hashed while still in L2
PARTS_PER_THREAD = 2      # parts are claimed, so a thread that starts late takes fewer


class _Batch:
    """One batch's runs, parts and the bookkeeping of ops cut between parts."""

    def __init__(self, ops: list[CopyOp], bases: dict[str, int], reading: bool, nparts: int) -> None:
        self.ops, self.reading, self.bases = ops, reading, bases
        runs: list[Run] = []
        self.spans: list[tuple[int, int]] = []     # per op: the caller's memory its pieces lie in
        for i, op in enumerate(ops):
            pieces = coalesce(op.pieces)
            lo = min((p for p, _ in pieces), default=0)
            self.spans.append((lo, max((p + n for p, n in pieces), default=lo) - lo))
            base = bases.get(op.segment.shm_path)
            if base is None or op.error is not None:
                continue
            pos = base + op.payload_offset
            for ptr, n in pieces:
                runs.append((i, ptr, pos, n) if reading else (i, pos, ptr, n))
                pos += n
        self.parts = split_runs(runs, nparts)
        self.left = ops_per_part(self.parts, len(ops))
        self.whole = [n == 1 for n in self.left]   # copied end to end by one thread: hash as we go
        self._lock = threading.Lock()
        self._claimed = 0
        self._unfinished = len(self.parts)
        self.finished = threading.Event()
        if not self.parts:
            self.finished.set()

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

    def view(self, i: int) -> memoryview:
        lo, n = self.spans[i]
        return view_at(lo, n)

    def copy(self, part: list[Run]) -> None:
        """Copy one part; finish each op whose last part this was."""
        cur, h, span, lo = -1, None, None, 0
        try:
            for i, dst, src, n in part:
                if i != cur:
                    if cur >= 0:
                        self._done(cur, h)
                    cur, op = i, self.ops[i]
                    h = xxhash.xxh3_64() if self.whole[i] and self.hashing(op) else None
                    span, lo = (self.view(i), self.spans[i][0]) if h is not None else (None, 0)
                if h is None:
                    memmove(dst, src, n)
                else:
                    self._copy_hashed(h, span, (dst if self.reading else src) - lo, dst, src, n)  # type: ignore[arg-type]
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
            span, lo = self.view(i), self.spans[i][0]
            for ptr, n in coalesce(op.pieces):
                h.update(span[ptr - lo:ptr - lo + n])
        try:
            self.finish(op, h.intdigest() if h is not None else None)
        except MemCacheError as e:
            op.error = e

    def finish(self, op: CopyOp, digest: int | None) -> None:
        """Reads: compare with the committed checksum. Writes: the header, after the whole payload."""
        if self.reading:
            if digest is not None:
                verify(op, digest)
            return
        if digest is not None:
            op.checksum = digest
        header = op.header()
        memmove(self.bases[op.segment.shm_path] + op.offset, header, len(header))   # last: a valid header


def copy_batch(ops: list[CopyOp], reading: bool, shm: ShmTransport, pool: ThreadPoolExecutor | None,
               threads: int) -> None:
    """Copy every op through shared memory on up to ``threads`` threads (this one and the pool's), in
    twice as many parts; failures are recorded per op in ``op.error``."""
    with contextlib.ExitStack() as stack:
        bases: dict[str, int] = {}
        for op in ops:
            path = op.segment.shm_path
            if path in bases:
                continue
            try:
                bases[path] = stack.enter_context(shm.pinned(op.segment))
            except MemCacheError as e:
                for other in ops:
                    if other.segment.shm_path == path:
                        other.error = e
        batch = _Batch(ops, bases, reading, PARTS_PER_THREAD * threads if pool is not None and threads > 1 else 1)
        for i, op in enumerate(ops):   # nothing to copy (no pieces): finish it here
            if batch.left[i] == 0 and op.error is None and op.segment.shm_path in bases:
                batch.left[i] = 1
                batch._done(i, None)
        for _ in range(min(threads, len(batch.parts)) - 1):
            pool.submit(batch.work)   # type: ignore[union-attr]
        batch.work()
        batch.finished.wait()


def verify(op: CopyOp, got: int) -> None:
    if got != op.checksum:
        raise ChecksumMismatch(f"{op.key!r} (generation {op.generation}) read from segment "
                               f"{op.segment.segment_id} offset {op.offset}: checksum {got:#018x}, "
                               f"committed {op.checksum:#018x}")
