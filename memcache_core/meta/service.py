"""The MetaService's state and request handling (``MetaServiceCore``); the serving loop around it,
one thread serving the control plane and one serving HTTP admin, is ``server.py`` (``serve``), which
sits above this module: nothing here imports it back.

It never touches payload bytes. State lives in memory only; after a restart the LocalServices
re-join and report the objects in their segments (see ``ObjectTable.add_segment``).
"""

from __future__ import annotations

import collections
import logging
import math
import random
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import errors
from .. import protocol as p
from ..config import MetaConfig
from . import arena, disk, generations, gva, placement, stats, validate
from .drain import Drains
from .events import EventPublisher, load_curve
from .members import Member, Membership, new_epoch
from .metadata import Metadata
from .metrics import Metrics
from .objects import PENDING_LEASE
from .repair import Repairs
from .replay import ReplayLimits
from .table import Obj, ObjectTable

logger = logging.getLogger(__name__)

REFUSED = p.AllocResult(errors.QUOTA_EXCEEDED, 0, [])   # an Alloc past the member's quota (one shared reply)


class MetaServiceCore(Membership):
    """Request handling and housekeeping; the socket loop is in ``serve``."""

    def __init__(self, config: MetaConfig) -> None:
        self.config = config
        self.publisher: EventPublisher | None = None
        if config.kv_events_enable:
            curve = (load_curve(config.zmq_curve_server_key_file, config.zmq_curve_client_keys_dir)
                     if config.zmq_enable_curve else None)
            limits = ReplayLimits(config.kv_events_replay_requests_per_second,
                                  config.kv_events_replay_bytes_per_second,
                                  config.kv_events_replay_min_interval_ms / 1000.0)
            self.publisher = EventPublisher(config.kv_events_endpoint, config.kv_events_model_name,
                                            config.kv_events_block_size, config.kv_events_queue_size,
                                            config.kv_events_replay_endpoint, config.kv_events_buffer_steps, curve,
                                            limits)
        self.epoch = new_epoch()
        self.table = self.fresh_table()
        self.members: dict[int, Member] = {}
        self.config_store: dict[str, bytes] = {}
        self.config_store_bytes = 0
        self.metrics = Metrics()
        settle_s = config.heartbeat_timeout_ms / 1000.0   # how long members may take to re-join a new table
        self.drains = Drains(lambda: self.table, config.drain_timeout_ms / 1000.0,
                             config.pending_timeout_ms / 1000.0, self._answering, settle_s, time.monotonic() + settle_s)
        self.repairs = Repairs(lambda: self.table, config.pending_timeout_ms / 1000.0, self._answering,
                               self.drains.draining, settle_s, time.monotonic() + settle_s, config.repair_enable)
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()   # (op, outcome)
        self.member_events: collections.Counter[str] = collections.Counter()
        self.http_calls: collections.Counter[str] = collections.Counter()   # admin routes counted (get_all_keys)
        self.metadata = Metadata()   # the admin route /metadata (an operator's tools' own values)
        # segment -> [read, written] not yet told its owner, [read, written] since it joined (shm copies)
        self.served: dict[int, list[int]] = {}
        self.history = stats.History(config.stats_sample_interval_seconds)
        self.lock = threading.Lock()   # the HTTP thread reads under it
        self.answered = 0              # requests answered but heartbeats (the serving loop polls on after one)
        self.started = time.monotonic()
        self.ha: Any = None            # the LeaderElection with ha_enable (meta/ha.py)
        self.rng = random.Random(secrets.randbits(64))   # placement's randomness, never the app's seed

    def fresh_table(self) -> ObjectTable:
        """An empty table with this config (at start, and for a new HA leader's reset)."""
        c = self.config
        table = ObjectTable(c.evict_threshold_high, c.evict_threshold_low, c.lease_ttl_ms / 1000.0,
                            c.pending_timeout_ms / 1000.0, generations.clock_floor())
        table.member_quota = (c.member_max_objects, c.member_max_bytes)   # recovered objects count in it
        if self.publisher is not None:
            self.publisher.offer_cleared()   # subscribers forget what an earlier table told them
            table.listener = self._kv_event
        return table

    def _kv_event(self, stored: bool, obj: Obj, locations: Sequence[p.Location]) -> None:
        assert self.publisher is not None
        for loc in locations:
            seg = self.table.segments.get(loc.segment_id)
            self.publisher.offer(stored, obj.key, seg.info.host_id if seg else "", loc.segment_id)

    def stats(self) -> stats.Snapshot:
        """The numbers every view renders, copied under the lock (rendering happens outside it): a pass
        over the segments and members, never over the objects."""
        with self.lock:
            now = time.monotonic()
            t = self.table
            owners = {m.segment_id: m.pid for m in self.members.values() if m.segment_id is not None}
            segments = [stats.SegmentStats(i, s.info.host_id, s.info.tag, s.info.data_addr, s.info.metrics_addr,
                                           self.served.get(i, [0, 0, 0, 0])[2], self.served.get(i, [0, 0, 0, 0])[3],
                                           owners.get(i), "dram",
                                           s.allocator.size, s.allocator.used, len(s.lru), s.allocator.largest_free,
                                           None if math.isinf(s.alloc_after) else round(max(0.0, s.alloc_after - now), 3),
                                           math.isinf(s.alloc_after), s.arena.reserved if s.arena else 0, s.held,
                                           sum(n for _, n in s.fenced))
                        for i, s in sorted(t.segments.items())]
            members = [stats.MemberStats(m.client_id, m.host_id, m.pid, m.segment_id, round(now - m.last_seen, 3),
                                         *t.kept_of.get(m.client_id, (0, 0)))
                       for m in sorted(self.members.values(), key=lambda m: m.client_id)]
            c = t.counters
            outcomes: dict[str, dict[str, int]] = {}
            for (op, outcome), n in self.outcomes.items():
                outcomes.setdefault(op, {})[outcome] = n
            requests = [stats.RequestStats(op, list(h.counts), h.total, h.count, h.failures)
                        for op, h in sorted(self.metrics.requests.items())]
            events = dict(self.member_events)
            if self.publisher is not None:
                events["kv_events_published"] = self.publisher.published
                events["kv_events_dropped"] = self.publisher.dropped
                events["kv_events_published_stored"] = self.publisher.published_stored
                events["kv_events_published_cleared"] = self.publisher.by_type["AllBlocksCleared"]
                events["kv_events_dropped_stored"] = self.publisher.dropped_stored
                events["kv_events_replays"], events["kv_events_replay_dropped"] = self.publisher.replay_counts()
            events.update({f"http_{k}": n for k, n in self.http_calls.items()})
            disk_tiers = [stats.DiskTierStats(sid, d.policy, d.capacity, d.used, d.counters.get("objects", 0),
                                              dict(d.counters))
                          for sid, d in sorted(t.disk_tiers.items())]
            leading = self.ha is None or self.ha.serving()
            term = self.ha.term if self.ha is not None and leading else 0
            return stats.Snapshot(time.time(), round(now - self.started, 3), self.epoch,
                                  "leader" if leading else "standby", term, members, segments,
                                  len(t.objects) - t.pending, t.pending, t.under_replicated,
                                  {**self.drains.stats(), **self.repairs.stats()},
                                  {k: getattr(c, k) for k in c.__dataclass_fields__}, outcomes, events,
                                  requests, list(self.history.samples), disk_tiers, self.drains.in_progress(now),
                                  self.history.interval_s)

    # ---- dispatch ---------------------------------------------------------------------------------

    def handle(self, req: p.Request) -> p.Reply:
        now = time.monotonic()
        t = self.table
        match req:
            case p.Exist(keys=keys):   # keys checked by the decoder (protocol.Keys)
                t.counters.exists += len(keys)
                objs = t.objects   # ObjectTable.exists inlined: this is the hottest request
                return p.Flags([o is not None and o.lease_until is not PENDING_LEASE for o in map(objs.get, keys)])
            case p.Lookup(keys=keys, lease=lease):
                return p.LookupReply(t.lookup_many(keys, now, lease), self.config.lease_ttl_ms)
            case p.Heartbeat(client_id=cid, token=token, journal_ack=ack, moved=moved, held=held, fence=fence):
                if moved:   # (most heartbeats carry no byte counts)
                    validate.moved(moved)
                return self._heartbeat(cid, token, ack, now, moved, held, fence)
            case p.Join():
                validate.join(req)
                return self._join(req, now)
            case p.Validate(keys=keys, generations=gens):
                validate.batch(keys, gens)
                return p.Flags([t.validate(k, g) for k, g in zip(keys, gens, strict=True)])
            case p.Remove(keys=keys):
                validate.batch(keys)
                return t.removing(lambda: [t.remove(k, now) for k in keys], self.epoch)
            case p.RemovePrefix(prefix=prefix):
                if not prefix:
                    return p.Error(errors.INVALID_PARAM, "remove_by_prefix: the prefix is empty")
                return t.removing(lambda: [t.remove_prefix(prefix, now)], self.epoch)
            case p.RemoveAll():
                return t.removing(lambda: [t.remove_all(now)], self.epoch)
            case p.Confirmed(epoch=epoch, journal=journal):
                validate.confirmed(journal)
                if epoch != self.epoch:
                    return p.Error(errors.META_NOT_CONNECTED, f"the MetaService restarted (epoch {self.epoch}, "
                                                             f"not {epoch}) before the owners confirmed a remove")
                return p.Flags([t.confirmed(*j) for j in journal])
            case p.Demote(keys=keys):
                validate.batch(keys)
                return p.Codes(disk.demote(t, keys, now))
            case p.GetSegments(segment_ids=ids):
                segs = t.segments
                wanted = ids or list(segs)
                return p.Segments([segs[i].info for i in wanted if i in segs])
            case p.ConfigPut(key=k, value=v):
                return self._config_put(k, v)
            case p.ConfigGet(key=k):
                return p.Value(self.config_store.get(k))
            case (p.Alloc() | p.Commit() | p.ArenaCommit() | p.Abort() | p.OwnerGone() | p.Corrupt() | p.Leave() | p.DrainNext()
                  | p.DrainDone() | p.RepairNext() | p.RepairDone() | p.Info() | p.Lease() | p.Grant() | p.Report()):
                return self._member_request(req, self._member(req.client_id, req.token, now), now)
            case p.DiskSync() | p.Promote() | p.Promoted():
                return self._disk_request(req, self._member(req.client_id, req.token, now), now)
        return p.Error(errors.INVALID_PARAM, f"unsupported request {type(req).__name__}")

    def _granted(self, code: int, gen: int, locs: list[p.Location]) -> p.AllocResult:
        """An Alloc's result; space granted carries its segments' join tokens (fence.py)."""
        if code != errors.SUCCESS:
            return p.AllocResult(code, gen, locs)
        return p.AllocResult(code, gen, locs, [self.table.segments[loc.segment_id].fence for loc in locs])

    def _member_request(self, req: p.Request, member: Member, now: float) -> p.Reply:
        """Requests that act as a member: only with that member's token (issued at Join)."""
        t, cid = self.table, member.client_id
        match req:
            case p.Alloc(keys=keys, sizes=sizes, replicas=replicas, preferred=preferred):
                validate.alloc(req)
                pref = self._preferred(preferred)
                policy, own, segs, rng = self.config.placement_policy, member.segment_id, t.segments, self.rng
                return p.AllocReply([self._granted(*t.alloc(cid, k, s, replicas,
                                                            placement.order(policy, segs, own, rng), now, pref))
                                     if self._within_quota(cid, s, replicas, now) else REFUSED
                                     for k, s in zip(keys, sizes, strict=True)])
            case p.Commit(keys=keys, generations=gens, checksums=sums):
                sums = sums or [0] * len(keys)
                validate.batch(keys, gens, sums)
                validate.generations(gens)
                validate.checksums(sums)
                return p.Codes([t.commit(cid, k, g, now, c) for k, g, c in zip(keys, gens, sums, strict=True)])
            case p.ArenaCommit():
                validate.arena_commit(req)
                # arenas put small objects in the writer's own segment: what local_first does anyway
                size = self.config.arena_bytes if self.config.placement_policy == "local_first" else 0
                return arena.commit(t, member.segment_id, req, now, size,
                                    lambda n: self._within_quota(cid, n, 1, now))
            case p.Abort(keys=keys, generations=gens):
                validate.batch(keys, gens)
                for k, g in zip(keys, gens, strict=True):
                    t.abort(cid, k, g)
                return p.Ok()
            case p.OwnerGone(segment_id=gone, shm_path=path):
                self._owner_gone(member, gone, path)
                return p.Ok()
            case p.Corrupt(keys=keys, generations=gens):
                validate.corrupt(req)
                sids: list[int | None] = list(req.segments) or [None] * len(keys)
                for k, g, sid in zip(keys, gens, sids, strict=True):
                    dropped = t.corrupt(k, g, now, sid)
                    logger.error("client %d read %r (generation %d) with a wrong checksum in segment %s; %s",
                                 cid, k, g, sid, "dropped that copy (the object, if it was the last)" if dropped else "it was already gone")
                return p.Ok()
            case p.Info(keys=keys):
                validate.batch(keys)
                return gva.info(t, cid, keys)
            case p.Lease(keys=keys, generations=gens, ttl_ms=ttl_ms):
                validate.batch(keys, gens)
                validate.generations(gens)
                validate.timeout_ms(ttl_ms)
                if ttl_ms == 0:
                    return p.Codes(gva.remove_lease(t, cid, keys))
                longest = max(self.config.gva_lease_max_ms, self.config.lease_ttl_ms)   # leasing again renews
                return p.Codes(gva.add_lease(t, cid, keys, gens, min(ttl_ms, longest) / 1000.0, now,
                                             self.config.member_max_leases))
            case p.Grant():
                validate.grant(req)
                return gva.grant(t, cid, req, now)
            case p.Report():
                return self._report(req, member, now)
            case p.Leave():
                self._drop_member(cid, "left")
                return p.Ok()
            case p.DrainNext() | p.DrainDone():
                return self.drains.handle(req, member.segment_id, now)
            case p.RepairNext() | p.RepairDone():
                return self.repairs.handle(req, member.segment_id, now)
        return p.Error(errors.INVALID_PARAM, f"unsupported request {type(req).__name__}")

    def _report(self, req: p.Report, member: Member, now: float) -> p.Reply:
        """More objects of the member's re-joining segment (``Join.more``; ``meta/reports.py``): one
        bounded batch per request, so a segment of millions of objects never holds the loop long."""
        t, sid = self.table, member.segment_id
        seg = t.segments.get(sid) if sid is not None else None
        if sid is None or seg is None or sid not in t.reporting:
            return p.Error(errors.INVALID_PARAM, f"client {member.client_id}: Report without a Join announcing "
                                                 f"more reports (or after its last one)")
        validate.reports(req.objects, seg.info.size)
        validate.disk_reports(req.disk_objects)
        refused = t.report(sid, req.objects, req.last, now)
        for r in refused:   # tell the owner to forget objects that now mean something else
            seg.record_removed(r)
        self.member_events["recovered_objects"] += len(req.objects) - len(refused)
        if req.disk_objects:
            self.member_events["recovered_disk_objects"] += disk.add_reports(t, sid, req.disk_objects, now)
        if req.last:
            logger.info("LocalService %d reported the last of its segment's objects", member.client_id)
        return p.Ok()

    def _disk_request(self, req: p.Request, member: Member, now: float) -> p.Reply:
        """Requests of a provider's disk tier (meta/disk.py); only a member with a segment has one."""
        sid, t = member.segment_id, self.table
        if sid is None:
            return p.Error(errors.INVALID_PARAM, "only a LocalService with a segment has a disk tier")
        match req:
            case p.DiskSync():
                validate.disk_sync(req)
                return disk.sync(t, sid, req, now)
            case p.Promote(keys=keys):
                validate.batch(keys)
                return p.AllocReply(disk.promote(t, sid, keys, now))
            case p.Promoted(keys=keys, offsets=offsets, ok=ok):
                validate.batch(keys, offsets, ok)
                return p.Codes(disk.promoted(t, sid, req, now))
        return p.Error(errors.INVALID_PARAM, f"unsupported request {type(req).__name__}")

    def _config_put(self, key: str, value: bytes) -> p.Reply:
        cfg = self.config
        if len(key) > 1024 or len(value) > cfg.config_store_max_value_bytes:
            return p.Error(errors.INVALID_PARAM, f"config store: key or value too large (value at most "
                                                 f"{cfg.config_store_max_value_bytes} bytes)")
        old = self.config_store.get(key)
        grow = len(key) + len(value) - (len(key) + len(old) if old is not None else 0)
        if self.config_store_bytes + grow > cfg.config_store_max_total_bytes:
            return p.Error(errors.OUT_OF_MEMORY, "config store is full (config_store_max_total_bytes)")
        if self.ha is not None:
            self.ha.store_config(key, value)   # HA: the store lives in etcd, so it survives failover
        self.config_store[key] = value
        self.config_store_bytes += grow
        return p.Ok()

    # ---- membership -------------------------------------------------------------------------------

    def _within_quota(self, cid: int, size: int, replicas: int, now: float) -> bool:
        """May this member allocate one more object of ``size`` payload bytes? Its puts in flight are
        bounded (a pending object cannot be evicted, so they are what a member can pin), and so is what
        it keeps: its committed objects plus those in flight (``member_max_objects`` / ``_bytes``). At
        that quota its own least recently used objects are evicted to make room, as in a full pool;
        when none can be (leased by itself, or all in flight), the Alloc is refused."""
        c, t = self.config, self.table
        objects, held = t.pending_of.get(cid, (0, 0))
        if objects >= c.member_max_pending_objects or (c.member_max_pending_bytes
                                                      and held + size * replicas > c.member_max_pending_bytes):
            return False
        if (c.member_max_objects and objects >= c.member_max_objects) or (c.member_max_bytes
                                                                           and held + size > c.member_max_bytes):
            return False   # (pending bytes count replicas; kept bytes do not: ``held`` bounds the payload)
        while True:   # objects another member leases count against the leaser (kept.py), not here
            kept, kept_bytes = t.quota_kept(cid)
            over = ((c.member_max_objects and kept + objects >= c.member_max_objects)
                    or (c.member_max_bytes and kept_bytes + held + size > c.member_max_bytes))
            if not over:
                return True
            if not t.evict_own(cid, now):
                return False

    def _preferred(self, preferred: list[int]) -> list[int]:
        """The segments of the writer's preferred members (``preferredLocalServiceIDs``): tried first."""
        ms = (self.members.get(c) for c in preferred)
        return [m.segment_id for m in ms if m is not None and m.segment_id is not None]

    def _answering(self, segment_id: int, now: float) -> bool:
        """Has the segment's owner been heard from within half the heartbeat timeout?"""
        m = self.members.get(segment_id)   # a segment's id is its owner's id
        return m is not None and now - m.last_seen <= self.config.heartbeat_timeout_ms / 2000.0

    def housekeeping(self, now: float) -> None:
        dead_after = self.config.heartbeat_timeout_ms / 1000.0
        for cid in [c for c, m in self.members.items() if now - m.last_seen > dead_after]:
            self._drop_member(cid, f"missed heartbeats for {dead_after:g}s, declared dead")
        self.table.reclaim(now)
        gva.expire(self.table, now)
        disk.housekeeping(self.table, now)
        self.table.evict_all(now)
        self.drains.housekeeping(now)
        self.repairs.housekeeping(now)
        self.history.record(self.table, now)
