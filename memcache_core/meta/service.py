"""The MetaService process: one thread serving the control plane, one serving HTTP admin.

It never touches payload bytes. State lives in memory only; after a restart the LocalServices
re-join and report the objects in their segments (see ``ObjectTable.add_segment``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import threading
import time

import msgspec

from .. import errors
from .. import protocol as p
from ..config import MetaConfig, parse_url
from ..rpc import FrameServer
from .http import AdminServer
from .metrics import Metrics
from .table import ObjectTable

logger = logging.getLogger(__name__)

RECOVERY_GRACE_S = 1.0   # a re-joined segment takes new objects only after writers of the old epoch are done


@dataclasses.dataclass
class Member:
    client_id: int
    host_id: str
    pid: int
    segment_id: int | None
    last_seen: float


class MetaServiceCore:
    """Request handling and housekeeping; the socket loop is in ``serve``."""

    def __init__(self, config: MetaConfig) -> None:
        self.config = config
        self.epoch = int(time.time()) & 0x7FFFFFFF
        self.table = ObjectTable(config.evict_threshold_high, config.evict_threshold_low,
                                 config.lease_ttl_ms / 1000.0, config.pending_timeout_ms / 1000.0,
                                 self.epoch)
        self.members: dict[int, Member] = {}
        self.config_store: dict[str, bytes] = {}
        self.metrics = Metrics()
        self.lock = threading.Lock()   # the HTTP thread reads under it
        self.started = time.monotonic()

    # ---- dispatch ---------------------------------------------------------------------------------

    def handle(self, req: p.Request) -> p.Reply:
        now = time.monotonic()
        t = self.table
        match req:
            case p.Exist(keys=keys):
                t.counters.exists += len(keys)
                objs = t.objects   # ObjectTable.exists inlined: this is the hottest request
                return p.Flags([o is not None and o.committed for o in map(objs.get, keys)])
            case p.Lookup(keys=keys, lease=lease):
                results = []
                for k in keys:
                    o = t.lookup(k, now, lease)
                    results.append(None if o is None else p.Found(o.size, o.generation, list(o.locations), o.checksum))
                return p.LookupReply(results, self.config.lease_ttl_ms)
            case p.Alloc(client_id=cid, keys=keys, sizes=sizes, replicas=replicas, preferred=preferred):
                if len(keys) != len(sizes):
                    return p.Error(errors.INVALID_PARAM, "keys and sizes differ in length")
                member = self._touch(cid, now)
                order = self._placement(member, preferred)
                out = []
                for k, s in zip(keys, sizes, strict=True):
                    code, gen, locs = t.alloc(cid, k, s, replicas, order, now)
                    out.append(p.AllocResult(code, gen, locs))
                return p.AllocReply(out)
            case p.Commit(client_id=cid, keys=keys, generations=gens):
                self._touch(cid, now)
                sums = req.checksums or [0] * len(keys)
                if not len(keys) == len(gens) == len(sums):
                    return p.Error(errors.INVALID_PARAM, "keys, generations and checksums differ in length")
                return p.Codes([t.commit(cid, k, g, now, c) for k, g, c in zip(keys, gens, sums, strict=True)])
            case p.Abort(client_id=cid, keys=keys, generations=gens):
                for k, g in zip(keys, gens, strict=True):
                    t.abort(cid, k, g)
                return p.Ok()
            case p.Corrupt(client_id=cid, keys=keys, generations=gens):
                for k, g in zip(keys, gens, strict=True):
                    dropped = t.corrupt(k, g, now)
                    logger.error("client %d read %r (generation %d) with a wrong checksum; %s", cid, k, g,
                                 "removed it from the pool" if dropped else "it was already gone")
                return p.Ok()
            case p.Validate(keys=keys, generations=gens):
                return p.Flags([t.validate(k, g) for k, g in zip(keys, gens, strict=True)])
            case p.Remove(keys=keys):
                return p.Codes([t.remove(k, now) for k in keys])
            case p.RemoveAll():
                return p.Codes([t.remove_all(now)])
            case p.RemovePrefix(prefix=prefix):
                if not prefix:
                    return p.Error(errors.INVALID_PARAM, "remove_by_prefix: the prefix is empty")
                return p.Codes([t.remove_prefix(prefix, now)])
            case p.Heartbeat(client_id=cid, journal_ack=ack):
                return self._heartbeat(cid, ack, now)
            case p.Join():
                return self._join(req, now)
            case p.Leave(client_id=cid):
                self._drop_member(cid, "left")
                return p.Ok()
            case p.GetSegments(segment_ids=ids):
                segs = t.segments
                wanted = ids or list(segs)
                return p.Segments([segs[i].info for i in wanted if i in segs])
            case p.ConfigPut(key=k, value=v):
                self.config_store[k] = v
                return p.Ok()
            case p.ConfigGet(key=k):
                return p.Value(self.config_store.get(k))
        return p.Error(errors.INVALID_PARAM, f"unsupported request {type(req).__name__}")

    # ---- membership -------------------------------------------------------------------------------

    def _issue_id(self, req: p.Join) -> int:
        """The id a joining member gets: the one it proposes when it is re-joining (so its segment id
        stays stable for peers that cached it), else a fresh one from the OS's random source. Ids
        are never drawn from ``random``: engines seed it the same way in every process."""
        cid = req.client_id
        old = self.members.get(cid)
        if old is not None and (old.host_id, old.pid) == (req.host_id, req.pid):
            return cid   # the same process re-joining
        if 0 < cid < 1 << 62 and old is None and cid not in self.table.segments:
            return cid   # a member of a previous MetaService (epoch) re-joining with its id
        while True:
            cid = secrets.randbits(62) or 1
            if cid not in self.members and cid not in self.table.segments:
                return cid

    def _join(self, req: p.Join, now: float) -> p.Reply:
        cid = self._issue_id(req)
        if cid in self.members:
            self._drop_member(cid, "re-joined")
        seg_id = None
        if req.segment is not None:
            seg_id = cid
            info = msgspec.structs.replace(req.segment, segment_id=cid)
            grace = now + RECOVERY_GRACE_S if req.objects else 0.0
            refused = self.table.add_segment(info, req.objects, alloc_after=grace)
            seg = self.table.segments[seg_id]
            for r in refused:   # tell the owner to forget objects that now mean something else
                seg.record_removed(r)
            logger.info("LocalService %d joined from %s pid %d: segment of %d bytes, %d objects recovered",
                        cid, req.host_id, req.pid, info.size, len(req.objects) - len(refused))
        else:
            logger.info("client %d joined from %s pid %d (no segment)", cid, req.host_id, req.pid)
        self.members[cid] = Member(cid, req.host_id, req.pid, seg_id, now)
        return p.Joined(cid, self.epoch, self.config.lease_ttl_ms, self.config.pending_timeout_ms)

    def _heartbeat(self, cid: int, ack: int, now: float) -> p.Reply:
        m = self.members.get(cid)
        if m is None:
            return p.HeartbeatReply(self.epoch, known=False)
        m.last_seen = now
        journal: list[p.JournalEntry] = []
        if m.segment_id is not None:
            journal = self.table.segments[m.segment_id].journal_since(ack)
        return p.HeartbeatReply(self.epoch, known=True, journal=journal)

    def _touch(self, cid: int, now: float) -> Member | None:
        m = self.members.get(cid)
        if m is not None:
            m.last_seen = now
        return m

    def _placement(self, member: Member | None, preferred: list[int]) -> list[int]:
        """Segment order for a new object: preferred ids, the writer's own segment, then most free."""
        segs = self.table.segments
        order: list[int] = []
        for c in preferred:
            m = self.members.get(c)
            if m is not None and m.segment_id is not None:
                order.append(m.segment_id)
        if member is not None and member.segment_id is not None:
            order.append(member.segment_id)
        order += sorted(segs, key=lambda s: segs[s].allocator.free, reverse=True)
        return list(dict.fromkeys(order))

    def _drop_member(self, cid: int, why: str) -> None:
        m = self.members.pop(cid, None)
        if m is None:
            return
        lost = self.table.drop_segment(m.segment_id) if m.segment_id is not None else 0
        self.table.reclaim(time.monotonic(), {cid})
        logger.info("client %d %s; %d objects left the pool with its segment", cid, why, lost)

    def housekeeping(self, now: float) -> None:
        dead_after = self.config.heartbeat_timeout_ms / 1000.0
        for cid in [c for c, m in self.members.items() if now - m.last_seen > dead_after]:
            self._drop_member(cid, f"missed heartbeats for {dead_after:g}s, declared dead")
        self.table.reclaim(now)
        self.table.evict_all(now)


def serve(config: MetaConfig, stop: threading.Event | None = None) -> None:
    """Run the MetaService until SIGTERM/SIGINT (or ``stop`` is set)."""
    core = MetaServiceCore(config)
    stop = stop or threading.Event()
    server = FrameServer([parse_url(config.meta_service_url, "meta_service_url", ("tcp",)),
                          parse_url(config.config_store_url, "config_store_url", ("tcp",))],
                         lambda body: _answer(core, body))
    admin = AdminServer(core, config.metrics_url)
    admin.start()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    logger.info("MetaService (pid %d, epoch %d) serving %s, config store %s, admin %s",
                os.getpid(), core.epoch, config.meta_service_url, config.config_store_url,
                config.metrics_url)
    interval = min(config.evict_check_interval_seconds, config.heartbeat_timeout_ms / 4000.0, 1.0)
    next_house = time.monotonic() + interval
    try:
        while not stop.is_set():
            server.poll(max(0.0, min(next_house - time.monotonic(), 0.2)))
            if time.monotonic() >= next_house:
                with core.lock:
                    core.housekeeping(time.monotonic())
                next_house = time.monotonic() + interval
    finally:
        admin.stop()
        server.close()
        logger.info("MetaService stopped")


def _answer(core: MetaServiceCore, payload: bytes) -> bytes:
    t0 = time.perf_counter()
    try:
        req = p.request_decoder.decode(payload)
    except Exception as e:  # noqa: BLE001 - a malformed message must not stop the service
        reply: p.Reply = p.Error(errors.INVALID_PARAM, f"malformed request: {e}")
        name = "malformed"
    else:
        name = type(req).__name__
    with core.lock:
        if name != "malformed":
            try:
                reply = core.handle(req)
            except errors.MemCacheError as e:
                reply = p.Error(e.code, str(e))
            except Exception as e:
                logger.exception("request %s failed", name)
                reply = p.Error(errors.ERROR, f"{type(e).__name__}: {e}")
        core.metrics.observe(name, time.perf_counter() - t0, failed=isinstance(reply, p.Error))
    return p.request_encoder.encode(reply)
