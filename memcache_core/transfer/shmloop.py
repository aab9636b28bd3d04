"""A shared-memory batch through the native copy loop (``native.py``): whole objects per thread.

One call of the loop copies and hashes a list of ops without the GIL, each op in slices that are
hashed while still in L1/L2. On one thread the whole batch is one call. On several, a batch of two or
more objects is cut between objects only, into groups of about equal bytes (four per thread, so
at most a group's time is lost to a thread that loses its core mid-group), claimed by the calling thread and the copy pool's threads until none is left, so no object
is hashed in a pass of its own and a pool thread that gets no core in time leaves its share to the
others. A single object of 16 MiB or more is cut in byte ranges of about 1 MiB that the pool's threads copy from the
front; the calling thread goes through them in order (the hash streams over the object in order),
copying and hashing each range no pool thread took yet, hashing only what a pool thread copied once
it is done, and while it waits, copying ranges from the back itself.

A read's verdict (checksum compared) or a write's header (after its whole payload) follows the call
that finished the op.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from ..errors import ChecksumMismatch, MemCacheError
from .native import (
    ALL,
    COPY,
    DIGEST,
    DIGEST_AT,
    FLAGS_AT,
    HASH,
    READ,
    RESET,
    ROW,
    SLICE,
    WRITE_SLICE,
    NativeLoop,
    flat_pieces,
)
from .shm import memmove

if TYPE_CHECKING:
    from .ops import CopyOp

GROUPS_PER_THREAD = 4       # groups are claimed: a thread that starts late or loses its core takes fewer
MIN_CUT = 16 << 20          # a single object smaller than this is not cut between threads (measured:
                            # an 8.6 MiB object cut over 2 threads was no faster than on one)
RANGE = 1 << 20             # the byte ranges it is cut in, at least one per thread


def hashing(op: CopyOp, reading: bool) -> bool:
    """Writes hash when asked; reads only when there is a committed checksum to compare with."""
    return op.hash and (bool(op.checksum) or not reading)


def finish(op: CopyOp, reading: bool, bases: dict[str, int], digest: int | None) -> None:
    """Reads: compare with the committed checksum. Writes: the header, after the whole payload."""
    if reading:
        if digest is not None:
            verify(op, digest)
        return
    if digest is not None:
        op.checksum = digest
    if not op.with_header:   # a range of the payload (the GVA path): the header comes at finish
        return
    header = op.header()
    memmove(bases[op.segment.shm_path] + op.offset, header, len(header))   # last: a valid header


def verify(op: CopyOp, got: int) -> None:
    if got != op.checksum:
        raise ChecksumMismatch(f"{op.key!r} (generation {op.generation}) read from segment "
                               f"{op.segment.segment_id} offset {op.offset}: checksum {got:#018x}, "
                               f"committed {op.checksum:#018x}")


def copy_native(loop: NativeLoop, ops: list[CopyOp], bases: dict[str, int], reading: bool,
                pool: ThreadPoolExecutor | None, threads: int) -> None:
    """Copy the ops whose segment is mapped (``bases``) and that carry no error yet."""
    live = [op for op in ops if op.error is None and op.segment.shm_path in bases]
    if pool is None or threads <= 1 or not live:
        _run_group(loop, live, bases, reading)
    elif len(live) >= 2:
        _Claimed(_groups(live, GROUPS_PER_THREAD * threads), lambda g: _run_group(loop, g, bases, reading)
                 ).run(pool, threads)
    else:
        _cut_one(loop, live[0], bases, reading, pool, threads)


def _run_group(loop: NativeLoop, ops: list[CopyOp], bases: dict[str, int], reading: bool) -> None:
    """One call of the loop for the ops, then each op's verdict or header."""
    rows, first, direction = array("Q"), 0, READ if reading else 0
    for op in ops:
        flags = direction | COPY | (HASH | RESET | DIGEST if hashing(op, reading) else 0)
        rows.extend((bases[op.segment.shm_path] + op.payload_offset, first, len(op.pieces), 0, ALL, flags, 0))
        first += len(op.pieces)
    loop.run(flat_pieces([op.pieces for op in ops]), rows, SLICE if reading else WRITE_SLICE)
    for k, op in enumerate(ops):
        try:
            finish(op, reading, bases, rows[k * ROW + DIGEST_AT] if rows[k * ROW + FLAGS_AT] & DIGEST else None)
        except MemCacheError as e:
            op.error = e


def _groups(ops: list[CopyOp], n: int) -> list[list[CopyOp]]:
    """At most ``n`` runs of consecutive ops of about equal bytes."""
    total = sum(op.nbytes for op in ops) or 1
    out: list[list[CopyOp]] = [[]]
    acc = 0
    for op in ops:
        if out[-1] and acc >= total * len(out) / n and len(out) < n:
            out.append([])
        out[-1].append(op)
        acc += op.nbytes
    return out


def _cut_one(loop: NativeLoop, op: CopyOp, bases: dict[str, int], reading: bool,
             pool: ThreadPoolExecutor, threads: int) -> None:
    """One object over several threads, in byte ranges. The pool's threads copy ranges from the front;
    the calling thread goes through them in order, copying and hashing each one nobody took yet,
    hashing the ones a pool thread copied, and while it waits for one, copying ranges from the back."""
    total = sum(map(itemgetter(1), op.pieces))
    if total < MIN_CUT:
        _run_group(loop, [op], bases, reading)
        return
    n = max(threads, total // RANGE)
    pieces, seg = flat_pieces([op.pieces]), bases[op.segment.shm_path] + op.payload_offset
    cuts = [total * k // n // 4096 * 4096 for k in range(n)] + [total]
    hashed, direction = hashing(op, reading), READ if reading else 0

    def row(k: int, flags: int) -> array:
        return array("Q", (seg, 0, len(op.pieces), cuts[k], cuts[k + 1] - cuts[k], direction | flags, 0))

    ranges = _Claimed(list(range(n)), lambda k: loop.run(pieces, row(k, COPY)))
    ranges.claim_item(0)
    ranges.start(pool, threads)
    last = row(0, 0)
    for k in range(n):
        hash_flags = (HASH | (RESET if k == 0 else 0) | (DIGEST if k == n - 1 else 0)) if hashed else 0
        if k == 0 or ranges.claim_item(k):
            last = row(k, COPY | hash_flags)
        else:
            while not ranges.done[k].is_set() and (j := ranges.claim_last()) >= 0:
                loop.run(pieces, row(j, COPY))
                ranges.done[j].set()
            ranges.done[k].wait()
            last = row(k, hash_flags)
        if last[FLAGS_AT] & (COPY | HASH):
            loop.run(pieces, last, SLICE if reading else WRITE_SLICE)
    ranges.wait()
    try:
        finish(op, reading, bases, last[DIGEST_AT] if hashed else None)
    except MemCacheError as e:
        op.error = e


class _Claimed:
    """Items worked on by whichever thread claims them first: the pool's threads take them in order,
    the calling thread either joins them (``run``) or claims the one it needs next (``claim_item``)."""

    def __init__(self, items: list[Any], work: Callable[[Any], None]) -> None:
        self.items, self._work = items, work
        self._taken = [0] * len(items)     # 0: free, 1: by ``work``, 2: by ``claim_item``
        self.done = [threading.Event() for _ in items]
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def start(self, pool: ThreadPoolExecutor, threads: int) -> None:
        for _ in range(min(threads - 1, len(self.items))):
            pool.submit(self.work)

    def run(self, pool: ThreadPoolExecutor, threads: int) -> None:
        self.start(pool, threads)
        self.work()
        self.wait()

    def _next(self) -> int:
        with self._lock:
            for i, taken in enumerate(self._taken):
                if not taken:
                    self._taken[i] = 1
                    return i
        return -1

    def claim_last(self) -> int:
        """Claim the last free item for the caller; -1 when none is left."""
        with self._lock:
            for i in range(len(self._taken) - 1, -1, -1):
                if not self._taken[i]:
                    self._taken[i] = 2
                    return i
        return -1

    def claim_item(self, item: Any) -> bool:
        """Claim this item for the caller (True), unless a pool thread has it already."""
        i = self.items.index(item)
        with self._lock:
            if self._taken[i]:
                return False
            self._taken[i] = 2
        return True

    def work(self) -> None:
        """Work on items until none is left to claim (pool threads, and the caller in ``run``)."""
        while (i := self._next()) >= 0:
            try:
                self._work(self.items[i])
            except BaseException as e:  # noqa: BLE001 - raised again on the waiting thread
                self._error = self._error or e
            finally:
                self.done[i].set()

    def wait(self) -> None:
        """Until every item ``work`` claimed is done; then any error one of them raised."""
        for i, ev in enumerate(self.done):
            if self._taken[i] == 1:
                ev.wait()
        if self._error is not None:
            raise self._error
