"""The write fence of a segment (``memcache_core/fence.py``): the owner's side (``move``) and a writer's
(``writing``), each through its own mapping of one real segment file, as two processes hold it (each
mapping takes its locks through its own open file description, so they conflict as across processes)."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from memcache_core import protocol as p
from memcache_core.errors import InvalidParameter
from memcache_core.fence import MAX_TOKEN, StaleGrant, new_token, tokens
from memcache_core.local.hold import Hold
from memcache_core.memory import Mapping
from memcache_core.testing import wait_for


def close_and_say(owner: Mapping, moved: threading.Event) -> None:
    owner.fence.move(0)
    moved.set()


def test_a_write_lands_only_under_the_owners_epoch(pair):
    """Scenario: the owner is joined to epoch 5. A write granted in 5 proceeds, one granted in 6 (or in
    4) is refused before it starts; an unfenced write (epoch 0: reads, tools) is never refused."""
    owner, peer = pair
    owner.fence.move(5)
    with peer.fence.writing(5):
        pass
    for stale in (4, 6):
        with pytest.raises(StaleGrant, match=f"granted under fence token {stale}"):
            with peer.fence.writing(stale):
                pytest.fail("a write of another epoch started")
    with peer.fence.writing(0):
        pass


def test_the_owners_rejoin_waits_for_the_writes_in_flight(pair):
    """Scenario: a writer of epoch 5 is in the middle of its copy when the owner starts re-joining
    (``move(0)``). The owner's move returns only once that copy ended; a write of epoch 5 starting
    after it is refused (the owner is joined to 9 by then)."""
    owner, peer = pair
    owner.fence.move(5)
    peer.fence.enter(5)
    moved = threading.Event()
    t = threading.Thread(target=close_and_say, args=(owner, moved))
    t.start()
    try:
        wait_for(lambda: owner.fence.epoch == 0, 5, "the owner to close the fence")
        assert not moved.wait(0.3)   # the copy is still in flight: the owner waits for it
    finally:
        peer.fence.leave()
    wait_for(moved.is_set, 5, "the owner's move to return once the copy ended")
    t.join()
    owner.fence.move(9)
    with pytest.raises(StaleGrant):
        peer.fence.enter(5)


def test_a_writer_waits_for_a_rejoin_in_progress(pair):
    """Scenario: the owner closed its fence to re-join (0); a write granted by the new MetaService
    (its Joined reply raced ahead of the owner's) waits until the owner opens the fence to that epoch."""
    owner, peer = pair
    owner.fence.move(0)
    entered = threading.Event()

    def write() -> None:
        with peer.fence.writing(7):
            entered.set()

    t = threading.Thread(target=write)
    t.start()
    owner.fence.move(7)
    wait_for(entered.is_set, 5, "the write to proceed once the fence opened to its epoch")
    t.join()


def test_threads_of_one_process_share_its_holding(pair):
    """Scenario: two threads of one writer process copy under epoch 3; the first to end must not
    release the other's holding (one open file description holds one lock): the owner's move waits
    for the second as well."""
    owner, peer = pair
    owner.fence.move(3)
    peer.fence.enter(3)
    peer.fence.enter(3)
    peer.fence.leave()
    moved = threading.Event()
    t = threading.Thread(target=close_and_say, args=(owner, moved))
    t.start()
    try:
        assert not moved.wait(0.3)
    finally:
        peer.fence.leave()
    wait_for(moved.is_set, 5, "the owner's move once the second copy ended")
    t.join()


def test_every_join_gets_a_fresh_token():
    """Join tokens (the MetaService's, one per Join of a segment) are 63-bit, never 0, and differ from
    join to join (a re-join of the same MetaService gets another: docs/design.md)."""
    drawn = {new_token() for _ in range(10_000)}
    assert len(drawn) == 10_000
    assert all(0 < t <= MAX_TOKEN for t in drawn)


def test_a_grants_tokens_are_validated():
    """A writer takes the fence tokens of a grant only when there is one per place, each in
    [1, 2^63 - 1] (a value it would otherwise write into a fence or a TCP request); a grant with none
    (a MetaService of a build before join tokens) falls back on the session's epoch."""
    assert tokens([], 2, 77, "put") == [77, 77]
    assert tokens([5, 9], 2, 77, "put") == [5, 9]
    for bad in ([5], [5, 9, 1], [0, 9], [-1, 9], [5, MAX_TOKEN + 1]):
        with pytest.raises(InvalidParameter, match="fence tokens"):
            tokens(bad, 2, 77, "put")


def test_the_tokens_ride_the_replies_and_an_older_peer_decodes_them():
    """``AllocResult.fences``, ``DrainMove.fence`` and ``Joined.fence`` round-trip; an array-like
    record of an older build (no such field) decodes to no token, and one with the field decodes
    in an older build's reader (trailing fields are ignored)."""
    res = p.AllocResult(0, 3, [p.Location(1, 64)], [12345])
    wire = msgspec.msgpack.encode(p.AllocReply([res]))
    assert p.reply_decoder.decode(wire) == p.AllocReply([res])
    old = msgspec.msgpack.encode([0, 3, [[1, 64]]])   # an older MetaService's result
    assert msgspec.msgpack.decode(old, type=p.AllocResult).fences == []

    class OldAllocResult(msgspec.Struct, array_like=True):
        code: int
        generation: int = 0
        locations: list[p.Location] = []

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(res), type=OldAllocResult).locations == [p.Location(1, 64)]
    move = p.DrainMove("k", 10, 0, 3, 0, 4, p.Location(2, 128), 999)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(move), type=p.DrainMove).fence == 999
    joined = p.Joined(7, 11, 1000, 2000, b"t", fence=424242)
    assert p.reply_decoder.decode(msgspec.msgpack.encode(joined)) == joined


def test_a_held_fence_bounds_the_owners_wait_and_opens_once_the_writes_ended(pair):
    """Scenario (``local/hold.py``): a writer of token 5 is frozen mid-copy when the owner re-joins. The
    owner waits ``wait_s``, then joins held: the fence stays 0 (the writer's token is refused to every
    later write), and re-joining again while held does not wait again. Once the writer ends, the hold
    is over and the fence holds the token of the owner's latest join."""
    owner, peer = pair
    join_lock, stop, beat = threading.Lock(), threading.Event(), threading.Event()
    hold = Hold(owner.fence, 0.2, join_lock, stop, beat)
    owner.fence.move(5)
    peer.fence.enter(5)
    try:
        t0 = time.monotonic()
        hold.close()
        assert hold.held and 0.2 <= time.monotonic() - t0 < 2.0 and owner.fence.epoch == 0
        hold.open(9)
        assert owner.fence.epoch == 0 and hold.held
        t0 = time.monotonic()
        hold.close()                  # a re-join while held: no second wait
        assert time.monotonic() - t0 < 0.1
        hold.open(11)
        assert not beat.wait(0.3) and hold.held and owner.fence.epoch == 0
    finally:
        peer.fence.leave()
    wait_for(lambda: not hold.held, 5, "the hold to end once the write ended")
    assert owner.fence.epoch == 11 and beat.is_set()
    with pytest.raises(StaleGrant):
        peer.fence.enter(5)
    hold.close()                      # not held: the ordinary wait, none in flight
    assert not hold.held and owner.fence.epoch == 0
    stop.set()
