"""LocalService: joins the pool, contributes a segment, and does batched put / get / exist.

Everything here raises ``MemCacheError`` or reports per-key errors; integer codes exist only in
``store.py``. One instance is shared by many threads; payload copies never hold a lock.

The class is assembled from parts, each in its own module: ``membership.py`` (the ``Session``, joins,
heartbeat, segment table), ``writes.py`` (put: validate -> allocate -> copy -> commit / abort) and
``reads.py`` (get: lookup -> check sizes -> read with replica fallback -> confirm), ``gva.py`` (the GVA
path: alloc, ranged copies, finish, leases). This module keeps
the lifecycle (start, close, the drain before leaving, the metrics server, NIXL), exist / remove and
the tier calls (prefetch / evict).
"""

from __future__ import annotations

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
from ..config import ASCEND_PROTOCOLS, LocalConfig, parse_url
from ..errors import CannotListen, InvalidParameter, MemCacheError, check_key, check_keys
from ..etcd import EtcdAuth
from ..host import env_host_id
from ..memory import Mapping
from ..rpc import RpcClient, expect
from ..rpc.framing import raise_fd_limit
from ..transfer import TransferEngine, native
from ..transfer.memfabric import require_memfabric
from ..transfer.tcp_server import DataServer
from ..values import WILDCARD_HOSTS
from . import tier
from .arena import ArenaWriter
from .drain import Drainer
from .gva import Gva
from .gva_book import GvaBook
from .hints import LocationHints
from .hold import Hold
from .membership import in_batches
from .metrics import LocalMetrics, MetricsServer
from .prefault import Prefault, start_prefault
from .reads import Reads
from .reads import replica_distance as replica_distance
from .segment import create_segment
from .session import Pieces as Pieces
from .session import Session
from .writes import Writes

if TYPE_CHECKING:
    from ..transfer.nixl import NixlTransport

logger = logging.getLogger(__name__)

CONFIRM_POLL_S = 0.005      # a remove asks whether the owners cleared the headers, first after this
CONFIRM_POLL_MAX_S = 0.05   # and then at most this far apart


class LocalService(Writes, Reads, Gva):
    def __init__(self, config: LocalConfig) -> None:
        config.validate()
        if config.protocol in ASCEND_PROTOCOLS:
            require_memfabric(config.protocol)
        self.config = config
        self.host_id = config.host_id or env_host_id()
        self.secret = load_secret(config.auth_secret_path, pool_name=config.pool_name) if config.auth_enable else None
        self.tls_client = tls.client_context(config)
        self.rpc = RpcClient(config.meta_service_url, config.client_timeout_seconds,
                             config.client_retry_milliseconds, self.secret, tls=self.tls_client,
                             spin_s=config.rpc_spin_us / 1e6, etcd_auth=EtcdAuth.of(config))
        self.session = Session(0, 0, 10.0, 120.0, None)
        self.segment: Mapping | None = None
        self.hold: Hold | None = None   # its fence across joins (hold.py)
        self._segment_template: p.SegmentInfo | None = None   # our segment, before an id is issued
        self.data_server: DataServer | None = None
        self.engine: TransferEngine | None = None
        self._segments: dict[int, p.SegmentInfo] = {}
        self._journal_ack = 0
        self.generation_ceiling = 0
        self.pool_disk_tiers = 0
        self._departures = 0
        self._sample = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._lock = threading.Lock()
        self._join_lock = threading.Lock()
        self._stop = threading.Event()
        self._beat_now = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.integrity_failures = 0
        self.hints = LocationHints(config.location_hints)
        self._partial_warned = 0.0   # when a partial placement may be logged again
        self.drainer = Drainer(self)
        self.metrics = LocalMetrics()
        self.metrics.held = lambda: self.held
        self.metrics_server: MetricsServer | None = None
        self.disk: tier.DiskTier | None = None   # the disk tier under our segment (disk_path)
        self.prefault: Prefault | None = None
        self._gva_book: GvaBook | None = None   # GVAs handed out in the current session (gva.py)
        self.arenas: ArenaWriter | None = None   # small puts through our own segment (arena.py)
        self._waiting = None   # the first join, retried until the pool answers (wait_for_pool; membership.py)
        self.join_error = None

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self, device_id: int, with_segment: bool, metrics_required: bool = False,
              wait_for_pool: bool = False, on_join_failed: Callable[[MemCacheError], None] | None = None) -> None:
        """Create the segment (``with_segment``) and join. A ``metrics_port`` that cannot be bound
        fails the start only with ``metrics_required`` (a standalone provider, whose metrics are its
        only view); inside an engine it is a warning and the engine starts without them.

        With ``wait_for_pool`` (a standalone provider) a MetaService that does not answer yet is
        waited for: the start returns, the join is retried in the background with backoff
        (``background_join.py``), and ``joined`` (its metrics, ``/health``, ``/ready``) says when it is
        in. A permanent refusal (a wrong pool secret, ``auth_enable`` differing, a Join refused as
        invalid) fails the start, or later ends the wait with ``on_join_failed(error)``."""
        cfg = self.config
        try:
            if with_segment:
                size = cfg.dram_bytes
                if size <= 0:
                    raise InvalidParameter("dram_size: must be positive for a LocalService that holds memory")
                self.segment = create_segment(size)
                self.hold = Hold(self.segment.fence, cfg.fence_wait_ms / 1000.0, self._join_lock, self._stop,
                                 self._beat_now)
                self.prefault = start_prefault(self.segment, cfg)
                if cfg.small_put_max_bytes:
                    self.arenas = ArenaWriter(self.segment, self.rpc, cfg.checksum)
                if cfg.disk_path:
                    self.disk = tier.DiskTier(self)
                    self.metrics.watch_disk(self.disk.counters)
                host, port = parse_url(cfg.hcom_url, "hcom_url", ("tcp",))
                raise_fd_limit()   # every peer's connection is a descriptor
                self.data_server = DataServer(self.segment, host, port, self.secret, tls.server_context(cfg),
                                              self.disk, self.metrics.serve, loop=cfg.data_server_loop)
            nixl = self._start_nixl()
            self._start_metrics_server(metrics_required)
            if self.segment is not None and self.data_server is not None:
                self._segment_template = p.SegmentInfo(0, self.segment.size, self.host_id, self.segment.path,
                                                       self._advertised(self.data_server.addr),
                                                       cfg.tag or f"device{device_id}",
                                                       nixl.descriptor if nixl is not None else b"",
                                                       self._metrics_addr(), owner_lock=self.segment.owner_lock)
            threads = max(1, min(os.cpu_count() or 1, 8))
            self.engine = TransferEngine(cfg.protocol, self.host_id, self.segment, cfg.client_timeout_seconds,
                                         min(cfg.read_thread_pool_size, threads),
                                         min(cfg.write_thread_pool_size, threads), self.secret,
                                         self.tls_client, self.metrics, copy_threads(cfg), nixl,
                                         cfg.shm_copy_loop, cfg.read_deadline_ms / 1000.0 or None)
            if not self._first_join_or_wait(wait_for_pool, on_join_failed):
                return   # waiting for the pool: joined in the background (membership.py)
        except BaseException:
            self.close()
            raise
        self._joined(None)

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

    def _start_metrics_server(self, required: bool) -> None:
        """Metrics never stop an engine's LocalService from starting: a port that cannot be bound is
        a warning naming the key and the remedy, and this LocalService runs without it."""
        cfg = self.config
        if cfg.metrics_port:
            from ..auth import admin_token
            token = admin_token(self.secret) if self.secret is not None else None
            try:
                self.metrics_server = MetricsServer(self.metrics, cfg.metrics_host, cfg.metrics_port, token)
            except CannotListen as e:
                if required:
                    raise
                logger.warning("%s; this LocalService runs without its metrics port (the engine plugins give "
                               "each rank metrics_port + rank)", e)
                return
            logger.info("LocalService metrics on http://%s/metrics", self.metrics_server.addr)

    def _metrics_addr(self) -> str:
        """Where the MetaService's /get_all_segments and status page say this segment's metrics are."""
        if self.metrics_server is None:
            return ""
        host, port = self.metrics_server.addr.rsplit(":", 1)
        if host in WILDCARD_HOSTS and self.data_server is not None:
            host = self._advertised(self.data_server.addr).rsplit(":", 1)[0]
        return f"{host}:{port}"

    def _advertised(self, bound: str) -> str:
        """The data address peers should use: ``hcom_advertise_url`` when set, else the bound one."""
        if self.config.hcom_advertise_url:
            host, port = parse_url(self.config.hcom_advertise_url, "hcom_advertise_url", ("tcp",))
            return f"{host}:{port or bound.rsplit(':', 1)[1]}"
        return bound

    def close(self) -> None:
        if self._stop.is_set():
            return
        if self._waiting is not None:   # no new attempt; one on the way ends within the client timeout
            self._waiting.stop()
            self._waiting.wait(self.config.client_timeout_seconds + 1.0)
        unmap = self._drain_before_leaving()
        self._stop.set()
        self._beat_now.set()
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

    # ---- exist / remove ----------------------------------------------------------------------------

    @in_batches()
    def exist(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        check_keys(keys)
        return expect(self.rpc.call(p.Exist(keys), idempotent=True), p.Flags).flags

    @in_batches()
    def remove(self, keys: Sequence[str]) -> list[int]:
        for k in keys:
            check_key(k)
        self.hints.forget(keys)
        r = expect(self.rpc.call(p.Remove(list(keys))), p.Codes)
        if self._confirmed(r):
            return r.codes
        return [errors.META_NOT_CONNECTED if c == errors.SUCCESS else c for c in r.codes]

    def remove_prefix(self, prefix: str) -> int:
        if not isinstance(prefix, str) or not prefix:
            raise InvalidParameter("remove_by_prefix: the prefix must be a non-empty string")
        check_key(prefix)
        self.hints.forget()
        r = expect(self.rpc.call(p.RemovePrefix(prefix)), p.Codes)
        return r.codes[0] if self._confirmed(r) else errors.META_NOT_CONNECTED

    def remove_all(self) -> int:
        self.hints.forget()
        r = expect(self.rpc.call(p.RemoveAll()), p.Codes)
        return r.codes[0] if self._confirmed(r) else errors.META_NOT_CONNECTED

    def _confirmed(self, reply: p.Codes) -> bool:
        """Wait until the owners of the removed objects have cleared their headers (they do on their
        next heartbeat), so that no MetaService crash after we return can bring the objects back
        (docs/design.md, "Failure of the MetaService"). An owner declared dead meanwhile counts as
        confirmed: its re-join's reports of them are refused. False when the MetaService restarted or
        became unreachable first, or ``client_timeout_seconds`` passed: the removal may be undone."""
        waiting, delay = reply.confirm, CONFIRM_POLL_S
        deadline = time.monotonic() + self.config.client_timeout_seconds
        own = self.session.segment
        if own is not None and any(sid == own.segment_id for sid, _, _ in waiting):
            self._beat_now.set()   # our own segment: clear and acknowledge now, not on the next heartbeat
        while waiting:
            if time.monotonic() + delay > deadline:
                logger.warning("remove: %d owners did not confirm within %gs", len(waiting),
                               self.config.client_timeout_seconds)
                return False
            time.sleep(delay)
            delay = min(2 * delay, CONFIRM_POLL_MAX_S)
            try:
                flags = expect(self.rpc.call(p.Confirmed(reply.epoch, waiting), idempotent=True), p.Flags).flags
            except MemCacheError as e:
                logger.warning("remove: could not learn whether the owners cleared the removed objects: %s", e)
                return False
            waiting = [j for j, ok in zip(waiting, flags, strict=True) if not ok]
        return True

    # ---- tiers: memcache_hybrid's evict / prefetch ------------------------------------------------------

    @in_batches()
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

    @in_batches()
    def evict(self, keys: Sequence[str]) -> list[int]:
        """Keep objects on their disk tier only, freeing their DRAM. A code per key: 0 done, -3007 not in
        the pool, -3101 no disk copy yet (its provider was asked to write one: call again later)."""
        check_keys(list(keys))
        return expect(self.rpc.call(p.Demote(list(keys))), p.Codes).codes


def copy_threads(cfg: LocalConfig) -> int:
    """``shm_copy_threads``, or (0) half the CPUs up to 4, and on hosts with 2 CPUs or fewer: 2 with the
    native loop (measured there: +30-45% on batches of 8 objects when the other core is free, at most
    ~5% lost when it is busy), 1 with the Python loop (a second thread lost)
    (benchmarks/README.md, bench_copy.py)."""
    cpus = os.cpu_count() or 1
    if cfg.shm_copy_threads:
        return cfg.shm_copy_threads
    if cpus <= 2:
        return 2 if cpus == 2 and cfg.shm_copy_loop != "python" and native.load() is not None else 1
    return min(cpus // 2, 4)

