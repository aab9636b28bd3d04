"""Small puts in one round trip (allocation arenas, docs/design.md "Small puts"), with real processes:
byte-exact through both data paths, never visible half-written, gone with a killed writer, forged
commits refused, checksums verified, and a MetaService restart on either side of the commit."""

from __future__ import annotations

import re
import secrets
import threading
from functools import partial

import numpy as np
import pytest

from memcache_core import DistributedObjectStore, errors
from memcache_core import protocol as p
from memcache_core.layout import footprint, payload_offset
from memcache_core.memory import view_at
from memcache_core.meta.allocator import aligned
from memcache_core.rpc import expect
from memcache_core.testing import MetaServiceProcess, mapped_segment, running_meta_service, wait_for
from tests.integration.stores import answers_again

pytestmark = pytest.mark.integration

SMALL = [3 << 10, 1 << 10]       # a 4 KiB object in two pieces: the arena path (at most 64 KiB)
ROUND_TRIP_OPS = ("alloc", "commit", "arena_commit", "abort", "join")


def round_trips(meta: MetaServiceProcess) -> dict[str, float]:
    """Requests the MetaService answered per put-related op (``/metrics``)."""
    text = meta.http("/metrics")
    out = {}
    for op in ROUND_TRIP_OPS:
        m = re.search(rf'^memcache_request_seconds_count\{{op="{op}"\}} (\S+)$', text, re.M)
        out[op] = float(m.group(1)) if m else 0.0
    return out


def arena_reserved(meta: MetaServiceProcess) -> int:
    """Bytes of every arena that hold no object (``segment_arena_reserved_bytes``, summed)."""
    text = meta.http("/metrics")
    return sum(int(float(v)) for v in re.findall(r"^memcache_segment_arena_reserved_bytes\{[^}]*\} (\S+)$", text, re.M))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {op: after[op] - before[op] for op in before if after[op] != before[op]}


def location(meta: MetaServiceProcess, key: str) -> p.Found:
    rpc = meta.rpc()
    try:
        found = expect(rpc.call(p.Lookup([key], lease=False)), p.LookupReply).results[0]
    finally:
        rpc.close()
    assert found is not None, f"{key} is not in the pool"
    return found


def test_round_trip_byte_exact_and_one_commit_per_batch(meta, stores):
    """Scenario: a writer puts batches of 64 small objects; readers on host_shm and host_tcp read
    them byte-exact. The first batch costs at most two round trips (the arena's grant, the commit),
    the next exactly one (the commit); an object above the threshold still goes two-phase."""
    writer, shm_reader, tcp_reader = stores(), stores(), stores(protocol="host_tcp")
    first = [f"small-a-{i}" for i in range(64)]
    before = round_trips(meta)
    assert writer("put", keys=first, layout=SMALL)["codes"] == [0] * 64
    spent = delta(before, round_trips(meta))
    assert spent == {"arena_commit": 2}, spent
    second = [f"small-b-{i}" for i in range(64)]
    before = round_trips(meta)
    assert writer("put", keys=second, layout=SMALL)["codes"] == [0] * 64
    assert delta(before, round_trips(meta)) == {"arena_commit": 1}
    for reader in (shm_reader, tcp_reader, writer):
        got = reader("get", keys=first + second, layout=SMALL)
        assert got["codes"] == [0] * 128 and got["mismatches"] == []
    # the arena's free part is reported: each small put takes its footprint out of it
    reserved = arena_reserved(meta)
    assert reserved > 0
    assert writer("put", keys=[f"small-c-{i}" for i in range(4)], layout=SMALL)["codes"] == [0] * 4
    assert reserved - arena_reserved(meta) == 4 * aligned(footprint(sum(SMALL)))
    # negative control: above small_put_max_bytes the put is two-phase, and not in the arena
    before, reserved = round_trips(meta), arena_reserved(meta)
    assert writer("put", keys=["large"], layout=[(64 << 10) + 1])["codes"] == [0]
    assert delta(before, round_trips(meta)) == {"alloc": 1, "commit": 1}
    assert arena_reserved(meta) == reserved
    assert tcp_reader("get", keys=["large"], layout=[(64 << 10) + 1])["mismatches"] == []
    # a put of a key that exists is a no-op success through the arena too, and changes no bytes
    assert writer("put", keys=first[:4], layout=SMALL, version=2)["codes"] == [0] * 4
    assert shm_reader("get", keys=first[:4], layout=SMALL)["mismatches"] == []


def test_a_reader_never_sees_a_half_written_object(meta, stores):
    """Scenario: while a writer puts 1,024 objects of 64 KiB in one batch (arena refills and the
    two-phase rest included), a reader polls exist and get of them: a key reported present reads
    byte-exact, every read that succeeds is byte-exact, and in the end all are there."""
    writer, reader = stores(), stores()
    layout = [64 << 10]
    keys = [f"poll-{i}" for i in range(1024)]
    result: dict[str, list[int]] = {}
    t = threading.Thread(target=lambda: result.update(codes=writer("put", keys=keys, layout=layout)["codes"]))
    t.start()
    seen_present = 0
    try:
        while t.is_alive():
            present = [k for k, c in zip(keys, reader("exist", keys=keys)["codes"], strict=True) if c == 1]
            seen_present = max(seen_present, len(present))
            probe = present[-8:] + keys[len(present):len(present) + 8]   # the newest and the next ones
            got = reader("get", keys=probe, layout=layout)
            assert got["mismatches"] == []
            assert all(c == 0 for k, c in zip(probe, got["codes"], strict=True) if k in present)
    finally:
        t.join()
    assert result["codes"] == [0] * len(keys)
    got = reader("get", keys=keys, layout=layout)
    assert got["codes"] == [0] * len(keys) and got["mismatches"] == []


def test_a_writer_killed_mid_batch_leaves_nothing_visible(short_heartbeat, meta, stores):
    """Scenario: the writer is killed (SIGKILL) in the middle of a large batch of small puts. Its
    arena was in its own segment: once it is declared dead nothing it wrote is visible, its segment
    (arena and all) has left the pool, and no put of it stays pending."""
    writer, reader = stores(), stores()
    keys = [f"doomed-{i}" for i in range(4096)]

    def put_until_killed() -> None:
        try:
            writer("put", keys=keys, layout=[32 << 10])
        except RuntimeError:   # "store process died"
            pass

    t = threading.Thread(target=put_until_killed)
    t.start()
    try:
        wait_for(lambda: reader("exist", keys=keys[:1])["codes"] == [1], 30, "the first commit of the batch")
        writer.kill()
    finally:
        t.join()
    wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 1, 15,
             "the killed writer's segment to leave the pool")
    assert reader("exist", keys=keys)["codes"] == [0] * len(keys)
    got = reader("get", keys=keys[:64], layout=[32 << 10])
    assert got["mismatches"] == [] and all(c == errors.OBJECT_NOT_EXISTS for c in got["codes"])
    assert meta.metric("pending_objects") == 0
    # the pool goes on: the reader's own small puts work
    assert reader("put", keys=["after"], layout=SMALL)["codes"] == [0]


def test_forged_and_overlapping_commits_are_refused(meta):
    """Scenario: an insider (a member with its own token) commits over an object it holds, outside
    its arena, and in an arena it never had: each is refused, and every object reads as before."""
    insider = DistributedObjectStore()
    assert insider.setup(meta.local_config()) == 0 and insider.init(0) == 0
    try:
        value = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        assert insider.put("victim", value) == 0
        svc = insider._service()
        assert svc.arenas is not None and svc.arenas.arena is not None
        a, s = svc.arenas.arena, svc.session
        victim = location(meta, "victim")
        off = victim.locations[0].offset

        def forge(arena_id: int, key: str, offset: int, size: int = 4096) -> int:
            r = expect(svc.rpc.call(p.ArenaCommit(s.client_id, s.token, arena_id, [key], [offset], [size], [0])),
                       p.ArenaReply)
            return r.codes[0]

        assert forge(a.id, "over-victim", off) == errors.INVALID_PARAM                  # on the victim
        assert forge(a.id, "inside-victim", off + 64, 64) == errors.INVALID_PARAM       # inside it
        assert forge(a.id, "outside", a.end) == errors.INVALID_PARAM                    # past the arena
        assert forge(a.id, "unaligned", a.next + 8) == errors.INVALID_PARAM
        assert forge(secrets.randbits(62) or 1, "no-arena", a.next) == errors.ARENA_VOID
        assert insider.batch_is_exist(["over-victim", "inside-victim", "outside", "unaligned", "no-arena"]) == [0] * 5
        assert insider.get("victim") == value
        after = location(meta, "victim")
        assert (after.generation, after.checksum, after.locations) == (victim.generation, victim.checksum,
                                                                        victim.locations)
        # a stranger (no member token) is not even heard
        with pytest.raises(errors.NotAMember):
            svc.rpc.call(p.ArenaCommit(s.client_id, b"x" * 16, a.id, ["stranger"], [a.next], [64], [0]))
        # and the insider's honest puts still work
        assert insider.put("honest", value) == 0 and insider.get("honest") == value
    finally:
        insider.close()


def test_checksums_are_verified_on_read(meta, stores):
    """Scenario: a byte of an arena object's payload rots in the writer's segment: a reader gets a
    miss (never the wrong bytes) and the object leaves the pool; an untouched neighbour reads fine."""
    writer, reader = stores(), stores(protocol="host_tcp")
    keys = ["rot", "fine"]
    assert writer("put", keys=keys, layout=SMALL)["codes"] == [0, 0]
    got = reader("get", keys=keys, layout=SMALL)
    assert got["codes"] == [0, 0] and got["mismatches"] == []   # the control: intact, they read fine
    found = location(meta, "rot")
    assert found.checksum != 0
    seg = meta.segment(found.locations[0].segment_id)
    with mapped_segment(seg.shm_path) as m:
        at = payload_offset(found.locations[0].offset) + 100
        m[at] ^= 0xFF
    got = reader("get", keys=keys, layout=SMALL)
    assert got["codes"][0] == errors.CHECKSUM_MISMATCH and got["codes"][1] == 0 and got["mismatches"] == []
    wait_for(lambda: reader("exist", keys=["rot"])["codes"] == [0], 10, "the corrupt object to be dropped")


def test_meta_service_restart_between_grant_and_commit(meta, stores):
    """Scenario: the writer holds an arena, then the MetaService restarts before its next commit.
    That commit is refused (the new MetaService does not know the writer, nor the arena), the put
    goes the two-phase way and succeeds byte-exact; an arena of the old life named by the re-joined
    member is refused with ARENA_VOID; new small puts take a fresh arena."""
    other = stores()   # holds no object: takes new puts at once after the restart (the writer's segment
    store = DistributedObjectStore()   # waits out the recovery grace, lease_ttl_ms)
    # a slow heartbeat: the put, not the heartbeat, is the first to meet the new MetaService
    assert store.setup(meta.local_config(heartbeat_interval_ms=600_000)) == 0 and store.init(0) == 0
    try:
        svc = store._service()
        assert store.put("before", b"b" * 4096) == 0
        assert svc.arenas is not None and svc.arenas.arena is not None
        old = svc.arenas.arena
        meta.stop()
        meta.start()
        wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 1, 15, "the other member to re-join")
        before = round_trips(meta)
        assert store.put("across", b"a" * 4096) == 0
        spent = delta(before, round_trips(meta))
        # the refused arena commit, the re-join, then the two-phase put (its first Alloc met the old token too)
        assert spent.get("arena_commit") == 1 and spent.get("join") == 1 and spent.get("commit") == 1, spent
        assert spent.get("alloc", 0) >= 1, spent
        assert store.get("across") == b"a" * 4096
        wait_for(lambda: store.is_exist("before") == 1, 15, "the re-joined writer's objects to be recovered")
        assert store.get("before") == b"b" * 4096
        s = svc.session
        r = expect(svc.rpc.call(p.ArenaCommit(s.client_id, s.token, old.id, ["stale"], [old.next], [64], [0])),
                   p.ArenaReply)
        assert r.codes == [errors.ARENA_VOID] and store.is_exist("stale") == 0
        assert other("exist", keys=["across", "before"])["codes"] == [1, 1]
    finally:
        store.close()


def test_recovery_after_a_meta_service_restart_includes_arena_objects(meta, stores):
    """Scenario: objects put through the arena are in the writer's segment with their headers: after
    the MetaService is killed and restarted, the writer's report brings them back, byte-exact for
    readers on both paths; new small puts work once the recovery grace is over."""
    writer, shm_reader, tcp_reader = stores(), stores(), stores(protocol="host_tcp")
    keys = [f"kept-{i}" for i in range(100)]
    assert writer("put", keys=keys, layout=SMALL)["codes"] == [0] * 100
    meta.kill()
    meta.start()
    wait_for(lambda: len(meta.http("/get_all_keys")["keys"]) == 100, 15, "recovery of the 100 arena objects")
    for reader in (shm_reader, tcp_reader):   # each reader reaches the MetaService again first
        wait_for(partial(answers_again, reader, keys[0]), 15, "the reader to reach it again")
        got = reader("get", keys=keys, layout=SMALL)
        assert got["codes"] == [0] * 100 and got["mismatches"] == []
    wait_for(lambda: writer("put", keys=["after-restart"], layout=SMALL)["codes"] == [0], 15, "new small puts")
    assert tcp_reader("get", keys=["after-restart"], layout=SMALL)["mismatches"] == []


def test_objects_larger_than_the_arena_and_arenas_turned_off():
    """Scenario: ``small_put_max_bytes`` above the MetaService's ``arena_bytes``: an object that no
    arena can hold goes two-phase at once (no arena is wasted on it), smaller ones still take the
    arena; with ``arena_bytes`` 0 every put is two-phase, and stays so without asking each time."""
    big, small = b"B" * (200 << 10), b"s" * 4096
    for arena_bytes in (64 << 10, 0):
        with running_meta_service(arena_bytes=arena_bytes) as ms:
            store = DistributedObjectStore()
            assert store.setup(ms.local_config(small_put_max_bytes=1 << 20)) == 0 and store.init(0) == 0
            try:
                before = round_trips(ms)
                assert store.put_batch(["small-1", "big", "small-2"], [small, big, small]) == 0
                assert store.put("small-3", small) == 0
                spent = delta(before, round_trips(ms))
                if arena_bytes:   # the grant, the commit of both small ones, small-3's commit; big two-phase
                    assert spent == {"arena_commit": 3, "alloc": 1, "commit": 1}, spent
                else:             # one ask for an arena (none granted), then two-phase only
                    assert spent == {"arena_commit": 1, "alloc": 2, "commit": 2}, spent
                assert [store.get(k) for k in ("small-1", "big", "small-2", "small-3")] == [small, big, small, small]
            finally:
                store.close()


def test_a_put_holding_the_session_from_before_a_rejoin_copies_nothing_into_its_arena(meta):
    """Scenario: a small put reads the member's session; before it takes the arena lock, a re-join
    (the heartbeat thread finding the session stale) takes it and replaces the session. The put still
    holds the old session, and the arena was granted to that session: it must not place objects
    there, because after a re-join the MetaService may hand that space to another object. Its objects
    go the two-phase way, and the old arena's free space is left as it was."""
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(heartbeat_interval_ms=600_000)) == 0 and store.init(0) == 0
    try:
        svc = store._service()
        assert store.put("first", b"f" * 4096) == 0
        assert svc.arenas is not None and svc.arenas.arena is not None and svc.segment is not None
        stale, tail = svc.session, svc.arenas.arena.next
        svc._rejoin(stale)   # what the heartbeat does; it holds the arena lock meanwhile
        assert svc.session is not stale
        space = view_at(svc.segment.addr + tail, footprint(4096))
        before = bytes(space)
        payload = np.full(4096, 0x6C, np.uint8)
        done, left = svc.arenas.put(stale, ["late"], [[(payload.ctypes.data, payload.size)]], [4096])
        assert done == {} and left == [0]   # for the two-phase put, with the current session
        assert bytes(space) == before, "the put copied into the arena of the session a re-join replaced"
        # (the re-joined segment takes new objects once its recovery grace is over)
        wait_for(lambda: store.put("late", payload.tobytes()) == 0, 15, "the put after the grace")
        assert store.get("late") == payload.tobytes() and store.get("first") == b"f" * 4096
    finally:
        store.close()
