"""Replicas and placement against real processes: a holder killed with -9, a corrupt replica, every
put path with replicaNum 2, and the spread policy."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from memcache_core import DistributedObjectStore, ReplicateConfig
from memcache_core.layout import HEADER_BYTES, footprint
from memcache_core.testing import mapped_segment, running_meta_service, wait_for

pytestmark = pytest.mark.integration

LAYOUT = [64 << 10, 16 << 10]


def segments_of(ms, key: str) -> list[int]:
    return [loc["segment"] for loc in ms.http(f"/query_key?key={key}")["locations"]]


def put_replicated(meta, client, keys: list[str], n: int = 2) -> None:
    """Put ``keys`` with replicaNum ``n`` until each has its ``n`` replicas: the precondition of these
    tests, established rather than assumed. Placement passes over a segment whose owner's heartbeat
    is late (on a loaded host, half the ``meta`` fixture's heartbeat timeout), leaving a key short;
    such a key is removed and put again."""
    todo = list(keys)

    def placed() -> bool:
        assert client("put", keys=todo, layout=LAYOUT, replicas=n)["codes"] == [0] * len(todo)
        short = [k for k in todo if len(segments_of(meta, k)) < n]
        if short:
            assert client("remove", keys=short)["codes"] == [0] * len(short)
        todo[:] = short
        return not short
    wait_for(placed, 30, lambda: f"{len(todo)} keys to get {n} replicas")


def _store(ms, init_bm: bool, **cfg) -> DistributedObjectStore:
    s = DistributedObjectStore()
    assert s.setup(ms.local_config(heartbeat_interval_ms=200, **cfg)) == 0
    assert s.init(0, init_bm) == 0
    return s


def test_kill9_of_one_of_two_holders_leaves_every_object_readable(short_heartbeat, meta, stores):
    """Scenario: replicaNum 2, two providers holding segments and a pure client writing and reading
    over TCP. One provider is killed with -9: every object is still read byte-exact, at once (the
    reader moves past the dead peer to the other replica) and after the MetaService has declared the
    provider dead; the objects are then counted under-replicated."""
    a = stores(protocol="host_tcp", dram_size="64MB")
    b = stores(protocol="host_tcp", dram_size="64MB")
    client = stores(protocol="host_tcp", init_bm=False)
    keys = [f"r2-{i}" for i in range(40)]
    put_replicated(meta, client, keys)
    ids = {a("id")["id"], b("id")["id"]}
    assert all(set(segments_of(meta, k)) == ids for k in keys)
    assert meta.metric("objects_under_replicated") == 0
    a.kill()
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 40 and got["mismatches"] == []
    wait_for(lambda: meta.metric("objects_under_replicated") == 40, 15, "the dead holder's replicas to leave")
    assert len(meta.http("/get_all_segments")["segments"]) == 1
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 40 and got["mismatches"] == []
    # negative control: with both holders gone the objects are misses, never wrong bytes
    b.kill()
    wait_for(lambda: client("exist", keys=keys)["codes"] == [0] * 40, 15, "the last holder's objects to leave")
    assert meta.metric("objects_under_replicated") == 0
    got = client("get", keys=keys, layout=LAYOUT)
    assert all(c == -3007 for c in got["codes"]) and got["mismatches"] == []


def test_a_corrupt_replica_is_read_around_dropped_alone_and_made_again():
    """Scenario: replicaNum 2; the bytes of the replica the reader tries first are damaged in shared
    memory. The read still succeeds byte-exact from the other replica; the MetaService drops only
    the damaged copy, then has the good replica's holder copy it again (re-replication), and the
    object reads byte-exact from either replica."""
    with running_meta_service(lease_ttl_ms=2000, heartbeat_timeout_ms=10_000) as ms:   # no death wanted here
        holders = [_store(ms, True, dram_size="8MB") for _ in range(2)]
        client = _store(ms, False)
        try:
            data = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
            assert client.put("K", data, ReplicateConfig(2)) == 0
            locs = ms.http("/query_key?key=K")["locations"]
            assert len(locs) == 2
            with mapped_segment(ms.segment(locs[0]["segment"]).shm_path) as m:
                m[locs[0]["offset"] + HEADER_BYTES + 1000] ^= 0xFF
            assert client.get("K") == data
            now = ms.http("/query_key?key=K")["locations"]
            assert locs[1] in now and locs[0] not in now, "only the damaged copy is dropped"
            assert ms.metric("integrity_failures_total") == 1
            wait_for(lambda: len(segments_of(ms, "K")) == 2, 15, "the second replica to be made again")
            assert ms.metric("objects_under_replicated") == 0 and ms.metric("repaired_objects_total") == 1
            assert client.get("K") == data
            with mapped_segment(ms.segment(locs[1]["segment"]).shm_path) as m:   # now read the new copy
                m[locs[1]["offset"] + HEADER_BYTES + 1000] ^= 0xFF
            # the only good bytes left are the new copy's (2: the reader tried the damaged one first)
            assert client.get("K") == data
            assert ms.metric("integrity_failures_total") in (1, 2)
        finally:
            client.close()
            for h in holders:
                h.close()


def test_replicas_lost_with_a_killed_holder_are_made_again_and_survive_a_second_death(short_heartbeat, meta, stores):
    """Scenario: replicaNum 2 on three providers (host_tcp: copies go through the data servers) and
    a pure client. The provider holding most replicas is killed with -9: the survivors copy each
    object that lost a replica to the other survivor (re-replication) until none is under-replicated
    and every object has its two replicas on live segments. A second provider is then killed: every
    object is still read byte-exact, from the copies the repair made."""
    provs = [stores(protocol="host_tcp", dram_size="64MB") for _ in range(3)]
    client = stores(protocol="host_tcp", init_bm=False)
    keys = [f"rr-{i}" for i in range(40)]
    put_replicated(meta, client, keys)
    ids = [s("id")["id"] for s in provs]
    held = {k: set(segments_of(meta, k)) for k in keys}
    victim = max(ids, key=lambda i: sum(i in h for h in held.values()))
    lost = [k for k in keys if victim in held[k]]
    assert lost and all(len(h) == 2 for h in held.values())
    provs[ids.index(victim)].kill()
    live = set(ids) - {victim}
    wait_for(lambda: meta.metric("repaired_objects_total") == len(lost), 30, "the lost replicas to be made again")
    assert meta.metric("objects_under_replicated") == 0 and meta.metric("repairs_in_flight") == 0
    assert all(set(segments_of(meta, k)) == live for k in keys)
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 40 and got["mismatches"] == []
    second = min(live)
    provs[ids.index(second)].kill()
    wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 1, 15, "the second holder declared dead")
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 40 and got["mismatches"] == [], "a repaired replica is the only one left"


def test_a_paused_holder_declared_dead_finds_its_replicas_made_again_when_it_returns(short_heartbeat, meta, stores):
    """Scenario: replicaNum 2 on three providers; the one holding most replicas is paused (SIGSTOP,
    as a long stall) until the MetaService has declared it dead and its replicas were made again on
    the others. When it resumes it re-joins and reports its old copies: each is surplus (the object
    holds two replicas again), so it is refused and its space freed; every object keeps exactly two
    replicas and reads byte-exact."""
    provs = [stores(protocol="host_tcp", dram_size="64MB") for _ in range(3)]
    client = stores(protocol="host_tcp", init_bm=False)
    keys = [f"pz-{i}" for i in range(30)]
    put_replicated(meta, client, keys)
    ids = [s("id")["id"] for s in provs]
    victim = max(ids, key=lambda i: sum(i in segments_of(meta, k) for k in keys))
    lost = [k for k in keys if victim in segments_of(meta, k)]
    proc = provs[ids.index(victim)].proc
    proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: meta.metric("repaired_objects_total") == len(lost), 30, "the lost replicas to be made again")
    finally:
        proc.send_signal(signal.SIGCONT)

    def victim_segment() -> dict | None:
        return next((g for g in meta.http("/get_all_segments")["segments"] if g["segment_id"] == victim), None)

    wait_for(lambda: victim_segment() is not None, 15, "the paused holder to re-join")
    seg = victim_segment()
    assert seg is not None and seg["objects"] == 0 and seg["used_bytes"] == 0, seg
    assert all(len(segments_of(meta, k)) == 2 and victim not in segments_of(meta, k) for k in keys)
    assert meta.metric("objects_under_replicated") == 0
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 30 and got["mismatches"] == []


def test_every_put_path_honours_replica_num():
    """Scenario: each public put of DistributedObjectStore with replicaNum 2 (and with an object that
    only has memcache_hybrid's attribute names) places two replicas on distinct segments; a
    replicaNum beyond what the pool has is a partial placement (success, under-replicated); a
    replicaNum out of 1..8 is -3000."""
    with running_meta_service() as ms:
        holders = [_store(ms, True, dram_size="16MB") for _ in range(2)]
        s = _store(ms, False)
        try:
            buf = np.arange(4096, dtype=np.uint8)
            assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            p, rc = buf.ctypes.data, ReplicateConfig(2)

            class Hybrid:   # memcache_hybrid's ReplicateConfig has the same attributes
                replicaNum = 2  # noqa: N815
                preferredLocalServiceIDs: list[int] = []  # noqa: N815

            assert s.put("put", b"x" * 100, rc) == 0
            assert s.put_batch(["pb1", "pb2"], [b"a" * 10, b"b" * 20], Hybrid()) == 0
            assert s.put_from("pf", p, 256, replicateConfig=rc) == 0
            assert s.batch_put_from(["bpf1", "bpf2"], [p, p + 512], [128, 128], replicateConfig=rc) == [0, 0]
            assert s.put_from_layers("pfl", [p, p + 1024], [64, 64], replicateConfig=rc) == 0
            assert s.batch_put_from_layers(["bpfl"], [[p, p + 2048]], [[32, 32]], replicateConfig=rc) == [0]
            keys = ["put", "pb1", "pb2", "pf", "bpf1", "bpf2", "pfl", "bpfl"]
            for k in keys:
                assert len(set(s.get_key_info(k).loc_list())) == 2, k
            assert s.get("pfl") == bytes(buf[:64]) + bytes(buf[1024:1088])
            assert ms.metric("objects_under_replicated") == 0
            assert s.put("four", b"y" * 100, ReplicateConfig(4)) == 0
            assert len(s.get_key_info("four").loc_list()) == 2
            assert ms.metric("objects_under_replicated") == 1
            bad = ReplicateConfig()
            bad.replicaNum = 9
            assert s.put("nine", b"z", bad) == -3000
        finally:
            s.close()
            for h in holders:
                h.close()


def test_spread_policy_spreads_a_pure_clients_objects_over_the_providers():
    """Scenario: ``placement_policy: spread``, three providers and a pure client: 60 objects land on
    all three providers, none holding more than half; under ``local_first`` a provider's own puts
    stay in its own segment."""
    with running_meta_service(placement_policy="spread") as ms:
        holders = [_store(ms, True, dram_size="16MB") for _ in range(3)]
        client = _store(ms, False)
        try:
            for i in range(60):
                assert client.put(f"s{i}", bytes([i]) * 50_000) == 0
            counts = [seg["objects"] for seg in ms.http("/get_all_segments")["segments"]]
            assert sum(counts) == 60 and min(counts) > 0 and max(counts) <= 30, counts
            assert all(client.get(f"s{i}") == bytes([i]) * 50_000 for i in range(60))
        finally:
            client.close()
            for h in holders:
                h.close()
    with running_meta_service(placement_policy="local_first") as ms:
        holders = [_store(ms, True, dram_size="16MB") for _ in range(2)]
        try:
            for i in range(10):
                assert holders[0].put(f"l{i}", b"l" * 1000) == 0
            own = holders[0].get_local_service_id()
            assert all(segments_of(ms, f"l{i}") == [own] for i in range(10))
        finally:
            for h in holders:
                h.close()


def test_reads_prefer_a_same_host_replica_and_fall_back_to_the_other_host():
    """Scenario: holders on hosts A and B (distinct host ids: B is reached over TCP), replicaNum 2,
    and every replica on B damaged in memory. A reader on host A reads A's replicas only (no
    integrity failure is seen); a reader on host B tries its own host first, finds the bytes bad and
    falls back to A: every read byte-exact, each damaged copy counted and dropped."""
    with running_meta_service(lease_ttl_ms=2000) as ms:
        on_a = _store(ms, True, dram_size="8MB", host_id="hostA")
        on_b = _store(ms, True, dram_size="8MB", host_id="hostB")
        readers = {h: _store(ms, False, host_id=h) for h in ("hostA", "hostB")}
        try:
            data = {f"h{i}": bytes([i + 1]) * 30_000 for i in range(10)}
            assert readers["hostA"].put_batch(list(data), list(data.values()), ReplicateConfig(2)) == 0
            b_id = on_b.get_local_service_id()
            with mapped_segment(ms.segment(b_id).shm_path) as b_seg:
                for k in data:
                    (loc,) = [x for x in ms.http(f"/query_key?key={k}")["locations"] if x["segment"] == b_id]
                    b_seg[loc["offset"] + HEADER_BYTES + 7] ^= 0xFF
            assert readers["hostA"].get_batch(list(data)) == list(data.values())
            assert ms.metric("integrity_failures_total") == 0
            assert readers["hostB"].get_batch(list(data)) == list(data.values())
            assert ms.metric("integrity_failures_total") == 10
            assert all(segments_of(ms, k) == [on_a.get_local_service_id()] for k in data)
        finally:
            for s in (*readers.values(), on_a, on_b):
                s.close()


def test_reads_running_while_a_holder_is_killed_all_succeed_byte_exact(short_heartbeat, meta, stores):
    """Scenario: a pure client keeps reading 1 MB objects (replicaNum 2) in a loop while one of the
    two holders is killed with -9, so reads are in flight from it when it dies. Every read, before,
    during and after (until the MetaService has declared the holder dead and a few rounds more),
    succeeds with the right bytes: a replica that fails mid-read is followed by the other."""
    import threading
    a = stores(protocol="host_tcp", dram_size="64MB")
    stores(protocol="host_tcp", dram_size="64MB")
    client = _store(meta, False, protocol="host_tcp")
    try:
        data = {f"live-{i}": np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
                for i in range(12)}
        assert client.put_batch(list(data), list(data.values()), ReplicateConfig(2)) == 0
        stop, rounds = threading.Event(), [0]
        bad: list[str] = []

        def read_loop() -> None:
            while not stop.is_set():
                got = client.get_batch(list(data))
                bad.extend(k for k, v in zip(data, got, strict=True) if v != data[k])
                rounds[0] += 1

        t = threading.Thread(target=read_loop)
        t.start()
        try:
            wait_for(lambda: rounds[0] >= 3, 30, "reads before the kill")
            a.kill()
            wait_for(lambda: meta.metric("objects_under_replicated") == len(data), 15, "the holder declared dead")
            after = rounds[0]
            wait_for(lambda: rounds[0] >= after + 3, 30, "reads after it")
        finally:
            stop.set()
            t.join(30)
        assert bad == [], f"{len(bad)} reads failed or returned wrong bytes, first {bad[0]}"
    finally:
        client.close()


def test_repair_copies_are_spread_over_providers_that_join_one_after_the_other(short_heartbeat, meta, stores):
    """Scenario: replicaNum 2 on providers P and Q; P is killed with -9 and every object is short of
    a replica, with no segment to copy to (Q holds them all). Provider A joins and takes every copy;
    once the repair is over, provider B joins. The copies are spread: B ends up with about half of
    them (moved from A, A's replica replacing), every object keeps two replicas, and killing A with Q,
    the last original holder, loses only what A held: what B holds reads byte-exact. (Before, every
    copy stayed on A, and that loss lost them all.)"""
    q = stores(dram_size="64MB")
    p = stores(dram_size="64MB")
    client = stores(init_bm=False)
    keys = [f"sp-{i}" for i in range(120)]
    put_replicated(meta, client, keys)
    p.kill()
    wait_for(lambda: meta.metric("objects_under_replicated") == 120, 15, "the dead holder's replicas to leave")
    a = stores(dram_size="64MB")
    a_id = a("id")["id"]
    wait_for(lambda: meta.metric("objects_under_replicated") == 0, 30, "every copy made on A")
    assert all(a_id in segments_of(meta, k) for k in keys)
    b = stores(dram_size="64MB")
    b_id = b("id")["id"]

    def on_b() -> int:
        return sum(b_id in segments_of(meta, k) for k in keys)
    wait_for(lambda: on_b() >= 59 and meta.metric("repairs_in_flight") == 0, 30,
             lambda: f"the copies to be spread onto B ({on_b()} there)")
    held = {k: set(segments_of(meta, k)) for k in keys}
    assert all(len(h) == 2 for h in held.values()) and meta.metric("objects_under_replicated") == 0
    assert 59 <= on_b() <= 61 and meta.metric("repair_spread_objects_total") == on_b()
    a.kill()
    q.kill()
    wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 1, 15, "A and Q declared dead")
    kept = [k for k in keys if b_id in held[k]]
    got = client("get", keys=kept, layout=LAYOUT)
    assert got["codes"] == [0] * len(kept) and got["mismatches"] == []


def test_when_the_survivors_are_full_repair_copies_push_out_colder_objects(short_heartbeat, meta, stores):
    """Scenario: replicaNum 2 on providers P and Q; provider R is filled by a client up to its
    high-water mark (no room for one more object without evicting), then the replicated objects and
    10 of R's are read (R's others are colder). P is killed with -9: the only segment that may take
    the copies is R, full. Each copy pushes out one of R's colder objects, never one of the 10 read
    later; every object gets its second replica back, and with Q killed too they read byte-exact from
    R. (Before, the copies waited for free room that never came: the objects stayed short.)"""
    p = stores(dram_size="64MB")
    q = stores(dram_size="64MB")
    client = stores(init_bm=False)
    keys = [f"full-{i}" for i in range(40)]
    put_replicated(meta, client, keys)
    r = stores(dram_size="16MB")
    r_id = r("id")["id"]
    seg = meta.http(f"/query_segment?segment={r_id}")
    n = int(0.9 * seg["capacity_bytes"]) // footprint(sum(LAYOUT))    # up to the high-water mark
    cold = [f"cold-{i}" for i in range(n)]
    assert client("put", keys=cold, layout=LAYOUT, preferred=[r_id])["codes"] == [0] * n
    assert all(s == [r_id] for s in (segments_of(meta, k) for k in cold[:3]))
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 40 and got["mismatches"] == []
    hotter = cold[-10:]
    assert client("get", keys=hotter, layout=LAYOUT)["codes"] == [0] * 10
    p.kill()
    wait_for(lambda: meta.metric("repaired_objects_total") == 40, 30, "every lost replica made again on R")
    assert all(set(segments_of(meta, k)) == {q("id")["id"], r_id} for k in keys)
    left = client("exist", keys=cold)["codes"]
    assert left[-10:] == [1] * 10, "a hotter object was pushed out"
    assert left.count(1) == n - 40, f"{n - left.count(1)} of R's objects pushed out for 40 copies"
    q.kill()
    wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 1, 15, "Q declared dead")
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 40 and got["mismatches"] == []
