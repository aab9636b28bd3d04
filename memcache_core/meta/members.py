"""Membership of the MetaService: the member record and epoch, issuing ids, join (with the objects a
re-joining member reports), heartbeats (journal, served bytes, drain and repair flags) and dropping a
member that left or died. A mixin of ``MetaServiceCore`` (``service.py`` holds the state)."""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import secrets
import time

import msgspec

from .. import errors
from .. import protocol as p
from ..config import MetaConfig
from . import disk
from .drain import Drains
from .repair import Repairs
from .table import ObjectTable, Segment

logger = logging.getLogger(__name__)


def new_epoch() -> int:
    """A MetaService's epoch: random, so members tell a restarted (or newly elected) table apart."""
    return secrets.randbits(31) or 1


@dataclasses.dataclass
class Member:
    client_id: int
    host_id: str
    pid: int
    segment_id: int | None
    last_seen: float
    token: bytes = b""
    joined_with: bytes = b""   # the token its Join carried (of its previous session): the same Join sent again


class Membership:
    """Members joining, beating and leaving (a mixin; ``MetaServiceCore`` sets the state)."""

    config: MetaConfig
    epoch: int
    table: ObjectTable
    members: dict[int, Member]
    member_events: collections.Counter[str]
    served: dict[int, list[int]]
    drains: Drains
    repairs: Repairs

    def _member(self, cid: int, token: bytes, now: float) -> Member:
        m = self.members.get(cid)
        if m is None or not hmac.compare_digest(m.token, token):
            raise errors.NotAMember(f"client {cid} is not a member of this MetaService (epoch {self.epoch}); "
                                    f"it re-joins on its next heartbeat")
        m.last_seen = now
        return m

    def _issue_id(self, req: p.Join) -> int:
        """The id a joining member gets: the one it proposes when it is re-joining (so its segment id
        stays stable for peers that cached it), else a fresh one from the OS's random source. Ids
        are never drawn from ``random``: engines seed it the same way in every process."""
        cid = req.client_id
        old = self.members.get(cid)
        if old is not None and req.token and hmac.compare_digest(old.token, req.token):
            return cid   # the same member re-joining (it holds that id's token)
        if old is not None and req.token and hmac.compare_digest(old.joined_with, req.token):
            # the same Join again: its reply was lost (the member's call timed out), so the member
            # still holds the session it joined with. Another id would leave its objects with a
            # session that falls silent, and they would leave the pool with it.
            return cid
        if 0 < cid and old is None and cid not in self.table.segments:
            return cid   # a member of a previous MetaService (epoch) re-joining with its id
        while True:
            cid = secrets.randbits(62) or 1
            if cid not in self.members and cid not in self.table.segments:
                return cid

    def _join(self, req: p.Join, now: float) -> p.Reply:
        cid = self._issue_id(req)
        if cid not in self.members and len(self.members) >= self.config.max_members:
            return p.Error(errors.QUOTA_EXCEEDED, f"the MetaService holds max_members ({self.config.max_members}) "
                                                  f"members: no new one joins until one leaves or falls silent "
                                                  f"(heartbeat_timeout_ms); raise max_members for a larger pool")
        # generations issued from now on are above every one this member heard of (meta/generations.py)
        self.table.bump_generation(req.generation_ceiling)
        if cid in self.members:
            self._drop_member(cid, "re-joined")
        seg_id, fence = None, 0
        if req.segment is not None:
            seg_id = cid
            info = msgspec.structs.replace(req.segment, segment_id=cid)
            # Reads leased by a previous MetaService (or before this member was declared dead) may
            # still be copying out of the reported objects' neighbourhood: no new object goes into a
            # re-joined segment until such a lease would have ended. (Writers granted before this join, by
            # a previous MetaService or by this one, need no grace: each join has a fresh fence token,
            # and the owner's write fence refuses every other from its re-join on, fence.py.)
            grace = now + self.config.lease_ttl_ms / 1000.0 if req.objects or req.more else 0.0
            refused = self.table.add_segment(info, req.objects, alloc_after=grace,   # more: ``Report``s follow
                                             recovering=self.repairs.settling(now), now=now, more=req.more)
            seg = self.table.segments[seg_id]
            # this join's fence token: fresh at every join (fence.py); an owner of an older build fences by our epoch
            seg.fence = fence = seg.fence if req.fences else self.epoch
            seg.rotates = req.fences and req.rotates
            self._hold(seg, req.held)
            for r in refused:   # tell the owner to forget objects that now mean something else
                seg.record_removed(r)
            if req.objects:
                self.member_events["recoveries"] += 1
                self.member_events["recovered_objects"] += len(req.objects) - len(refused)
            if req.disk_objects:
                self.member_events["recovered_disk_objects"] += disk.add_reports(self.table, seg_id, req.disk_objects, now)
            logger.info("LocalService %d joined from %s pid %d: segment of %d bytes, %d objects recovered",
                        cid, req.host_id, req.pid, info.size, len(req.objects) - len(refused))
        else:
            logger.info("client %d joined from %s pid %d (no segment)", cid, req.host_id, req.pid)
        token = secrets.token_bytes(16)
        self.member_events["joins"] += 1
        self.members[cid] = Member(cid, req.host_id, req.pid, seg_id, now, token, req.token)
        return p.Joined(cid, self.epoch, self.config.lease_ttl_ms, self.config.pending_timeout_ms, token,
                        generation_ceiling=self.table.gen_ceiling, fence=fence)

    def _heartbeat(self, cid: int, token: bytes, ack: int, now: float, moved: list[p.SegmentBytes],
                   held: bool = False, fence: int = 0) -> p.Reply:
        m = self.members.get(cid)
        if m is None or not hmac.compare_digest(m.token, token):
            return p.HeartbeatReply(self.epoch, known=False)
        m.last_seen = now
        if m.segment_id is not None and (own := self.table.segments.get(m.segment_id)) is not None:
            self._hold(own, held)
            if own.rotate_to and fence == own.rotate_to and not held:
                self._rotated(own, fence)
        for r in moved:   # held for each segment's owner until its next heartbeat; totals for /metrics
            if r.segment_id in self.table.segments:
                counts = self.served.setdefault(r.segment_id, [0, 0, 0, 0])
                counts[0] += r.read
                counts[1] += r.written
                counts[2] += r.read
                counts[3] += r.written
        # (``get``, not ``events[...]``: a Counter's missing key costs a Python call, three a heartbeat)
        t, events, sid = self.table, self.member_events, m.segment_id
        reply = p.HeartbeatReply(self.epoch, known=True, disk_tiers=len(t.disk_tiers), generation_ceiling=t.gen_ceiling,
                                 departures=events.get("leaves", 0) + events.get("deaths", 0) + events.get("rejoins", 0))
        if sid is None:   # (a member without a segment: nothing else is its own)
            return reply
        reply.journal = t.segments[sid].journal_since(ack)
        mine = self.served.get(sid)
        if mine is not None and (mine[0] or mine[1]):
            reply.served, mine[0], mine[1] = mine[:2], 0, 0
        reply.drain = self.drains.draining(sid)
        reply.repair = self.repairs.wanted(sid)
        reply.rotate = t.segments[sid].rotate_to
        return reply

    def _rotated(self, seg: Segment, fence: int) -> None:
        """The owner rotated its fence as asked: no writer of a reclaimed grant can land any more, so
        grants carry the new token and the reclaimed ranges are free (``Segment.fence_out``)."""
        n = len(seg.fenced)
        freed = seg.rotated(fence)
        self.member_events["fence_rotations"] += 1
        logger.info("segment %d: its owner rotated the write fence; %d reclaimed ranges (%d bytes) are free",
                    seg.info.segment_id, n, freed)

    @staticmethod
    def _hold(seg: Segment, held: bool) -> None:
        """The owner says whether writes of an earlier join may still be in flight into its segment:
        while they may, nothing new is placed there (``Segment.takes_new``; local/hold.py)."""
        if held == seg.held:
            return
        seg.held = held
        if held:
            logger.warning("segment %d is held by its owner: writes granted before its join are still in flight "
                           "(a writer frozen mid-copy?); no new object goes there until they end", seg.info.segment_id)
        else:
            logger.info("segment %d: its owner's hold is over; it takes new objects", seg.info.segment_id)

    def _owner_gone(self, reporter: Member, sid: int, shm_path: str) -> None:
        """A member found the owner of ``sid`` dead through its own host's kernel (the segment file's
        owner lock is gone): drop that member now instead of a heartbeat timeout later, so no put is
        placed there meanwhile. Only a report from the segment's own host counts (this MetaService may
        run on another), and only about the file the segment has now (not a newer incarnation's)."""
        owner = self.members.get(sid)   # a segment's id is its owner's id
        seg = self.table.segments.get(sid)
        if owner is None or seg is None or owner is reporter:
            return
        if owner.host_id != reporter.host_id or seg.info.shm_path != shm_path:
            logger.warning("client %d reported the owner of segment %d dead, but it is not on that "
                           "segment's host or names another file (%r); ignored", reporter.client_id, sid, shm_path)
            return
        self._drop_member(sid, f"dead (member {reporter.client_id} on its host found its segment's owner lock gone)")

    def _drop_member(self, cid: int, why: str) -> None:
        m = self.members.pop(cid, None)
        if m is None:
            return
        if m.segment_id is not None:
            self.drains.segment_left(m.segment_id, time.monotonic())
            self.repairs.segment_left(m.segment_id, time.monotonic())
        self.member_events["leaves" if why == "left" else "deaths" if "dead" in why else "rejoins"] += 1
        lost = self.table.drop_segment(m.segment_id) if m.segment_id is not None else 0
        if m.segment_id is not None:
            self.served.pop(m.segment_id, None)
        self.table.reclaim(time.monotonic(), {cid})
        if why != "re-joined":                # (a re-joining member reports its objects next)
            self.repairs.plan(time.monotonic())   # the survivors learn it on their next heartbeat
        logger.info("client %d %s; %d objects left the pool with its segment", cid, why, lost)
