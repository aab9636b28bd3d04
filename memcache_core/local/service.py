"""LocalService: joins the pool, contributes a segment, and does batched put / get / exist.

Everything here raises ``MemCacheError`` or reports per-key errors; integer codes exist only in
``store.py``. One instance is shared by many threads: the only lock guards the small table of this
segment's objects; payload copies never hold a lock.

Put is two-phase: ``Alloc`` (objects PENDING), copy, ``Commit`` (visible), or ``Abort`` on failure.
Get leases: ``Lookup`` leases the objects for ``lease_ttl``; a read that finishes later than that is
confirmed with ``Validate`` (same generation = the space was not reused) before it counts as a hit.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Sequence

from .. import errors
from .. import protocol as p
from ..config import ASCEND_PROTOCOLS, LocalConfig, env_host_id, parse_url
from ..errors import InvalidParameter, MemCacheError, MetaServiceUnavailable, check_key, check_keys
from ..rpc import RpcClient, expect
from ..transfer import CopyOp, TransferEngine
from ..transfer.memfabric import require_memfabric
from ..transfer.tcp import DataServer
from .segment import Mapping, create_segment

logger = logging.getLogger(__name__)

LEASE_SAFETY = 0.8          # trust a read without Validate only if it ended within 80% of the lease

Pieces = list[tuple[int, int]]


class LocalService:
    def __init__(self, config: LocalConfig) -> None:
        config.validate()
        if config.protocol in ASCEND_PROTOCOLS:
            require_memfabric(config.protocol)
        self.config = config
        self.host_id = config.host_id or env_host_id()
        self.rpc = RpcClient(config.meta_service_url, config.client_timeout_seconds,
                             config.client_retry_milliseconds)
        self.client_id = random.randrange(1, 1 << 31)
        self.segment: Mapping | None = None
        self.segment_info: p.SegmentInfo | None = None
        self.data_server: DataServer | None = None
        self.engine: TransferEngine | None = None
        self.epoch = 0
        self.lease_ttl_s = 10.0
        self.pending_timeout_s = 120.0
        self._segments: dict[int, p.SegmentInfo] = {}
        self._objects: dict[str, p.ObjectReport] = {}   # committed objects in our segment (recovery)
        self._journal_ack = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self, device_id: int, with_segment: bool) -> None:
        cfg = self.config
        if with_segment:
            size = cfg.dram_bytes
            if size <= 0:
                raise InvalidParameter("dram_size: must be positive for a LocalService that holds memory")
            self.segment = create_segment(self.client_id, size)
            host, port = parse_url(cfg.hcom_url, "hcom_url", ("tcp",))
            self.data_server = DataServer(self.segment, host, port)
            self.segment_info = p.SegmentInfo(self.client_id, self.segment.size, self.host_id,
                                              self.segment.path, self.data_server.addr,
                                              cfg.tag or f"device{device_id}")
        threads = max(1, min(os.cpu_count() or 1, 8))
        self.engine = TransferEngine(cfg.protocol, self.host_id, self.segment,
                                     self.client_id if with_segment else None, cfg.client_timeout_seconds,
                                     min(cfg.read_thread_pool_size, threads),
                                     min(cfg.write_thread_pool_size, threads))
        try:
            self._join(recover=False)
        except MemCacheError:
            self.close()
            raise
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="memcache-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._heartbeat is not None:
            try:
                self.rpc.call(p.Leave(self.client_id), timeout_s=min(2.0, self.config.client_timeout_seconds),
                              probe=True)
            except MemCacheError:
                pass
            self._heartbeat.join(timeout=5)
        self.rpc.close()
        if self.data_server is not None:
            self.data_server.close()
        if self.engine is not None:
            self.engine.close()
        if self.segment is not None:
            self.segment.close()

    def _join(self, recover: bool) -> None:
        with self._lock:
            objects = list(self._objects.values()) if recover else []
        for _ in range(8):
            try:
                reply = self.rpc.call(p.Join(self.client_id, self.host_id, os.getpid(), self.segment_info,
                                             objects), probe=True)
                break
            except errors.ObjectExists:   # our random id is taken: draw another (only before data exists)
                if self.segment_info is not None and objects:
                    raise
                self.client_id = random.randrange(1, 1 << 31)
                if self.segment_info is not None:
                    self.segment_info = p.SegmentInfo(self.client_id, *_fields(self.segment_info)[1:])
        else:
            raise MemCacheError("could not obtain a client id")
        j = expect(reply, p.Joined)
        self.epoch = j.meta_epoch
        self.lease_ttl_s = j.lease_ttl_ms / 1000.0
        self.pending_timeout_s = j.pending_timeout_ms / 1000.0
        self._journal_ack = 0
        with self._lock:
            self._segments.clear()
        if recover:
            logger.info("re-joined MetaService (epoch %d) with %d objects", self.epoch, len(objects))

    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_ms / 1000.0
        timeout = min(self.config.client_timeout_seconds, max(1.0, 3 * interval))
        while not self._stop.wait(interval):
            try:
                r = expect(self.rpc.call(p.Heartbeat(self.client_id, self._journal_ack), timeout_s=timeout,
                                         probe=True), p.HeartbeatReply)
                if not r.known or r.meta_epoch != self.epoch:
                    self._join(recover=True)
                    continue
                self._apply_journal(r.journal)
            except MetaServiceUnavailable:
                continue
            except MemCacheError as e:
                logger.warning("heartbeat failed: %s", e)
            except Exception:
                logger.exception("heartbeat loop error")

    def _apply_journal(self, journal: list[p.JournalEntry]) -> None:
        if not journal:
            return
        with self._lock:
            for e in journal:
                if e.seq <= self._journal_ack:
                    continue
                if e.added:
                    self._objects[e.obj.key] = e.obj
                else:
                    cur = self._objects.get(e.obj.key)
                    if cur is not None and cur.generation == e.obj.generation:
                        del self._objects[e.obj.key]
                self._journal_ack = e.seq

    # ---- segments ------------------------------------------------------------------------------------

    def _segment(self, sid: int) -> p.SegmentInfo:
        seg = self._segments.get(sid)
        if seg is None:
            r = expect(self.rpc.call(p.GetSegments([]), idempotent=True), p.Segments)
            with self._lock:
                for s in r.segments:
                    old = self._segments.get(s.segment_id)
                    if old is not None and old != s and self.engine is not None:
                        self.engine.forget(old)
                    self._segments[s.segment_id] = s
            seg = self._segments.get(sid)
            if seg is None:
                raise errors.PeerUnavailable(f"segment {sid} is not in the pool")
        return seg

    # ---- put -------------------------------------------------------------------------------------

    def put(self, keys: Sequence[str], pieces: Sequence[Pieces], replicas: int = 1,
            preferred: Sequence[int] = ()) -> list[MemCacheError | None]:
        """Store each key's pieces (laid end to end) as one object. Per-key error or None."""
        n = len(keys)
        results: list[MemCacheError | None] = [None] * n
        todo: dict[str, int] = {}
        for i, key in enumerate(keys):
            try:
                check_key(key)
            except InvalidParameter as e:
                results[i] = e
                continue
            if key in todo:
                continue   # the same key twice in one batch: the first put stands, the second is a no-op
            todo[key] = i
        if not todo:
            return results
        idx = list(todo.values())
        sizes = [sum(s for _, s in pieces[i]) for i in idx]
        try:
            reply = expect(self.rpc.call(p.Alloc(self.client_id, list(todo), sizes, replicas, list(preferred))),
                           p.AllocReply)
        except MemCacheError as e:
            for i in idx:
                results[i] = e
            return results
        t_alloc = time.monotonic()
        ops: list[CopyOp] = []
        owners: list[int] = []
        allocated: list[tuple[int, str, int]] = []
        for i, key, size, res in zip(idx, todo, sizes, reply.results, strict=True):
            if res.code == errors.OBJECT_ALREADY_EXISTS:
                continue   # content-addressed: an existing key already holds these bytes
            if res.code != errors.SUCCESS:
                results[i] = errors.error_from_code(res.code, f"cannot put {key!r} ({size} bytes)")
                continue
            allocated.append((i, key, res.generation))
            for loc in res.locations:
                try:
                    seg = self._segment(loc.segment_id)
                except MemCacheError as e:
                    results[i] = e
                    break
                ops.append(CopyOp(seg, loc.offset, list(pieces[i]), size))
                owners.append(i)
        if ops and time.monotonic() - t_alloc < self.pending_timeout_s / 2:
            assert self.engine is not None
            self.engine.write(ops)
        elif ops:
            for i in set(owners):
                results[i] = errors.TransferFailed("put took longer than half the pending timeout")
        for i, op in zip(owners, ops, strict=True):
            if op.error is not None and results[i] is None:
                results[i] = op.error
        commit = [(i, k, g) for i, k, g in allocated if results[i] is None]
        abort = [(i, k, g) for i, k, g in allocated if results[i] is not None]
        if abort:
            try:
                self.rpc.call(p.Abort(self.client_id, [k for _, k, _ in abort], [g for _, _, g in abort]))
            except MemCacheError as e:
                logger.warning("abort of %d failed puts not delivered (%s); the MetaService reclaims them", len(abort), e)
        if commit:
            try:
                codes = expect(self.rpc.call(p.Commit(self.client_id, [k for _, k, _ in commit],
                                                      [g for _, _, g in commit])), p.Codes).codes
            except MemCacheError as e:
                codes = [e.code] * len(commit)
            for (i, k, _), code in zip(commit, codes, strict=True):
                if code != errors.SUCCESS:
                    results[i] = errors.error_from_code(code, f"commit of {k!r} refused")
        return results

    # ---- get -------------------------------------------------------------------------------------

    def lookup_sizes(self, keys: Sequence[str]) -> list[p.Found | None]:
        return expect(self.rpc.call(p.Lookup(list(keys), lease=False), idempotent=True), p.LookupReply).results

    def get(self, keys: Sequence[str], pieces: Sequence[Pieces] | None,
            exact: bool = True) -> tuple[list[MemCacheError | None], list[p.Found | None]]:
        """Read each key into its pieces. ``pieces`` None: only lease and return the locations.

        Per-key error or None; a key that is absent gets KeyNotFound. Never a partial success:
        a key whose bytes could not all be read, or whose lease ran out while the space was
        reused, is an error.
        """
        n = len(keys)
        results: list[MemCacheError | None] = [None] * n
        valid = []
        for i, key in enumerate(keys):
            try:
                check_key(key)
                valid.append(i)
            except InvalidParameter as e:
                results[i] = e
        found: list[p.Found | None] = [None] * n
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
        ttl = reply.lease_ttl_ms / 1000.0
        for i, f in zip(valid, reply.results, strict=True):
            found[i] = f
            if f is None:
                results[i] = errors.KeyNotFound(f"key {keys[i]!r} does not exist")
        if pieces is None:
            return results, found
        pending = [i for i in valid if results[i] is None]
        for i in pending:
            want = sum(s for _, s in pieces[i])
            f = found[i]
            assert f is not None
            if (want != f.size) if exact else (want < f.size):
                results[i] = InvalidParameter(f"buffer of {want} bytes for {keys[i]!r} of {f.size} bytes")
        todo = [i for i in pending if results[i] is None]
        # try replicas in turn: local ones first
        attempt = {i: self._replica_order(found[i]) for i in todo}  # type: ignore[arg-type]
        while todo:
            ops, owners = [], []
            for i in todo:
                loc = attempt[i].pop(0)
                try:
                    seg = self._segment(loc.segment_id)
                except MemCacheError as e:
                    results[i] = e
                    continue
                f = found[i]
                assert f is not None
                ops.append(CopyOp(seg, loc.offset, _clip(pieces[i], f.size), f.size))
                owners.append(i)
            assert self.engine is not None
            self.engine.read(ops)
            retry = []
            for i, op in zip(owners, ops, strict=True):
                results[i] = op.error
                if op.error is not None and attempt[i]:
                    retry.append(i)
            todo = retry
        if time.monotonic() - t0 > ttl * LEASE_SAFETY:
            self._confirm(keys, found, results)
        return results, found

    def _replica_order(self, f: p.Found) -> list[p.Location]:
        locs = list(f.locations)
        if self.engine is None or len(locs) == 1:
            return locs
        return sorted(locs, key=lambda loc: 0 if loc.segment_id in self._segments
                      and self.engine.local(self._segments[loc.segment_id]) else 1)  # type: ignore[union-attr]

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
        check_keys(list(keys))
        return expect(self.rpc.call(p.Exist(list(keys)), idempotent=True), p.Flags).flags

    def remove(self, keys: Sequence[str]) -> list[int]:
        for k in keys:
            check_key(k)
        return expect(self.rpc.call(p.Remove(list(keys))), p.Codes).codes

    def remove_all(self) -> int:
        return expect(self.rpc.call(p.RemoveAll()), p.Codes).codes[0]


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
    return (info.segment_id, info.size, info.host_id, info.shm_path, info.data_addr, info.tag)
