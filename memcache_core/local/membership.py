"""The LocalService as a pool member: its ``Session`` (what one Join established), joining (a
standalone provider waits for its MetaService: the first join retried until it answers) and
re-joining, the heartbeat with its journal of objects that left our segment, calls that act as this
member, and the table of the pool's segments (refreshed so that peers that left are unmapped).

Identity: the MetaService issues this member's id at ``Join`` (ids are never drawn from ``random``,
which engines seed identically in every process). Everything that depends on the id lives in one
immutable ``Session``, swapped whole on a re-join and read once per call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from .. import errors
from .. import protocol as p
from ..auth import default_secret_path, is_auth_mismatch
from ..config import LocalConfig
from ..errors import MemCacheError, MetaServiceUnavailable
from ..fence import tokens
from ..memory import Mapping
from ..rpc import RpcClient, expect
from ..transfer import TransferEngine
from ..transfer.tcp_server import DataServer
from . import recovery, tier
from . import segment as segment_files
from .arena import ArenaWriter
from .background_join import BackgroundJoin, causes, refused_for_good
from .dead_owners import report_dead_owners
from .drain import Drainer
from .hold import Hold
from .metrics import LocalMetrics
from .session import Pieces as Pieces
from .session import Session

logger = logging.getLogger(__name__)

SEGMENT_REFRESH_S = 10.0    # how often the segment table is re-read (peers that left are unmapped)
MAX_WAIT_BACKOFF_S = 10.0   # a provider waiting for its MetaService tries again at least this often

F = TypeVar("F", bound=Callable[..., Any])


def in_batches(aligned: int = 0) -> Callable[[F], F]:
    """A batch call of more keys than one request may carry (``protocol.MAX_KEYS``) made as several
    calls of at most that many, their per-key results concatenated (a tuple of lists: each list; None: None).
    The ``aligned`` positional arguments after the keys are per-key lists, split alike (None stays)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, keys: Any, *args: Any, **kw: Any) -> Any:
            n = p.MAX_KEYS
            if len(keys) <= n:
                return fn(self, keys, *args, **kw)
            if any(a is not None and len(a) != len(keys) for a in args[:aligned]):
                raise errors.InvalidParameter(f"{fn.__name__}: the keys and the per-key lists differ in length")
            parts = [fn(self, keys[i:i + n], *[a[i:i + n] if j < aligned and a is not None else a
                                                for j, a in enumerate(args)], **kw)
                     for i in range(0, len(keys), n)]
            if parts[0] is None:
                return None
            if isinstance(parts[0], tuple):
                return tuple([x for part in parts for x in part[j]] for j in range(len(parts[0])))
            return [x for part in parts for x in part]
        return call  # type: ignore[return-value]
    return wrap


class Membership:
    """The member's side of the LocalService (a mixin: ``LocalService.__init__`` sets the state)."""

    config: LocalConfig
    host_id: str
    rpc: RpcClient
    session: Session
    segment: Mapping | None
    hold: Hold | None               # our segment's fence across joins (hold.py)
    engine: TransferEngine | None
    data_server: DataServer | None
    disk: tier.DiskTier | None
    drainer: Drainer
    arenas: ArenaWriter | None
    metrics: LocalMetrics
    secret: bytes | None
    tls_client: ssl.SSLContext | None
    _segment_template: p.SegmentInfo | None
    _segments: dict[int, p.SegmentInfo]
    _journal_ack: int
    generation_ceiling: int         # the highest the MetaService said it issues below: carried into a re-join
    pool_disk_tiers: int            # from the last heartbeat: segments of the pool with a disk tier
    _departures: int                # from the last heartbeat: members that left the pool so far
    _lock: threading.Lock
    _join_lock: threading.Lock
    _stop: threading.Event
    _beat_now: threading.Event      # heartbeat at once (a remove of our own objects waits for it)
    _heartbeat: threading.Thread | None
    _waiting: BackgroundJoin | None  # the first join, retried until the pool answers (wait_for_pool)
    join_error: MemCacheError | None  # why the wait for the pool ended without a join

    @property
    def client_id(self) -> int:
        return self.session.client_id

    def _first_join_or_wait(self, wait: bool, on_failed: Callable[[MemCacheError], None] | None) -> bool:
        """The first join; True once in. With ``wait`` a MetaService that does not answer yet is waited
        for: False, and the join is retried in the background with backoff (``background_join.py``);
        a refusal for good (``refused_for_good``) raises here, or later ends the wait with
        ``on_failed(error)``."""
        try:
            self._first_join()
            return True
        except MemCacheError as e:
            if not wait or refused_for_good(e):
                named = self._join_refused(e)
                if named is e:
                    raise
                raise named from e
            logger.warning("cannot join the pool yet (%s); waiting for the MetaService at %s and joining as "
                           "soon as it answers (retried with backoff, at most every %gs)", e, self.rpc.url,
                           MAX_WAIT_BACKOFF_S)
        self._waiting = BackgroundJoin(self._first_join, self._joined, max_s=MAX_WAIT_BACKOFF_S, name="LocalService",
                                       joined_note=lambda: f"serving its segment as member {self.client_id}",
                                       permanent=refused_for_good,
                                       on_failed=partial(self._wait_failed, on_failed)).start()
        return False

    def _first_join(self) -> None:
        """One attempt at the first join, counted in the metrics."""
        self.metrics.join_attempts.inc()
        try:
            self._join(recover=False)
        except BaseException:
            self.metrics.join_failures.inc()
            raise
        self._sweep_dead_owners()

    def _sweep_dead_owners(self) -> None:
        """Once joined, report the segments of this host whose owner is dead: those listed at a file this
        process removed as a dead owner's (``segment.removed_here``: an engine restarted on this host
        finds its previous self's segment, dropped now rather than a heartbeat timeout later, design.md
        "Failure of a LocalService"), and those whose owner lock is free. Never fails the join."""
        try:
            self._refresh_segments()
            with self._lock:
                segs = dict(self._segments)
            s = self.session
            removed = [seg for seg in segs.values() if seg.host_id == self.host_id and seg.segment_id != s.client_id
                       and seg.shm_path in segment_files.removed_here]
            report_dead_owners(self.rpc, s, removed)
            self.owners_gone(s, {sid: seg for sid, seg in segs.items() if seg not in removed})
        except MemCacheError as e:
            logger.info("could not look for dead owners of this host's segments after joining (%s)", e)

    def _joined(self, _: object) -> None:
        """In the pool: heartbeats, the disk tier's writer, ``joined`` in the metrics."""
        with self._join_lock:
            if self._stop.is_set():
                return   # closed while the last attempt was on the way; the MetaService declares us dead
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="memcache-heartbeat", daemon=True)
            self._heartbeat.start()
            if self.disk is not None:
                self.disk.start()
            self.metrics.joined = True

    def _join_refused(self, e: MemCacheError) -> MemCacheError:
        """A join refused for good, as an error that names the setting to fix (of the same class: an
        engine's ``init`` still returns -3017 for a secret that is not the pool's)."""
        url = self.rpc.url or self.config.meta_service_url
        if is_auth_mismatch(e) and self.secret is not None:
            path = self.config.auth_secret_path or default_secret_path(self.config.pool_name)
            return type(e)(f"auth_secret_path: the MetaService at {url} refused the pool secret in {path} ({e}): "
                           f"use the pool's secret file (the MetaService's auth_secret_path; a pool with a "
                           f"pool_name has its own, pool-<pool_name>.secret: set pool_name alike)")
        cert = next((c for c in causes(e) if isinstance(c, ssl.SSLCertVerificationError)), None)
        if cert is not None:
            return type(e)(f"tls_ca_path: the certificate of the MetaService at {url} does not verify against "
                           f"{self.config.tls_ca_path} ({cert.verify_message}): give the MetaService and every "
                           f"member certificates signed by one CA, and that CA in tls_ca_path")
        return e

    def _wait_failed(self, notify: Callable[[MemCacheError], None] | None, exc: BaseException) -> None:
        err = self._join_refused(exc) if isinstance(exc, MemCacheError) else MemCacheError(str(exc))
        self.join_error = err
        logger.error("LocalService stops waiting for the pool: %s", err)
        if notify is not None:
            notify(err)

    @property
    def held(self) -> bool:
        """Our segment is held: writes of an earlier join may be in flight, nothing new goes there (hold.py)."""
        return self.hold is not None and self.hold.held

    @property
    def joined(self) -> bool:
        """In the pool (the first join done); False while it waits for the MetaService."""
        return self.metrics.joined

    def _join(self, recover: bool) -> None:
        """Join (or re-join) and install the new session in one step."""
        # under the arena lock: no small put copies into an arena of the old session once the new
        # MetaService may hand that space out, and the scan sees every header of a put that succeeds
        with self.arenas.lock if self.arenas is not None else contextlib.nullcontext():
            if self.hold is not None:
                # close our segment's fence and wait out every write in flight into it: none granted before
                # this Join (by an earlier MetaService, or by this one before it declared us dead) lands
                # once the MetaService may give its space away; past fence_wait_ms, join held (hold.py)
                self.hold.close()
            objects = recovery.scan(self.segment) if recover and self.segment is not None else []
            old = self.session
            on_disk = self.disk.store.reports() if self.disk is not None else []
            # at most MAX_KEYS objects and disk records a request: the rest follow in Reports (in rising
            # offsets), and the MetaService answers others between them
            objects.sort(key=lambda r: r.offset)
            k = p.MAX_KEYS
            parts = max(1, -(-len(objects) // k), -(-len(on_disk) // k))
            reply = self.rpc.call(p.Join(old.client_id, self.host_id, os.getpid(), self._segment_template,
                                         objects[:k], old.token, on_disk[:k], self.generation_ceiling,
                                         more=parts > 1, fences=True, held=self.held, rotates=True), probe=True)
            j = expect(reply, p.Joined)
            for i in range(1, parts):
                expect(self.rpc.call(p.Report(j.client_id, j.token, objects[i * k:(i + 1) * k],
                                              on_disk[i * k:(i + 1) * k], last=i == parts - 1)), p.Ok)
            self.generation_ceiling = max(self.generation_ceiling, j.generation_ceiling)
            seg = None
            if self._segment_template is not None:
                seg = p.SegmentInfo(j.client_id, *_fields(self._segment_template)[1:])
            if self.hold is not None:   # writes granted in this join land from now on (none: by its epoch)
                self.hold.open(tokens([j.fence] if j.fence else [], 1, j.meta_epoch, "Joined")[0])
            if self.data_server is not None:
                self.data_server.serve_segment(j.client_id)   # requests for any other segment are refused
            with self._lock:
                stale, self._segments = list(self._segments.values()), {}
                self._journal_ack = 0
                self.session = Session(j.client_id, j.meta_epoch, j.lease_ttl_ms / 1000.0,
                                       j.pending_timeout_ms / 1000.0, seg, j.token)
            if self.arenas is not None:
                # the old session's arena is void: a put that read that session before we took the
                # lock must find no arena to copy into (its space may go to another object now)
                self.arenas.arena = None
            if self.engine is not None:
                for seg_info in stale:
                    self.engine.forget(seg_info)
            if recover:
                logger.info("re-joined MetaService (epoch %d) as %d with %d objects", j.meta_epoch, j.client_id,
                            len(objects))

    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_ms / 1000.0
        timeout = min(self.config.client_timeout_seconds, max(1.0, 3 * interval))
        next_refresh = time.monotonic() + SEGMENT_REFRESH_S
        # headers were just cleared: acknowledge at once (a remove waits for it), but never twice in a
        # row (a steady stream of evictions must not turn the heartbeat into a busy loop)
        ack_now = acked_now = False
        while True:
            if not ack_now:
                self._beat_now.wait(interval)   # (set by close too)
            if self._stop.is_set():
                return
            self._beat_now.clear()
            acked_now, ack_now = ack_now, False
            try:
                if self._segments and time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + SEGMENT_REFRESH_S
                    self._refresh_segments()   # unmap peers that left even if nobody asks for them
                s = self.session
                r = expect(self.rpc.call(p.Heartbeat(s.client_id, s.token, self._journal_ack, self.metrics.take_moved(),
                                                     self.held, self.hold.open_to if self.hold else 0),
                                         timeout_s=timeout, probe=True), p.HeartbeatReply)
                if not r.known or r.meta_epoch != s.epoch:
                    if r.meta_epoch != s.epoch:
                        self.metrics.meta_restarts.inc()
                    self.metrics.rejoins.inc()
                    self._rejoin(s)
                    continue
                self.generation_ceiling = max(self.generation_ceiling, r.generation_ceiling)
                ack_now = self._apply_journal(r.journal) and not acked_now
                if r.rotate and self.hold is not None:   # grants in our segment were reclaimed (hold.py)
                    self.hold.rotate(r.rotate)
                self.drainer.on_heartbeat(r.drain)
                self.drainer.on_repair(r.repair)
                self.pool_disk_tiers = r.disk_tiers
                if self.arenas is not None:
                    self.arenas.release_idle(time.monotonic())
                if r.served:
                    self.metrics.serve("host_shm", True, r.served[0])
                    self.metrics.serve("host_shm", False, r.served[1])
                if r.departures != self._departures:   # a peer left or was declared dead: forget it now, so
                    self._departures = r.departures    # that reads waiting on it move on (TcpClient.forget)
                    if self._segments:
                        self._refresh_segments()
            except MetaServiceUnavailable:
                continue
            except MemCacheError as e:
                logger.warning("heartbeat failed: %s", e)
            except Exception:
                logger.exception("heartbeat loop error")

    def _rejoin(self, seen: Session) -> None:
        """Re-join once for a session found stale (by the heartbeat, or by a call refused as a
        non-member); several threads finding the same stale session re-join once."""
        with self._join_lock:
            if self.session is seen and not self._stop.is_set():
                self._join(recover=True)

    def member_call(self, make: Callable[[Session], p.Request]) -> p.Reply:
        """A call that acts as this member; after a MetaService restart re-join first, then retry once."""
        return self.member_call_in(make)[0]

    def member_call_in(self, make: Callable[[Session], p.Request]) -> tuple[p.Reply, Session]:
        """``member_call``, and the session it was answered in: a write into space that reply granted
        carries the reply's fence tokens, or (none: a MetaService before them) that session's epoch
        (``CopyOp.epoch``, ``fence.tokens``), never a later one's."""
        s = self.session
        try:
            return self.rpc.call(make(s)), s
        except errors.NotAMember:
            self._rejoin(s)
            s = self.session
            return self.rpc.call(make(s)), s

    def _apply_journal(self, journal: list[p.JournalEntry]) -> bool:
        """Objects of our segment that left the pool: clear their headers, so a scan skips them, and
        delete our disk tier's records of them (a remove returns once we acknowledged). True when there were new ones (the next heartbeat acknowledges them)."""
        new = False
        records: list[p.ObjectReport] = []
        for e in journal:
            if e.seq <= self._journal_ack:
                continue
            if e.disk:
                records.append(e.obj)
            elif not e.added and self.segment is not None:
                with self.arenas.lock if self.arenas is not None else contextlib.nullcontext():
                    recovery.clear_header(self.segment, e.obj)   # (after the header a small put writes)
            self._journal_ack = e.seq
            new = True
        if records and self.disk is not None:   # deleted before the next heartbeat acknowledges them
            self.disk.store.remove(records)
        return new

    # ---- segments ------------------------------------------------------------------------------------

    def owners_gone(self, s: Session, segs: dict[int, p.SegmentInfo]) -> set[int]:
        """The ids of those same-host segments whose owner this host's kernel says is dead (the
        segment file's owner lock is gone: ``memory.owner_alive``), each reported to the MetaService,
        which drops that member at once rather than a heartbeat timeout later. A writer asks after
        its commit and fails the puts that went there: the file outlives a killed owner, so the copy
        and the commit succeed, but the object leaves the pool with its owner."""
        if self.engine is None or not segs:
            return set()
        gone = self.engine.owners_gone(list(segs.values()))
        report_dead_owners(self.rpc, s, gone)
        return {seg.segment_id for seg in gone}

    def segment_info(self, sid: int) -> p.SegmentInfo:
        seg = self._segments.get(sid)
        if seg is None:
            self._refresh_segments()
            seg = self._segments.get(sid)
            if seg is None:
                raise errors.PeerUnavailable(f"segment {sid} is not in the pool")
        return seg

    def _refresh_segments(self) -> None:
        """Fetch the pool's segments; unmap (and disconnect from) those that left or changed."""
        r = expect(self.rpc.call(p.GetSegments([]), idempotent=True), p.Segments)
        with self._lock:
            live = {s.segment_id: s for s in r.segments}
            gone = [old for sid, old in self._segments.items() if live.get(sid) != old]
            self._segments = live
        if self.engine is not None:
            for old in gone:
                self.engine.forget(old)


def _fields(info: p.SegmentInfo) -> tuple:
    return (info.segment_id, info.size, info.host_id, info.shm_path, info.data_addr, info.tag, info.nixl)
