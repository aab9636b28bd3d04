"""What a heartbeat answers, through the MetaService's handler (``meta.server.answer``, real frames'
bodies): the member's own record only with its token, the byte counts it carries still validated,
the departures of other members counted (leaves, deaths, re-joins), and a quiet segment's journal
empty. The heartbeat path is kept lean (benchmarks/README.md, ``bench_heartbeat.py``); these are the
answers it must keep."""

from __future__ import annotations

import os

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.config import MetaConfig
from memcache_core.meta import server, service
from memcache_core.records import SegmentBytes


def _call(core: service.MetaServiceCore, req: p.Request) -> p.Reply:
    return p.reply_decoder.decode(server.answer(core, p.request_encoder.encode(req)))


def _join(core: service.MetaServiceCore, name: str, cid: int = 0, token: bytes = b"") -> p.Joined:
    seg = p.SegmentInfo(0, 1 << 30, name, f"/memcache-{os.getpid()}-{os.urandom(8).hex()}", "127.0.0.1:9")
    joined = _call(core, p.Join(cid, name, os.getpid(), seg, token=token))
    assert isinstance(joined, p.Joined), joined
    return joined


def _beat(core: service.MetaServiceCore, j: p.Joined, **kw: object) -> p.Reply:
    return _call(core, p.Heartbeat(j.client_id, j.token, **kw))   # type: ignore[arg-type]


def test_a_heartbeat_reports_departures_and_a_quiet_journal():
    """Scenario: three members; one leaves, one re-joins; the third hears each departure on its
    next heartbeat, and with nothing removed from its segment its journal stays empty."""
    core = service.MetaServiceCore(MetaConfig())
    a, b, c = (_join(core, n) for n in ("a", "b", "c"))
    r = _beat(core, c)
    assert isinstance(r, p.HeartbeatReply) and r.known and r.departures == 0 and r.journal == []
    assert r.meta_epoch == core.epoch and not r.drain and not r.repair and r.served == []
    assert isinstance(_call(core, p.Leave(a.client_id, a.token)), p.Ok)
    r = _beat(core, c)
    assert isinstance(r, p.HeartbeatReply) and r.departures == 1
    _join(core, "b", b.client_id, b.token)   # the same member re-joining: a departure for the others
    r = _beat(core, c)
    assert isinstance(r, p.HeartbeatReply) and r.departures == 2 and r.journal == []


def test_a_heartbeat_with_a_wrong_token_is_not_known_and_changes_nothing():
    """Scenario: a heartbeat naming a member with another token is answered ``known=False`` and does
    not keep that member alive."""
    core = service.MetaServiceCore(MetaConfig())
    j = _join(core, "a")
    seen = core.members[j.client_id].last_seen
    r = _call(core, p.Heartbeat(j.client_id, b"x" * len(j.token)))
    assert isinstance(r, p.HeartbeatReply) and not r.known
    assert core.members[j.client_id].last_seen == seen


def test_byte_counts_a_heartbeat_carries_are_still_validated():
    """Scenario: a heartbeat carrying a negative byte count is refused with -3000 naming the field,
    and the counts are not taken; a valid one is held for the segment's owner."""
    core = service.MetaServiceCore(MetaConfig())
    owner, reader = _join(core, "owner"), _join(core, "reader")
    r = _beat(core, reader, moved=[SegmentBytes(owner.client_id, -1, 0)])
    assert isinstance(r, p.Error) and r.code == errors.INVALID_PARAM and "moved.read" in r.message
    assert core.served.get(owner.client_id) is None
    assert isinstance(_beat(core, reader, moved=[SegmentBytes(owner.client_id, 4096, 0)]), p.HeartbeatReply)
    r = _beat(core, owner)
    assert isinstance(r, p.HeartbeatReply) and r.served == [4096, 0]


def test_a_rejoin_sent_again_after_its_reply_was_lost_keeps_the_members_id_and_objects():
    """Scenario: after a failover a member re-joins the new leader with the id and token it had and
    the objects of its segment, and the reply is lost (its call timed out, the leader was slow). Its
    next heartbeat, still with the old session, is not known, so it sends the same re-join again.
    That join is the same member's: it keeps its id, and its objects stay in the pool. (It used to
    get a new id; its reports were refused as copies of objects the pool already held, and when the
    first session fell silent the objects left the pool with it: acknowledged writes lost.)"""
    core = service.MetaServiceCore(MetaConfig())
    old_id, old_token = 0x5EED, os.urandom(16)   # issued by the previous leader
    seg = p.SegmentInfo(0, 1 << 30, "h", f"/memcache-{os.getpid()}-{os.urandom(8).hex()}", "127.0.0.1:9")
    objects = [p.ObjectReport(f"k{i}", i << 20, 4096, 1 + i) for i in range(4)]

    def rejoin() -> p.Joined:
        j = _call(core, p.Join(old_id, "h", os.getpid(), seg, objects, old_token, generation_ceiling=10))
        assert isinstance(j, p.Joined), j
        return j

    first = rejoin()             # its reply never reached the member
    r = _call(core, p.Heartbeat(old_id, old_token))
    assert isinstance(r, p.HeartbeatReply) and not r.known
    second = rejoin()
    assert second.client_id == first.client_id == old_id
    assert list(core.table.segments) == [old_id]
    assert {k: [loc.segment_id for loc in core.table.objects[k].locations] for k in ("k0", "k1", "k2", "k3")} \
        == {k: [old_id] for k in ("k0", "k1", "k2", "k3")}
    assert isinstance(_beat(core, first), p.HeartbeatReply) and not _beat(core, first).known  # type: ignore[union-attr]
    assert _beat(core, second).known  # type: ignore[union-attr]
    # a join naming the id with some other token is not that member: it gets an id of its own
    assert _call(core, p.Join(old_id, "h", os.getpid(), None, [], os.urandom(16))).client_id != old_id  # type: ignore[union-attr]
