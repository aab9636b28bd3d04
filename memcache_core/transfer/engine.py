"""Chooses the path for each copy and runs a batch of copies on a small thread pool.

Path per segment: the caller's own segment and, with ``host_shm``, every segment on the same host are
copied through shared memory; other segments (and all peers with ``host_tcp``) go over TCP to the
owner's data server. Copies release the GIL, so a batch is split over a few threads; small batches
run inline, where thread hand-off would cost more than the copy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from ..errors import MemCacheError, TransferFailed
from ..local.segment import Mapping
from ..protocol import SegmentInfo
from .shm import ShmTransport
from .tcp import TcpClient

logger = logging.getLogger(__name__)

INLINE_BYTES = 1 << 20    # batches smaller than this are copied on the calling thread


@dataclasses.dataclass(slots=True)
class CopyOp:
    """Copy between one object replica (segment, offset) and local pieces laid end to end in it."""

    segment: SegmentInfo
    offset: int
    pieces: list[tuple[int, int]]
    nbytes: int
    error: MemCacheError | None = None


class TransferEngine:
    def __init__(self, protocol: str, host_id: str, own: Mapping | None, own_id: int | None,
                 timeout_s: float, read_threads: int, write_threads: int) -> None:
        self.protocol = protocol
        self.host_id = host_id
        self.own_id = own_id
        self.shm = ShmTransport(own, own_id)
        self.tcp = TcpClient(timeout_s)
        self._read_pool = ThreadPoolExecutor(read_threads, thread_name_prefix="memcache-read")
        self._write_pool = ThreadPoolExecutor(write_threads, thread_name_prefix="memcache-write")
        self._threads = {True: read_threads, False: write_threads}

    def local(self, seg: SegmentInfo) -> bool:
        if seg.segment_id == self.own_id:
            return True
        return self.protocol == "host_shm" and seg.host_id == self.host_id

    def read(self, ops: list[CopyOp]) -> None:
        self._run(ops, reading=True)

    def write(self, ops: list[CopyOp]) -> None:
        self._run(ops, reading=False)

    def _run(self, ops: list[CopyOp], reading: bool) -> None:
        """Run every op; failures are recorded per op in ``op.error``, never raised."""
        shm_ops = [op for op in ops if self.local(op.segment)]
        by_peer: dict[str, list[CopyOp]] = defaultdict(list)
        for op in ops:
            if not self.local(op.segment):
                by_peer[op.segment.data_addr].append(op)
        jobs: list[tuple[str | None, list[CopyOp]]] = []
        nthreads = self._threads[reading]
        total = sum(op.nbytes for op in ops)
        if shm_ops:
            jobs.extend((None, chunk) for chunk in _split(shm_ops, nthreads if total >= INLINE_BYTES else 1))
        for addr, peer_ops in by_peer.items():
            jobs.extend((addr, chunk) for chunk in _split(peer_ops, nthreads if total >= INLINE_BYTES else 1))
        if len(jobs) == 1:
            self._job(jobs[0], reading)
            return
        pool = self._read_pool if reading else self._write_pool
        for f in [pool.submit(self._job, job, reading) for job in jobs]:
            f.result()

    def _job(self, job: tuple[str | None, list[CopyOp]], reading: bool) -> None:
        addr, ops = job
        if addr is None:
            for op in ops:
                try:
                    if reading:
                        self.shm.read(op.segment, op.offset, op.pieces)
                    else:
                        self.shm.write(op.segment, op.offset, op.pieces)
                except MemCacheError as e:
                    op.error = e
            return
        try:
            wire = [(op.offset, op.pieces) for op in ops]
            if reading:
                self.tcp.read(addr, wire)
            else:
                self.tcp.write(addr, wire)
        except MemCacheError as e:
            for op in ops:
                op.error = e
        except Exception as e:  # noqa: BLE001 - a transfer bug must turn into a per-key failure
            logger.exception("transfer with %s failed", addr)
            for op in ops:
                op.error = TransferFailed(str(e))

    def forget(self, seg: SegmentInfo) -> None:
        self.shm.forget(seg.segment_id)
        self.tcp.forget(seg.data_addr)

    def close(self) -> None:
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        self.shm.close()
        self.tcp.close()


def _split(ops: list[CopyOp], n: int) -> list[list[CopyOp]]:
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
