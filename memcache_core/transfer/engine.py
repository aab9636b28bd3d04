"""Chooses the path for each copy, runs a batch of copies on a small thread pool, and proves the bytes.

Path per segment: the caller's own segment and, with ``host_shm``, every segment on the same host are
copied through shared memory; other segments (and all peers with ``host_tcp``) go over TCP to the
owner's data server, or, with ``transfer_engine: "nixl"``, as one NIXL request per peer and batch when
the segment has a NIXL agent and every local piece lies in registered memory (``nixl.py``). Copies
release the GIL, so a batch is split over a few threads: shared-memory copies over ``copy_threads``
(the C loop, ``shmloop.py``, whole objects per thread; or the Python loop, ``shmcopy.py``, piece by
piece), TCP transfers op by op per peer; small batches run inline, where thread hand-off would cost
more than the copy.

Integrity: a write hashes each piece (XXH3-64) right before copying it, while it is hot in cache,
then writes the object's header (``layout.py``) after the payload; a verified read hashes each piece
right after copying it and compares with the checksum the writer committed. A mismatch is a
``ChecksumMismatch`` for that op: a miss, never a hit.
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import ChecksumMismatch, ConfigError, MemCacheError, TransferFailed
from ..memory import Mapping, buffer_address, view_at
from ..records import SegmentInfo
from . import native
from .ops import CopyOp as CopyOp
from .shm import ShmTransport
from .shmcopy import copy_batch, verify
from .tcp import TcpClient

if TYPE_CHECKING:
    from .nixl import NixlTransport

logger = logging.getLogger(__name__)

INLINE_BYTES = 1 << 20    # batches smaller than this are copied on the calling thread
NIXL = "nixl:"            # job key prefix of ops moved by NIXL
NIXL_SLICE_BYTES = 4 << 20  # a NIXL read is verified slice by slice, each one request


def checksum_of(pieces: list[tuple[int, int]]) -> int:
    """XXH3-64 of the pieces laid end to end (the same value however the bytes are split)."""
    h = xxhash.xxh3_64()
    for ptr, size in pieces:
        h.update(view_at(ptr, size))
    return h.intdigest()


class TransferEngine:
    def __init__(self, protocol: str, host_id: str, own: Mapping | None, timeout_s: float,
                 read_threads: int, write_threads: int, secret: bytes | None = None,
                 tls: ssl.SSLContext | None = None, metrics: Any = None, copy_threads: int = 1,
                 nixl: NixlTransport | None = None, copy_loop: str = "auto", stall_s: float | None = None) -> None:
        self.loop = native.load() if copy_loop != "python" else None
        if copy_loop == "native" and self.loop is None:
            raise ConfigError("shm_copy_loop: 'native', but the native copy loop was not built here (no C "
                              "compiler at install time?); use 'auto' or 'python'")
        self.protocol = protocol
        self.metrics = metrics   # local.metrics.LocalMetrics (transfer/ never imports local/)
        self.host_id = host_id
        self.shm = ShmTransport(own)
        self.tcp = TcpClient(timeout_s, secret, tls)
        self.stall_s = stall_s
        self.nixl = nixl
        self._read_pool = ThreadPoolExecutor(read_threads, thread_name_prefix="memcache-read")
        self._write_pool = ThreadPoolExecutor(write_threads, thread_name_prefix="memcache-write")
        self._threads = {True: read_threads, False: write_threads}
        self.copy_threads = max(1, copy_threads)
        self._copy_pool = (ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix="memcache-copy")
                           if self.copy_threads > 1 else None)

    def local(self, seg: SegmentInfo) -> bool:
        """Whether ``seg`` is copied through shared memory: our own, or with ``host_shm`` one of this
        host that this process can map (else over its owner's data server, ``ShmTransport.reachable``)."""
        if self.shm.is_own(seg):
            return True
        return self.protocol == "host_shm" and seg.host_id == self.host_id and self.shm.reachable(seg)

    def owners_gone(self, segs: list[SegmentInfo]) -> list[SegmentInfo]:
        """Those of ``segs`` copied through shared memory whose owner this host knows is dead
        (``ShmTransport.owner_gone``); a segment reached over TCP fails its copies instead."""
        return [s for s in segs if self.local(s) and self.shm.owner_gone(s)]

    def suspect(self, seg: SegmentInfo) -> bool:
        """Whether reads should try this segment last: its data server missed a read deadline lately."""
        return not self.local(seg) and self.tcp.suspect(seg.data_addr, seg.segment_id)

    def read(self, ops: list[CopyOp]) -> None:
        self._run(ops, reading=True)

    def write(self, ops: list[CopyOp]) -> None:
        self._run(ops, reading=False)

    def _run(self, ops: list[CopyOp], reading: bool) -> None:
        """Run every op; failures are recorded per op in ``op.error``, never raised."""
        shm_ops = [op for op in ops if self.local(op.segment)]
        # per route and segment: a provider restarted on its address is another peer (``TcpClient``)
        by_peer: dict[tuple[str, int], list[CopyOp]] = defaultdict(list)
        for op in ops:
            if not self.local(op.segment):
                by_peer[(self._route(op), op.segment.segment_id)].append(op)
        big = sum(op.nbytes for op in ops) >= INLINE_BYTES
        nthreads = self._threads[reading] if big else 1
        jobs: list[tuple[tuple[str, int], list[CopyOp]]] = []
        for peer, peer_ops in by_peer.items():
            if peer[0].startswith(NIXL):
                jobs.append((peer, peer_ops))   # one job per peer and batch
            else:   # reads with a fallback and those without in jobs of their own (``_tcp_read``)
                for group in (g for g in ([o for o in peer_ops if o.fallback],
                                          [o for o in peer_ops if not o.fallback]) if g):
                    jobs.extend((peer, chunk) for chunk in split_by_bytes(group, nthreads))
        if len(jobs) == 1 and not shm_ops:
            self._job(jobs[0], reading)
            return
        pool = self._read_pool if reading else self._write_pool
        futures = [pool.submit(self._job, job, reading) for job in jobs]
        if shm_ops:
            self._shm_job(shm_ops, reading, self.copy_threads if big else 1)
        for f in futures:
            f.result()

    def _route(self, op: CopyOp) -> str:
        """The job key of a remote op: the peer's data address, prefixed when NIXL moves it."""
        seg = op.segment
        if self.nixl is not None and seg.nixl and self.nixl.covers(op.pieces):
            return NIXL + seg.data_addr
        return seg.data_addr

    def _shm_job(self, ops: list[CopyOp], reading: bool, threads: int) -> None:
        t0 = time.perf_counter()
        try:
            copy_batch(ops, reading, self.shm, self._copy_pool, threads, self.loop)
        except Exception as e:  # noqa: BLE001 - a transfer bug must turn into a per-key failure
            logger.exception("shared-memory transfer failed")
            for op in ops:
                op.error = op.error or TransferFailed(str(e))
        finally:
            if self.metrics is not None:
                self.metrics.transfer("host_shm", reading, sum(op.nbytes for op in ops if op.error is None),
                                      time.perf_counter() - t0, sum(op.error is not None for op in ops))
                self.metrics.moved_shm(reading, [(op.segment.segment_id, op.nbytes) for op in ops if op.error is None])

    def _job(self, job: tuple[tuple[str, int], list[CopyOp]], reading: bool) -> None:
        t0 = time.perf_counter()
        try:
            self._do_job(job, reading)
        finally:
            if self.metrics is not None:
                (addr, _sid), ops = job
                self.metrics.transfer("nixl" if addr.startswith(NIXL) else "host_tcp", reading,
                                      sum(op.nbytes for op in ops if op.error is None),
                                      time.perf_counter() - t0, sum(op.error is not None for op in ops))

    def _do_job(self, job: tuple[tuple[str, int], list[CopyOp]], reading: bool) -> None:
        (addr, sid), ops = job
        try:
            if addr.startswith(NIXL):
                (self._nixl_read if reading else self._nixl_write)(ops)
            elif reading:
                self._tcp_read(addr, sid, ops)
            else:
                self._tcp_write(addr, sid, ops)
        except MemCacheError as e:
            for op in ops:
                op.error = op.error or e
        except Exception as e:  # noqa: BLE001 - a transfer bug must turn into a per-key failure
            logger.exception("transfer with %s failed", addr)
            for op in ops:
                op.error = op.error or TransferFailed(str(e))

    # ---- TCP: hash the sources before sending, the destinations after receiving ------------------------

    def _tcp_write(self, addr: str, sid: int, ops: list[CopyOp]) -> None:
        epochs = {op.epoch for op in ops}
        if len(epochs) > 1:   # one request per MetaService life that granted the space (``fence.py``)
            for e in sorted(epochs):
                self._tcp_write(addr, sid, [op for op in ops if op.epoch == e])
            return
        wire: list[tuple[int, list[tuple[int, int]]]] = []
        keep = []
        for op in ops:
            if op.hash:
                op.checksum = checksum_of(op.pieces)
            wire.append((op.payload_offset, op.pieces))
            if op.with_header:
                ptr, n, anchor = buffer_address(op.header())
                keep.append(anchor)
                wire.append((op.offset, [(ptr, n)]))      # the server writes ranges in order: header last
        self.tcp.write(addr, wire, sid, ops[0].epoch)

    def _tcp_read(self, addr: str, sid: int, ops: list[CopyOp]) -> None:
        self.tcp.read(addr, [(op.payload_offset, op.pieces) for op in ops],
                      self.stall_s if ops[0].fallback else None, sid)
        _verify_all(ops)

    # ---- NIXL: one job per peer (a read: a request per slice); the same checksums as TCP ------------

    def _nixl_write(self, ops: list[CopyOp]) -> None:
        """The payloads in one request; the checksums are computed while it moves (``nixl.write``)."""
        assert self.nixl is not None
        self.nixl.write(ops[0].segment, [(op.payload_offset, op.pieces) for op in ops],
                        [functools.partial(_hash, op) for op in ops if op.hash],
                        lambda: [(op.offset, op.header()) for op in ops if op.with_header])

    def _nixl_read(self, ops: list[CopyOp]) -> None:
        """One request per slice of about ``NIXL_SLICE_BYTES``, all in flight at once: each slice is
        verified as soon as it landed, while it is still in cache and the later ones keep moving (one
        request when nothing is to be verified)."""
        assert self.nixl is not None
        verified = any(op.hash and op.checksum for op in ops)
        slices = split_by_size(ops, NIXL_SLICE_BYTES) if verified else [ops]
        self.nixl.read(ops[0].segment, [[(op.payload_offset, op.pieces) for op in s] for s in slices],
                       lambda i: _verify_all(slices[i]))

    def forget(self, seg: SegmentInfo) -> None:
        self.shm.forget(seg)
        self.tcp.forget(seg.data_addr, seg.segment_id)
        if self.nixl is not None:
            self.nixl.forget(seg)

    def close(self) -> None:
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
        self.shm.close()
        self.tcp.close()
        if self.nixl is not None:
            self.nixl.close()


def _verify_all(ops: list[CopyOp]) -> None:
    """Hash what a batch read brought and compare with the committed checksums (per op)."""
    for op in ops:
        if op.hash and op.checksum:
            try:
                verify(op, checksum_of(op.pieces))
            except ChecksumMismatch as e:
                op.error = e


def _hash(op: CopyOp) -> None:
    op.checksum = checksum_of(op.pieces)


def split_by_size(ops: list[CopyOp], nbytes: int) -> list[list[CopyOp]]:
    """Consecutive ops in lists of at least ``nbytes`` each (the last may hold less), keeping their order."""
    out: list[list[CopyOp]] = [[]]
    acc = 0
    for op in ops:
        if acc >= nbytes:
            out.append([])
            acc = 0
        out[-1].append(op)
        acc += op.nbytes
    return out


def split_by_bytes(ops: list[CopyOp], n: int) -> list[list[CopyOp]]:
    """Split ops into at most n lists of about equal bytes, keeping their order."""
    if n <= 1 or len(ops) <= 1:
        return [ops]
    total = sum(op.nbytes for op in ops)
    target = total / n
    out: list[list[CopyOp]] = [[]]
    acc = 0
    for op in ops:
        if acc >= target * len(out) and len(out) < n:
            out.append([])
        out[-1].append(op)
        acc += op.nbytes
    return [c for c in out if c]
