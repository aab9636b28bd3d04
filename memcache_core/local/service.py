"""LocalService: joins the pool, contributes a segment, and does batched put / get / exist.

Everything here raises ``MemCacheError`` or reports per-key errors; integer codes exist only in
``store.py``. One instance is shared by many threads; payload copies never hold a lock.

Identity: the MetaService issues this member's id at ``Join`` (ids are never drawn from ``random``,
which engines seed identically in every process). Everything that depends on the id lives in one
immutable ``Session``, swapped whole on a re-join and read once per call.

Put is two-phase: ``Alloc`` (objects PENDING), copy payload and header, ``Commit`` (visible, with the
payload checksum), or ``Abort`` on failure. A key another writer has pending is waited for, never
reported as stored. Get leases: ``Lookup`` leases the objects for ``lease_ttl``; a read that finishes
later than that is confirmed with ``Validate`` before it counts; a read whose bytes fail their
checksum is a miss, reported to the MetaService, which drops the object.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .. import errors, tls
from .. import protocol as p
from ..auth import load_secret
from ..config import ASCEND_PROTOCOLS, LocalConfig, env_host_id, parse_url
from ..errors import InvalidParameter, MemCacheError, MetaServiceUnavailable, check_key, check_keys
from ..memory import Mapping
from ..rpc import Backoff, RpcClient, expect
from ..transfer import CopyOp, TransferEngine
from ..transfer.memfabric import require_memfabric
from ..transfer.tcp import DataServer
from . import recovery, tier
from .drain import Drainer
from .metrics import LocalMetrics, MetricsServer
from .prefault import Prefault, start_prefault
from .segment import create_segment

if TYPE_CHECKING:
    from ..transfer.nixl import NixlTransport

logger = logging.getLogger(__name__)

LEASE_SAFETY = 0.8          # trust a read without Validate only if it ended within 80% of the lease
SEGMENT_REFRESH_S = 10.0    # how often the segment table is re-read (peers that left are unmapped)

Pieces = list[tuple[int, int]]


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    """What one Join established; replaced as a whole on a re-join."""

    client_id: int
    epoch: int
    lease_ttl_s: float
    pending_timeout_s: float
    segment: p.SegmentInfo | None
    token: bytes = b""


class LocalService:
    def __init__(self, config: LocalConfig) -> None:
        config.validate()
        if config.protocol in ASCEND_PROTOCOLS:
            require_memfabric(config.protocol)
        self.config = config
        self.host_id = config.host_id or env_host_id()
        self.secret = load_secret(config.auth_secret_path) if config.auth_enable else None
        self._tls_client = tls.client_context(config)
        self.rpc = RpcClient(config.meta_service_url, config.client_timeout_seconds,
                             config.client_retry_milliseconds, self.secret, tls=self._tls_client)
        self.session = Session(0, 0, 10.0, 120.0, None)
        self.segment: Mapping | None = None
        self._segment_template: p.SegmentInfo | None = None   # our segment, before an id is issued
        self.data_server: DataServer | None = None
        self.engine: TransferEngine | None = None
        self._segments: dict[int, p.SegmentInfo] = {}
        self._journal_ack = 0
        self._sample = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._lock = threading.Lock()
        self._join_lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.integrity_failures = 0
        self._partial_warned = 0.0   # when a partial placement may be logged again
        self.drainer = Drainer(self)
        self.metrics = LocalMetrics()
        self.metrics_server: MetricsServer | None = None
        self.disk: tier.DiskTier | None = None   # the disk tier under our segment (disk_path)
        self.prefault: Prefault | None = None

    @property
    def client_id(self) -> int:
        return self.session.client_id

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self, device_id: int, with_segment: bool) -> None:
        cfg = self.config
        try:
            if with_segment:
                size = cfg.dram_bytes
                if size <= 0:
                    raise InvalidParameter("dram_size: must be positive for a LocalService that holds memory")
                self.segment = create_segment(size)
                self.prefault = start_prefault(self.segment, cfg)
                if cfg.disk_path:
                    self.disk = tier.DiskTier(self)
                    self.metrics.watch_disk(self.disk.counters)
                host, port = parse_url(cfg.hcom_url, "hcom_url", ("tcp",))
                self.data_server = DataServer(self.segment, host, port, self.secret, tls.server_context(cfg),
                                              self.disk)
            nixl = self._start_nixl()
            if self.segment is not None and self.data_server is not None:
                self._segment_template = p.SegmentInfo(0, self.segment.size, self.host_id, self.segment.path,
                                                       self._advertised(self.data_server.addr),
                                                       cfg.tag or f"device{device_id}",
                                                       nixl.descriptor if nixl is not None else b"")
            threads = max(1, min(os.cpu_count() or 1, 8))
            self.engine = TransferEngine(cfg.protocol, self.host_id, self.segment, cfg.client_timeout_seconds,
                                         min(cfg.read_thread_pool_size, threads),
                                         min(cfg.write_thread_pool_size, threads), self.secret,
                                         self._tls_client, self.metrics, copy_threads(cfg), nixl)
            self._start_metrics_server()
            self._join(recover=False)
        except BaseException:
            self.close()
            raise
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="memcache-heartbeat", daemon=True)
        self._heartbeat.start()
        if self.disk is not None:
            self.disk.start()

    def _start_nixl(self) -> NixlTransport | None:
        """The NIXL agent (``transfer_engine: "nixl"``), with our segment registered."""
        if self.config.transfer_engine != "nixl":
            return None
        from ..transfer.nixl import NixlTransport
        return NixlTransport(self.segment, self.config.client_timeout_seconds)

    def register_memory(self, ptr: int, size: int) -> None:
        """A caller's buffer (``register_buffer``): NIXL may move pieces that lie in it."""
        if self.engine is not None and self.engine.nixl is not None:
            self.engine.nixl.register(ptr, size)

    def unregister_memory(self, ptr: int, size: int) -> None:
        if self.engine is not None and self.engine.nixl is not None:
            self.engine.nixl.unregister(ptr, size)

    def _start_metrics_server(self) -> None:
        cfg = self.config
        if cfg.metrics_port:
            from ..auth import admin_token
            token = admin_token(self.secret) if self.secret is not None else None
            self.metrics_server = MetricsServer(self.metrics, cfg.metrics_host, cfg.metrics_port, token)
            logger.info("LocalService metrics on http://%s/metrics", self.metrics_server.addr)

    def _advertised(self, bound: str) -> str:
        """The data address peers should use: ``hcom_advertise_url`` when set, else the bound one."""
        if self.config.hcom_advertise_url:
            host, port = parse_url(self.config.hcom_advertise_url, "hcom_advertise_url", ("tcp",))
            return f"{host}:{port or bound.rsplit(':', 1)[1]}"
        return bound

    def close(self) -> None:
        if self._stop.is_set():
            return
        unmap = self._drain_before_leaving()
        self._stop.set()
        if self.disk is not None:
            self.disk.close()
        if self._heartbeat is not None:
            s = self.session
            try:
                self.rpc.call(p.Leave(s.client_id, s.token), timeout_s=min(2.0, self.config.client_timeout_seconds),
                              probe=True)
            except MemCacheError:
                pass
            self._heartbeat.join(timeout=5)
        self.rpc.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.data_server is not None:
            self.data_server.close()
        if self.engine is not None:
            self.engine.close()
        if self.prefault is not None:
            self.prefault.stop()
        if self.segment is not None and unmap:
            self.segment.close()

    def _drain_before_leaving(self) -> bool:
        """With ``drain_timeout_ms``, move our objects to other segments before we leave (local/drain.py).

        False when a drain's copy out of our segment outlived its bound: the segment stays mapped.
        """
        if not self.drainer.stop(self.config.client_timeout_seconds + 1.0):
            logger.error("a drain copy is still running; the segment stays mapped until the process exits")
            return False
        timeout_s = self.config.drain_timeout_ms / 1000.0
        if timeout_s > 0 and self.segment is not None and self._heartbeat is not None:
            try:
                self.drainer.run(timeout_s, own_bound=True)
            except Exception:   # a bug in the drain must not keep us from leaving
                logger.exception("drain before leaving failed; leaving without it")
        return True

    def _join(self, recover: bool) -> None:
        """Join (or re-join) and install the new session in one step."""
        objects = recovery.scan(self.segment) if recover and self.segment is not None else []
        old = self.session
        on_disk = self.disk.store.reports() if self.disk is not None else []
        reply = self.rpc.call(p.Join(old.client_id, self.host_id, os.getpid(), self._segment_template,
                                     objects, old.token, on_disk), probe=True)
        j = expect(reply, p.Joined)
        seg = None
        if self._segment_template is not None:
            seg = p.SegmentInfo(j.client_id, *_fields(self._segment_template)[1:])
        with self._lock:
            stale, self._segments = list(self._segments.values()), {}
            self._journal_ack = 0
            self.session = Session(j.client_id, j.meta_epoch, j.lease_ttl_ms / 1000.0,
                                   j.pending_timeout_ms / 1000.0, seg, j.token)
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
        while not self._stop.wait(interval):
            try:
                if self._segments and time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + SEGMENT_REFRESH_S
                    self._refresh_segments()   # unmap peers that left even if nobody asks for them
                s = self.session
                r = expect(self.rpc.call(p.Heartbeat(s.client_id, s.token, self._journal_ack), timeout_s=timeout,
                                         probe=True), p.HeartbeatReply)
                if not r.known or r.meta_epoch != s.epoch:
                    if r.meta_epoch != s.epoch:
                        self.metrics.meta_restarts.inc()
                    self.metrics.rejoins.inc()
                    self._rejoin(s)
                    continue
                self._apply_journal(r.journal)
                self.drainer.on_heartbeat(r.drain)
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

    def _member_call(self, make: Callable[[Session], p.Request]) -> p.Reply:
        """A call that acts as this member; after a MetaService restart re-join first, then retry once."""
        s = self.session
        try:
            return self.rpc.call(make(s))
        except errors.NotAMember:
            self._rejoin(s)
            return self.rpc.call(make(self.session))

    def _apply_journal(self, journal: list[p.JournalEntry]) -> None:
        """Objects of our segment that left the pool: clear their headers, so a scan skips them."""
        for e in journal:
            if e.seq <= self._journal_ack:
                continue
            if not e.added and self.segment is not None:
                recovery.clear_header(self.segment, e.obj)
            self._journal_ack = e.seq

    # ---- segments ------------------------------------------------------------------------------------

    def _segment(self, sid: int) -> p.SegmentInfo:
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

    # ---- put: validate -> allocate -> copy -> commit / abort ---------------------------------------------

    def put(self, keys: Sequence[str], pieces: Sequence[Pieces], replicas: int = 1,
            preferred: Sequence[int] = ()) -> list[MemCacheError | None]:
        """Store each key's pieces (laid end to end) as one object. Per-key error or None."""
        results: list[MemCacheError | None] = [None] * len(keys)
        todo = _unique_valid(keys, results)   # key -> index; the same key twice: the first put stands
        if not todo:
            return results
        sizes = {k: sum(n for _, n in pieces[i]) for k, i in todo.items()}
        allocated = self._alloc(sizes, replicas, preferred, results, todo)
        self._note_partial(allocated, replicas)
        s = self.session   # the session the allocation was made in (a re-join may have replaced it)
        t_alloc = time.monotonic()
        ops = self._write_ops(allocated, pieces, results, todo)
        if ops and time.monotonic() - t_alloc >= s.pending_timeout_s / 2:
            for op in ops:   # too late to start: the MetaService may reclaim the space while we copy
                op.error = errors.TransferFailed("put took longer than half the pending timeout")
        elif ops:
            assert self.engine is not None
            self.engine.write(ops)
        for op in ops:
            i = todo[op.key]
            if op.error is not None and results[i] is None:
                results[i] = op.error
        self._finish_put(s, allocated, ops, results, todo)
        if self.disk is not None and allocated:
            self.disk.poke()   # our segment may have grown: the disk tier asks for copies now
        return results

    def _alloc(self, sizes: dict[str, int], replicas: int, preferred: Sequence[int],
               results: list[MemCacheError | None], todo: dict[str, int]) -> dict[str, p.AllocResult]:
        """Allocate space; wait out other writers' pending puts of the same keys (bounded)."""
        allocated: dict[str, p.AllocResult] = {}
        want = list(sizes)
        deadline = time.monotonic() + min(self.session.pending_timeout_s / 2, self.config.client_timeout_seconds)
        backoff = Backoff(0.002, 0.05)
        while want:
            try:
                reply = expect(self._member_call(lambda s, w=want: p.Alloc(  # type: ignore[misc]
                    s.client_id, s.token, w, [sizes[k] for k in w], replicas, list(preferred))), p.AllocReply)
            except MemCacheError as e:
                for k in want:
                    results[todo[k]] = e
                return allocated
            busy = []
            for k, res in zip(want, reply.results, strict=True):
                if res.code == errors.SUCCESS:
                    allocated[k] = res
                elif res.code == errors.WRITE_IN_PROGRESS:
                    busy.append(k)
                elif res.code != errors.OBJECT_ALREADY_EXISTS:   # existing: these bytes are stored
                    results[todo[k]] = errors.error_from_code(res.code, f"cannot put {k!r} ({sizes[k]} bytes)")
            if busy and time.monotonic() >= deadline:
                for k in busy:
                    results[todo[k]] = errors.WriteInProgress(f"another writer's put of {k!r} is still pending")
                break
            if busy:
                time.sleep(backoff.next())
            want = busy
        return allocated

    def _note_partial(self, allocated: dict[str, p.AllocResult], replicas: int) -> None:
        """Fewer segments with room than replicas: the put is placed partially (``get_key_info``
        shows where) and succeeds once every placed replica is written; say so (at most once a minute)."""
        short = [k for k, r in allocated.items() if len(r.locations) < replicas]
        if short and time.monotonic() >= self._partial_warned:
            self._partial_warned = time.monotonic() + 60.0
            logger.warning("%d objects (first %r: %d of %d replicas) were placed on fewer segments than "
                           "replicaNum asks for: the pool has too few segments with room",
                           len(short), short[0], len(allocated[short[0]].locations), replicas)

    def _write_ops(self, allocated: dict[str, p.AllocResult], pieces: Sequence[Pieces],
                   results: list[MemCacheError | None], todo: dict[str, int]) -> list[CopyOp]:
        ops: list[CopyOp] = []
        for key, res in allocated.items():
            i = todo[key]
            size = sum(n for _, n in pieces[i])
            for loc in res.locations:
                try:
                    seg = self._segment(loc.segment_id)
                except MemCacheError as e:
                    results[i] = e
                    break
                ops.append(CopyOp(seg, loc.offset, list(pieces[i]), size, key, res.generation,
                                  hash=self.config.checksum))
        return ops

    def _finish_put(self, s: Session, allocated: dict[str, p.AllocResult], ops: list[CopyOp],
                    results: list[MemCacheError | None], todo: dict[str, int]) -> None:
        checksum = {op.key: op.checksum for op in ops}
        commit = [k for k in allocated if results[todo[k]] is None]
        abort = [k for k in allocated if results[todo[k]] is not None]
        if abort:
            try:
                self.rpc.call(p.Abort(s.client_id, s.token, abort, [allocated[k].generation for k in abort]))
            except MemCacheError as e:
                logger.warning("abort of %d failed puts not delivered (%s); the MetaService reclaims them",
                               len(abort), e)
        if not commit:
            return
        try:
            codes = expect(self.rpc.call(p.Commit(s.client_id, s.token, commit,
                                                  [allocated[k].generation for k in commit],
                                                  [checksum[k] for k in commit])), p.Codes).codes
        except MemCacheError as e:
            codes = [e.code] * len(commit)
        for k, code in zip(commit, codes, strict=True):
            if code != errors.SUCCESS:
                results[todo[k]] = errors.error_from_code(code, f"commit of {k!r} refused")

    # ---- get: lookup -> check sizes -> read with replica fallback -> confirm ---------------------------

    def lookup_sizes(self, keys: Sequence[str]) -> list[p.Found | None]:
        return expect(self.rpc.call(p.Lookup(list(keys), lease=False), idempotent=True), p.LookupReply).results

    def get(self, keys: Sequence[str], pieces: Sequence[Pieces] | None,
            exact: bool = True) -> tuple[list[MemCacheError | None], list[p.Found | None]]:
        """Read each key into its pieces. ``pieces`` None: only lease and return the locations.

        Per-key error or None; a key that is absent gets KeyNotFound. Never a partial success:
        a key whose bytes could not all be read, failed their checksum, or whose lease ran out
        while the space was reused, is an error.
        """
        results: list[MemCacheError | None] = [None] * len(keys)
        found: list[p.Found | None] = [None] * len(keys)
        valid = [i for i in range(len(keys)) if _valid_key(keys[i], results, i)]
        if not valid:
            return results, found
        t0 = time.monotonic()
        try:
            reply = expect(self.rpc.call(p.Lookup([keys[i] for i in valid], lease=True), idempotent=True),
                           p.LookupReply)
        except MemCacheError as e:
            for i in valid:
                results[i] = e
            return results, found
        for i, f in zip(valid, reply.results, strict=True):
            found[i] = f
            if f is None:
                results[i] = errors.KeyNotFound(f"key {keys[i]!r} does not exist")
        if pieces is None:
            return results, found
        todo = [i for i in valid if results[i] is None and _fits(keys[i], pieces[i], found[i], exact, results, i)]
        on_disk = [i for i in todo if not found[i].locations]  # type: ignore[union-attr]
        if on_disk:   # evicted to a provider's disk tier: that provider serves the bytes (local/tier.py)
            tier.read_disk(self, list(keys), list(pieces), found, on_disk, results,
                           self.config.checksum and self.config.checksum_verify_ratio > 0)
            todo = [i for i in todo if found[i].locations]  # type: ignore[union-attr]
        corrupt = self._read(keys, pieces, found, todo, results)
        fallback = [i for i in todo if results[i] is not None and found[i].disk]  # type: ignore[union-attr]
        if fallback:   # every DRAM copy failed: the provider's disk record is one more replica
            tier.read_disk(self, list(keys), list(pieces), found, fallback, results,
                           self.config.checksum and self.config.checksum_verify_ratio > 0)
        failed = [e for e in (results[i] for i in todo) if e is not None]
        if failed:   # a miss the engine will recompute: say why, once per batch
            logger.warning("%d of %d objects could not be read; first: %s: %s", len(failed), len(todo),
                           type(failed[0]).__name__, failed[0])
        if time.monotonic() - t0 > reply.lease_ttl_ms / 1000.0 * LEASE_SAFETY:
            self._confirm(keys, found, results)
        if corrupt:
            self._report_corrupt(corrupt)
        return results, found

    def _read(self, keys: Sequence[str], pieces: Sequence[Pieces], found: list[p.Found | None],
              todo: list[int], results: list[MemCacheError | None]) -> list[tuple[str, int, int]]:
        """Read each key from its replicas in turn, nearest first; a replica that fails (a dead or
        unknown peer, bytes failing their checksum) is followed by the next. Returns the corrupt
        replicas as (key, generation, segment id)."""
        assert self.engine is not None
        ratio = self.config.checksum_verify_ratio if self.config.checksum else 0.0
        corrupt: list[tuple[str, int, int]] = []
        attempt = {i: list(found[i].locations) for i in todo}  # type: ignore[union-attr]
        self._know_segments([loc for locs in attempt.values() if len(locs) > 1 for loc in locs])
        attempt = {i: self._replica_order(locs) for i, locs in attempt.items()}
        while todo:
            ops, owners = [], []
            for i in todo:
                f, seg = found[i], self._next_replica(attempt[i], results, i)
                if seg is None or f is None:
                    continue
                verify = ratio >= 1.0 or (ratio > 0 and self._sample.random() < ratio)
                ops.append(CopyOp(seg[0], seg[1], _clip(pieces[i], f.size), f.size, keys[i], f.generation,
                                  f.checksum, hash=verify))
                owners.append(i)
            self.engine.read(ops)
            todo = []
            for i, op in zip(owners, ops, strict=True):
                results[i] = op.error
                if isinstance(op.error, errors.ChecksumMismatch):
                    self.integrity_failures += 1
                    logger.error("integrity failure: %s", op.error)
                    corrupt.append((op.key, op.generation, op.segment.segment_id))
                if op.error is not None and attempt[i]:
                    logger.info("reading %r from segment %d failed (%s); trying another replica", op.key,
                                op.segment.segment_id, op.error)
                    todo.append(i)
        return corrupt

    def _know_segments(self, locs: list[p.Location]) -> None:
        """Fetch the segment table once when replicas lie in segments not known here (to rank them)."""
        if any(loc.segment_id not in self._segments for loc in locs):
            try:
                self._refresh_segments()
            except MemCacheError as e:
                logger.debug("segment table not refreshed: %s", e)

    def _next_replica(self, left: list[p.Location], results: list[MemCacheError | None],
                      i: int) -> tuple[p.SegmentInfo, int] | None:
        """The next replica of key ``i`` whose segment is in the pool, as (segment, offset)."""
        while left:
            loc = left.pop(0)
            try:
                return self._segment(loc.segment_id), loc.offset
            except MemCacheError as e:
                results[i] = e
        return None

    def _report_corrupt(self, corrupt: list[tuple[str, int, int]]) -> None:
        try:
            self._member_call(lambda s: p.Corrupt(s.client_id, s.token, [k for k, _, _ in corrupt],
                                                  [g for _, g, _ in corrupt], [sid for _, _, sid in corrupt]))
        except MemCacheError as e:
            logger.warning("could not report %d corrupt objects: %s", len(corrupt), e)

    def _replica_order(self, locs: list[p.Location]) -> list[p.Location]:
        """Our own segment first, then segments on this host (shared memory, or TCP over loopback),
        then the others in the MetaService's order."""
        if len(locs) == 1:
            return locs
        return sorted(locs, key=lambda loc: replica_distance(self._segments.get(loc.segment_id),
                                                            self.segment, self.host_id))

    def _confirm(self, keys: Sequence[str], found: list[p.Found | None],
                 results: list[MemCacheError | None]) -> None:
        """The reads outlived their lease: keep only those whose objects were not replaced since."""
        idx = [i for i, r in enumerate(results) if r is None and found[i] is not None]
        if not idx:
            return
        try:
            flags = expect(self.rpc.call(p.Validate([keys[i] for i in idx],
                                                    [found[i].generation for i in idx]),  # type: ignore[union-attr]
                                         idempotent=True), p.Flags).flags
        except MemCacheError as e:
            flags = [False] * len(idx)
            logger.warning("could not confirm %d reads that outlived their lease: %s", len(idx), e)
        for i, ok in zip(idx, flags, strict=True):
            if not ok:
                results[i] = errors.LeaseExpired(f"{keys[i]!r} changed while a slow read held an expired lease")

    # ---- exist / remove ----------------------------------------------------------------------------

    def exist(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        check_keys(keys)
        return expect(self.rpc.call(p.Exist(keys), idempotent=True), p.Flags).flags

    def remove(self, keys: Sequence[str]) -> list[int]:
        for k in keys:
            check_key(k)
        return expect(self.rpc.call(p.Remove(list(keys))), p.Codes).codes

    def remove_prefix(self, prefix: str) -> int:
        if not isinstance(prefix, str) or not prefix:
            raise InvalidParameter("remove_by_prefix: the prefix must be a non-empty string")
        check_key(prefix)
        return expect(self.rpc.call(p.RemovePrefix(prefix)), p.Codes).codes[0]

    def remove_all(self) -> int:
        return expect(self.rpc.call(p.RemoveAll()), p.Codes).codes[0]

    # ---- tiers: memcache_hybrid's evict / prefetch ------------------------------------------------------

    def prefetch(self, keys: Sequence[str]) -> list[int]:
        """Bring objects held on a disk tier back into DRAM (their provider's segment) ahead of a read.
        A code per key: 0 in DRAM now (or already), -3007 not in the pool, else why it stayed on disk."""
        check_keys(list(keys))
        found = self.lookup_sizes(keys)
        codes = [errors.SUCCESS if f is not None else errors.OBJECT_NOT_EXISTS for f in found]
        by_owner: dict[int, list[int]] = {}
        for i, f in enumerate(found):
            if f is not None and not f.locations:
                by_owner.setdefault(f.disk, []).append(i)
        for sid, idx in by_owner.items():
            got = tier.promote_remote(self, sid, [(keys[i], found[i].size, found[i].checksum)  # type: ignore[union-attr]
                                                  for i in idx])
            for i, c in zip(idx, got, strict=True):
                codes[i] = c
        return codes

    def evict(self, keys: Sequence[str]) -> list[int]:
        """Keep objects on their disk tier only, freeing their DRAM. A code per key: 0 done, -3007 not in
        the pool, -3101 no disk copy yet (its provider was asked to write one: call again later)."""
        check_keys(list(keys))
        return expect(self.rpc.call(p.Demote(list(keys))), p.Codes).codes


def copy_threads(cfg: LocalConfig) -> int:
    """``shm_copy_threads``, or (0) one thread on hosts with 2 CPUs or fewer (measured: a second thread
    waits for a core the engine's own threads need) and half the CPUs up to 4 elsewhere
    (benchmarks/README.md, bench_copy.py)."""
    cpus = os.cpu_count() or 1
    return cfg.shm_copy_threads or (1 if cpus <= 2 else min(cpus // 2, 4))


def replica_distance(seg: p.SegmentInfo | None, own: Mapping | None, host_id: str) -> int:
    """How near a replica is: 0 in our own segment, 1 on this host, 2 elsewhere, 3 not known here."""
    if seg is None:
        return 3
    if own is not None and seg.shm_path == own.path:
        return 0
    return 1 if seg.host_id == host_id else 2


def _valid_key(key: str, results: list[MemCacheError | None], i: int) -> bool:
    try:
        check_key(key)
        return True
    except InvalidParameter as e:
        results[i] = e
        return False


def _unique_valid(keys: Sequence[str], results: list[MemCacheError | None]) -> dict[str, int]:
    todo: dict[str, int] = {}
    for i, key in enumerate(keys):
        if _valid_key(key, results, i) and key not in todo:
            todo[key] = i
    return todo


def _fits(key: str, pieces: Pieces, f: p.Found | None, exact: bool, results: list[MemCacheError | None],
          i: int) -> bool:
    assert f is not None
    want = sum(s for _, s in pieces)
    if (want != f.size) if exact else (want < f.size):
        results[i] = InvalidParameter(f"buffer of {want} bytes for {key!r} of {f.size} bytes")
        return False
    return True


def _clip(pieces: Pieces, size: int) -> Pieces:
    """The pieces cut to ``size`` bytes in total (for reads into buffers larger than the object)."""
    out, left = [], size
    for ptr, s in pieces:
        if left <= 0:
            break
        out.append((ptr, min(s, left)))
        left -= s
    return out


def _fields(info: p.SegmentInfo) -> tuple:
    return (info.segment_id, info.size, info.host_id, info.shm_path, info.data_addr, info.tag, info.nixl)
