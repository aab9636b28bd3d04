"""A reclaimed grant is void before its space is granted again (docs/design.md, "Cleanup of
half-written objects"): the MetaService's side (the range fenced out, the rotation asked for on the
owner's heartbeat, the range freed once the owner reports the new token; ``meta.server.answer``, real
frames' bodies) and the owner's (``local/hold.py``: the fence rotated as before a join, held while a
write of the old token is in flight), through one real segment file mapped twice as two processes do."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest

from memcache_core import protocol as p
from memcache_core.config import MetaConfig
from memcache_core.fence import StaleGrant
from memcache_core.layout import footprint
from memcache_core.local.hold import Hold
from memcache_core.memory import Mapping
from memcache_core.meta import server, service
from memcache_core.testing import wait_for

SIZE = 1 << 20


def _call(core: service.MetaServiceCore, req: p.Request) -> p.Reply:
    return p.reply_decoder.decode(server.answer(core, p.request_encoder.encode(req)))


def _core() -> service.MetaServiceCore:
    return service.MetaServiceCore(MetaConfig(pending_timeout_ms=1000, heartbeat_timeout_ms=3_600_000))


def _join(core: service.MetaServiceCore, rotates: bool = True, cid: int = 0, token: bytes = b"") -> p.Joined:
    seg = p.SegmentInfo(0, 4 * footprint(SIZE), "host-a", f"/memcache-{os.getpid()}-{os.urandom(8).hex()}",
                        "127.0.0.1:9")
    joined = _call(core, p.Join(cid, "host-a", os.getpid(), seg, token=token, fences=True, rotates=rotates))
    assert isinstance(joined, p.Joined), joined
    return joined


def _alloc(core: service.MetaServiceCore, w: p.Joined, key: str, at: int) -> p.AllocResult:
    a = _call(core, p.Alloc(w.client_id, w.token, [key], [SIZE], 1, [at]))
    assert isinstance(a, p.AllocReply) and a.results[0].code == 0, a
    return a.results[0]


def _beat(core: service.MetaServiceCore, j: p.Joined, fence: int = 0, held: bool = False) -> p.HeartbeatReply:
    r = _call(core, p.Heartbeat(j.client_id, j.token, held=held, fence=fence or j.fence))
    assert isinstance(r, p.HeartbeatReply) and r.known, r
    return r


def test_a_reclaimed_range_is_granted_again_only_under_the_token_its_owner_rotated_to():
    """Scenario: W is granted ``old`` in P and falls silent past the pending deadline; the range is
    reclaimed but not given to ``new`` (placed beside it, still under P's token), and P's heartbeat asks
    for a rotation. A heartbeat reporting another token, or the new one while held, frees nothing; the
    new token reported: grants carry it, and ``later`` may take the reclaimed range."""
    core = _core()
    p_ = _join(core)
    w = _join(core, rotates=False)   # (a pure client's segment is not used: its own rotations don't matter)
    old = _alloc(core, w, "old", p_.client_id)
    assert _beat(core, p_).rotate == 0                           # nothing reclaimed: nothing to rotate
    core.housekeeping(time.monotonic() + 2.0)                    # past old's deadline: reclaimed
    asked = _beat(core, p_).rotate
    assert asked not in (0, p_.fence)
    new = _alloc(core, w, "new", p_.client_id)
    assert new.fences == [p_.fence] and new.locations[0].offset != old.locations[0].offset
    assert _beat(core, p_, fence=p_.fence).rotate == asked      # asked again until it is done
    assert _beat(core, p_, fence=asked, held=True).rotate == asked   # held: writes of the old token in flight
    _beat(core, p_, fence=asked)
    assert core.stats().events.get("fence_rotations") == 1
    seg = core.table.segments[p_.client_id]
    assert seg.fence == asked and seg.rotate_to == 0 and seg.fenced == []
    later = [_alloc(core, w, f"later-{i}", p_.client_id) for i in range(3)]
    assert all(r.fences == [asked] for r in later)
    assert old.locations[0].offset in [r.locations[0].offset for r in later]


def test_an_owner_that_cannot_rotate_keeps_a_reclaimed_range_out_of_use_until_it_rejoins():
    """Scenario: P of an older build (no ``Join.rotates``) is never asked to rotate; the range
    reclaimed in it stays out of use (the segment fills up around it), however long; P's re-join (its
    fence drained, a new token) gives the space back."""
    core = _core()
    p_ = _join(core, rotates=False)
    w = _join(core, rotates=False)
    old = _alloc(core, w, "old", p_.client_id)
    core.housekeeping(time.monotonic() + 2.0)
    core.housekeeping(time.monotonic() + 3000.0)   # (members are not declared dead: a long timeout)
    assert _beat(core, p_).rotate == 0
    seg = core.table.segments[p_.client_id]
    assert seg.fenced == [(old.locations[0].offset, footprint(SIZE))]
    assert old.locations[0].offset not in [_alloc(core, w, f"k{i}", p_.client_id).locations[0].offset
                                           for i in range(3)]
    again = _join(core, rotates=False, cid=p_.client_id, token=p_.token)
    assert core.table.segments[again.client_id].fenced == []
    assert core.table.segments[again.client_id].allocator.used == 0


def test_an_owner_that_never_confirms_takes_its_segment_along_when_it_is_declared_dead():
    """Scenario: P is asked to rotate and never answers (dead, or frozen past the heartbeat timeout):
    declared dead, its segment leaves the pool with the range; when it answers again its re-join (a
    new token, its fence drained) starts with nothing fenced and nothing asked."""
    core = _core()
    p_ = _join(core)
    w = _join(core, rotates=False)
    _alloc(core, w, "old", p_.client_id)
    core.housekeeping(time.monotonic() + 2.0)
    assert _beat(core, p_).rotate != 0
    core._drop_member(p_.client_id, "missed heartbeats for 1.5s, declared dead")
    assert p_.client_id not in core.table.segments
    again = _join(core, cid=p_.client_id)
    seg = core.table.segments[again.client_id]
    assert seg.fenced == [] and seg.rotate_to == 0 and seg.allocator.used == 0 and seg.fence == again.fence
    assert _beat(core, again).rotate == 0


def _hold(owner: Mapping, wait_s: float) -> tuple[Hold, threading.Lock, threading.Event, threading.Event]:
    join_lock, stop, beat = threading.Lock(), threading.Event(), threading.Event()
    hold = Hold(owner.fence, wait_s, join_lock, stop, beat)
    hold.open(5)
    return hold, join_lock, stop, beat


def test_the_owner_rotates_its_fence_and_a_writer_of_the_old_token_is_refused(pair):
    """Scenario: nothing in flight: the rotation to 7 is done at once (reported, the heartbeat woken);
    a writer of the old token 5 is refused, one of 7 lands."""
    owner, peer = pair
    hold, _, stop, beat = _hold(owner, 1.0)
    assert hold.open_to == 5
    hold.rotate(7)
    wait_for(lambda: hold.open_to == 7 and beat.is_set(), 5, "the rotation")
    assert owner.fence.epoch == 7 and not hold.held
    with pytest.raises(StaleGrant):
        peer.fence.enter(5)
    with peer.fence.writing(7):
        pass
    hold.rotate(7)                # asked again (the next heartbeat's reply): nothing more to do
    stop.set()


def test_a_write_of_the_old_token_in_flight_holds_the_rotation_until_it_ends(pair):
    """Scenario: a writer of token 5 is frozen mid-copy when the rotation to 7 is asked: the owner waits
    ``wait_s``, then is held (the fence 0, nothing reported: its reclaimed space stays out of use).
    Once the writer ends, the fence opens to 7 and the heartbeat reports it."""
    owner, peer = pair
    hold, _, stop, beat = _hold(owner, 0.2)
    peer.fence.enter(5)
    try:
        hold.rotate(7)
        wait_for(lambda: hold.held and beat.is_set(), 5, "the rotation to be held (and said at once)")
        assert hold.open_to == 0 and owner.fence.epoch == 0
        beat.clear()
        assert not beat.wait(0.3) and hold.held
    finally:
        peer.fence.leave()
    wait_for(lambda: not hold.held, 5, "the hold to end once the write ended")
    assert hold.open_to == 7 and owner.fence.epoch == 7 and beat.is_set()
    stop.set()


def test_a_rejoin_before_the_rotation_ran_keeps_the_joins_token(pair):
    """Scenario: the rotation to 7 is asked while a re-join holds the join lock and opens the fence to
    9 (a new MetaService life): the rotation, asked of the previous join, does nothing."""
    owner, _ = pair
    hold, join_lock, stop, _ = _hold(owner, 1.0)
    with join_lock:
        hold.rotate(7)
        hold.close()
        hold.open(9)
    assert hold._rotator is not None
    hold._rotator.join(5)
    assert hold.open_to == 9 and owner.fence.epoch == 9
    stop.set()


def test_the_rotation_rides_the_heartbeat_and_peers_of_older_builds_decode_it():
    """``Join.rotates``, ``Heartbeat.fence`` and ``HeartbeatReply.rotate`` round-trip; a message of an older
    build (no such field) decodes to none (never asked, never confirmed), and one with the field decodes
    in an older build's reader (an unknown field of a map-like message is ignored)."""
    beat = p.Heartbeat(3, b"t", 0, [], False, 777)
    assert p.request_decoder.decode(p.request_encoder.encode(beat)) == beat
    reply = p.HeartbeatReply(11, True, rotate=888)
    assert p.reply_decoder.decode(msgspec.msgpack.encode(reply)) == reply
    assert msgspec.msgpack.decode(p.request_encoder.encode(p.Join(0, "h", 1)), type=p.Join).rotates is False

    class Heartbeat(msgspec.Struct, tag=True):   # an older build's
        client_id: int
        token: bytes
        journal_ack: int = 0
        held: bool = False

    class HeartbeatReply(msgspec.Struct, tag=True, kw_only=True):
        meta_epoch: int
        known: bool
        term: int = 0

    assert msgspec.msgpack.decode(p.request_encoder.encode(beat), type=Heartbeat) == Heartbeat(3, b"t", 0, False)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=HeartbeatReply).known
    wire = msgspec.msgpack.encode(HeartbeatReply(meta_epoch=11, known=True))
    assert msgspec.msgpack.decode(wire, type=p.HeartbeatReply).rotate == 0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Heartbeat(3, b"t")), type=p.Heartbeat).fence == 0
