"""The owner's side of a drain, and of re-replication: copy this member's objects to the targets the
MetaService planned (a drain moves them; a repair adds a replica, ``meta/repair.py``).

The owner pushes: the bytes are in its own segment, so each move is an ordinary write (``CopyOp``)
from its memory to the target's reserved space, through shared memory or the target's TCP data
server, with the payload checksum computed while copying and the header written last. The owner
then reports (``DrainDone``); the MetaService commits each copy whose checksum is the committed one
and releases the source. Nothing here changes what readers see until that commit.

Repairs run on a thread of their own while the heartbeat says there are copies to make (``RepairNext``
until it hands out none), with the same copy and report (``RepairDone``). A drain runs on a thread
of its own when the MetaService asks (an admin drain, seen on a heartbeat)
and in ``close()`` before the member leaves (``LocalConfig.drain_timeout_ms``). Both are bounded:
the owner stops at its deadline, which it tightens to the MetaService's; copies use their own
transfer engine whose peer timeout is a quarter of the drain's time (a peer that stalls mid-copy
makes the drain overrun by that much at most). A MetaService restart mid-drain
(calls fail, then this member re-joins) is ridden out: the next ``DrainNext`` starts the drain again
on the new MetaService with the time that is left.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from .. import protocol as p
from ..errors import MemCacheError, TransferFailed
from ..fence import tokens
from ..layout import footprint, payload_offset
from ..rpc import Backoff, expect
from ..transfer import CopyOp, TransferEngine
from .session import Member, Session

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05       # nothing to move yet (puts into the segment still pending): ask again after


class Drainer:
    def __init__(self, svc: Member) -> None:
        self.svc = svc
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._repair: threading.Thread | None = None   # re-replication copies (``on_repair``)
        self._cancel = threading.Event()         # set by close(): no new drain thread, the running one stops
        self._asked_in: Session | None = None    # the session in which the MetaService last asked
        self.moved = 0
        self.failed = 0

    def on_heartbeat(self, asked: bool) -> None:
        """The MetaService says the segment is being drained, or (after a re-join to a restarted
        MetaService) no longer knows the drain it had asked for: drain on a thread of our own."""
        s = self.svc.session
        if not asked and (self._asked_in is None or self._asked_in is s):
            return
        with self._lock:
            if self._cancel.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._asked_in = s
            # until the first answer tells the drain's deadline, allow one client timeout
            self._thread = threading.Thread(target=self.run, args=(self.svc.config.client_timeout_seconds,
                                                                   False, self._cancel),
                                            name="memcache-drain", daemon=True)
            self._thread.start()

    def on_repair(self, asked: bool) -> None:
        """The MetaService wants copies of objects in our segment made elsewhere (re-replication):
        make them on a thread of our own, until it has none left to ask for."""
        if not asked:
            return
        with self._lock:
            if self._cancel.is_set() or (self._repair is not None and self._repair.is_alive()):
                return
            self._repair = threading.Thread(target=self.repair, args=(self._cancel,), name="memcache-repair",
                                            daemon=True)
            self._repair.start()

    def repair(self, cancel: threading.Event) -> None:
        """Copy what ``RepairNext`` hands out until it hands out nothing (or the member closes)."""
        engine = self._engine(self.svc.config.client_timeout_seconds)
        try:
            while not cancel.is_set():
                try:
                    answer, granted_in = self.svc.member_call_in(lambda s: p.RepairNext(s.client_id, s.token))
                    batch = expect(answer, p.DrainBatch)
                except MemCacheError as e:   # the MetaService is down or restarting: the next heartbeat asks again
                    logger.debug("repair: %s", e)
                    return
                if not batch.moves:
                    return
                self._copy(engine, batch.moves, time.monotonic(), p.RepairDone, granted_in.epoch)
        finally:
            engine.close()

    def stop(self, timeout_s: float) -> bool:
        """Stop the drain and repair threads (at their next batch); False if one is still copying after
        ``timeout_s``."""
        self._cancel.set()
        with self._lock:
            threads = [t for t in (self._thread, self._repair) if t is not None]
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def run(self, timeout_s: float, own_bound: bool, cancel: threading.Event | None = None) -> None:
        """Drain until the MetaService says it is over, ``timeout_s`` passes, or ``cancel`` is set.

        ``own_bound``: the drain is ours (leaving): a drain this call starts at the MetaService takes
        at most the time left here. Otherwise the MetaService's bound is learnt from its answers.
        """
        deadline = time.monotonic() + timeout_s
        engine = self._engine(timeout_s)
        backoff = Backoff(0.01, 0.5)
        learnt = own_bound
        try:
            while not (cancel is not None and cancel.is_set()) and time.monotonic() < deadline:
                ask_ms = max(1, int((deadline - time.monotonic()) * 1000)) if learnt else 0
                try:
                    answer, granted_in = self.svc.member_call_in(lambda s, t=ask_ms: p.DrainNext(  # type: ignore[misc]
                        s.client_id, s.token, t))
                    batch = expect(answer, p.DrainBatch)
                except MemCacheError as e:   # the MetaService is down or restarting: try again
                    logger.debug("drain: %s", e)
                    time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
                    continue
                if batch.done:
                    return
                theirs = time.monotonic() + batch.left_ms / 1000.0 + 1.0
                deadline = min(deadline, theirs) if own_bound else theirs
                learnt = True
                if batch.moves:
                    self._copy(engine, batch.moves, time.monotonic(), p.DrainDone, granted_in.epoch)
                else:
                    time.sleep(IDLE_WAIT_S)
        finally:
            engine.close()
            logger.info("drain of segment %d: %d objects copied out, %d copies failed",
                        self.svc.client_id, self.moved, self.failed)

    def _engine(self, timeout_s: float) -> TransferEngine:
        """A transfer engine of the drain's own, whose peer timeout fits the drain's bound."""
        svc, cfg = self.svc, self.svc.config
        threads = max(1, min(os.cpu_count() or 1, 8, cfg.write_thread_pool_size))
        peer_timeout = max(0.5, min(cfg.client_timeout_seconds, timeout_s / 4))   # a stalled peer: 1/4 over at most
        return TransferEngine(cfg.protocol, svc.host_id, svc.segment, peer_timeout, 1, threads, svc.secret,
                              svc.tls_client)

    def _copy(self, engine: TransferEngine, moves: list[p.DrainMove], planned: float,
              report: type[p.DrainDone] | type[p.RepairDone], epoch: int) -> None:
        """Copy the moves planned in session ``epoch``, each under its target's join token (a target whose
        owner re-joined since refuses them: ``fence.py``) and report them."""
        what = "drain" if report is p.DrainDone else "repair"
        ops = [self._op(m, epoch) for m in moves]
        if time.monotonic() - planned >= self.svc.session.pending_timeout_s / 2:
            for op in ops:   # as a put: too late to start, the MetaService may give the space away
                op.error = op.error or TransferFailed(f"{what} copy started later than half the pending timeout")
        engine.write([op for op in ops if op.error is None])
        for m, op in zip(moves, ops, strict=True):
            if op.error is not None:
                logger.warning("%s: copy of %r to segment %d failed: %s", what, m.key, m.target.segment_id, op.error)
            elif m.checksum and op.checksum != m.checksum:
                logger.error("%s: %r at offset %d of this segment fails its checksum; not copied", what, m.key,
                             m.source_offset)
        try:
            codes = expect(self.svc.member_call(lambda s: report(
                s.client_id, s.token, [m.key for m in moves], [m.new_generation for m in moves],
                [op.checksum for op in ops], [op.error is None for op in ops])), p.Codes).codes
        except MemCacheError as e:   # not reported: the MetaService gives the space back itself
            logger.warning("%s: report of %d copies not delivered: %s", what, len(moves), e)
            return
        if report is p.DrainDone:
            self.moved += sum(c == 0 for c in codes)
            self.failed += sum(c != 0 for c in codes)

    def _op(self, m: p.DrainMove, epoch: int) -> CopyOp:
        """The write of one move: from our segment's payload to the target's reserved space, under the
        fence token of the target's join it was planned in (none: ``epoch``, the session's)."""
        own = self.svc.segment
        assert own is not None
        try:
            if m.source_offset < 0 or m.source_offset + footprint(m.size) > own.size:
                raise MemCacheError(f"move of {m.key!r} names offset {m.source_offset} outside the segment")
            seg = self.svc.segment_info(m.target.segment_id)
            fence = tokens([m.fence] if m.fence else [], 1, epoch, f"move of {m.key!r}")[0]
        except MemCacheError as e:
            return CopyOp(_NOWHERE, 0, [], m.size, m.key, m.new_generation, error=e)
        return CopyOp(seg, m.target.offset, [(own.addr + payload_offset(m.source_offset), m.size)], m.size,
                      m.key, m.new_generation, hash=True, epoch=fence)


_NOWHERE = p.SegmentInfo(0, 0, "", "", "")
