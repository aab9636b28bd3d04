"""Identity and integrity: ids issued by the MetaService, checksums verified by readers, and commits
that survive a MetaService crash.

The deployment users get by default: every engine process holds a segment of its own, and every
engine seeds Python's ``random`` the same way (vLLM and SGLang call ``random.seed`` in each worker).
"""

from __future__ import annotations

import os
from functools import partial

import pytest

from memcache_core import LocalConfig
from memcache_core import protocol as p
from memcache_core.layout import HEADER_BYTES
from memcache_core.local.service import LocalService, Session
from memcache_core.rpc import expect
from memcache_core.testing import mapped_segment, running_meta_service, wait_for

pytestmark = pytest.mark.integration

LAYOUT = [64 << 10, 16 << 10, 16 << 10]


def locate(meta, key: str) -> tuple[str, int, int]:
    """(shm path, payload offset, size) of a key's first replica, as the MetaService knows it."""
    client = meta.rpc(5.0)
    try:
        f = expect(client.call(p.Lookup([key], lease=False), idempotent=True), p.LookupReply).results[0]
        assert f is not None, f"{key} is not in the pool"
    finally:
        client.close()
    return meta.segment(f.locations[0].segment_id).shm_path, f.locations[0].offset + HEADER_BYTES, f.size


def flip_byte(path: str, offset: int) -> None:
    with mapped_segment(path) as m:
        m[offset] ^= 0xFF


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_seeded_processes_holding_segments_read_each_other_byte_exact(meta, stores, protocol):
    """Scenario (the reported bug): two processes seed ``random`` alike and each holds a segment; each
    writes into its own segment and reads the other's objects. Before ids were issued by the
    MetaService, both drew the same id and the reader copied from its own empty segment, with 0."""
    a = stores(protocol=protocol, seed_random=0)
    b = stores(protocol=protocol, seed_random=0)
    assert a("id")["id"] != b("id")["id"]
    on_a, on_b = [f"a-{i}" for i in range(8)], [f"b-{i}" for i in range(8)]
    assert a("put", keys=on_a, layout=LAYOUT)["codes"] == [0] * 8
    assert b("put", keys=on_b, layout=LAYOUT)["codes"] == [0] * 8
    for reader, keys in ((b, on_a), (a, on_b), (a, on_a), (b, on_b)):
        got = reader("get", keys=keys, layout=LAYOUT)
        assert got["codes"] == [0] * 8 and got["mismatches"] == []


def test_a_join_proposing_a_live_id_gets_a_fresh_one_and_reaches_its_own_segment(meta, stores):
    """Scenario: a LocalService proposes the id of a live member of another process (a collision, a
    stale id, or a forgery). It is issued another id; its writes land in its own segment and the
    other member's objects stay readable, byte-exact, both ways."""
    a = stores()
    a_id = a("id")["id"]
    assert a("put", keys=["from-a"], layout=LAYOUT)["codes"] == [0]
    cfg = LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                      protocol="host_shm", dram_size="32MB", client_timeout_seconds=5)
    svc = LocalService(cfg)
    svc.session = Session(a_id, 0, 10.0, 120.0, None)       # propose a's id
    svc.start(0, with_segment=True)
    try:
        assert svc.client_id not in (0, a_id) and svc.segment is not None
        import numpy as np

        from tests.integration.store_worker import pattern
        per = sum(LAYOUT)
        src = pattern("from-b", per)
        pieces = [(src.ctypes.data + off, n) for off, n in zip(np.cumsum([0] + LAYOUT[:-1]), LAYOUT, strict=True)]
        assert svc.put(["from-b"], [[(int(ptr), n) for ptr, n in pieces]]) == [None]
        path, _, _ = locate(meta, "from-b")
        assert path == svc.segment.path                      # our own segment, not a's
        got = a("get", keys=["from-b", "from-a"], layout=LAYOUT)
        assert got["codes"] == [0, 0] and got["mismatches"] == []
        dst = np.zeros(per, np.uint8)
        errs, _ = svc.get(["from-a"], [[(dst.ctypes.data, per)]])
        assert errs == [None] and np.array_equal(dst, pattern("from-a", per))
    finally:
        svc.close()
    assert a("exist", keys=["from-a"])["codes"] == [1]        # a is still a member with its objects


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_corrupted_bytes_are_a_miss_counted_and_dropped(meta, stores, protocol):
    """Scenario: one byte of a committed object changes in the owner's memory. A reader that verifies
    gets a miss (-3110), never the bytes; the failure is counted and the object leaves the pool.
    Negative control: a reader with verification off gets the corrupted bytes with 0 (which is what
    the checksum exists to prevent)."""
    owner = stores(protocol=protocol)
    trusting = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0.0)
    verifying = stores(protocol=protocol, init_bm=False)
    assert owner("put", keys=["victim", "intact"], layout=LAYOUT)["codes"] == [0, 0]
    path, offset, size = locate(meta, "victim")
    flip_byte(path, offset + size // 2)
    blind = trusting("get", keys=["victim"], layout=LAYOUT)
    assert blind["codes"] == [0] and blind["mismatches"] == ["victim"]
    got = verifying("get", keys=["victim", "intact"], layout=LAYOUT)
    assert got["codes"] == [-3110, 0] and got["mismatches"] == []
    assert verifying("exist", keys=["victim", "intact"])["codes"] == [0, 1]
    assert "memcache_integrity_failures_total 1" in meta.http("/metrics")


def test_without_checksums_a_corruption_goes_unseen(meta, stores):
    """Negative control: with ``checksum: false`` on the writer there is nothing to verify against."""
    owner = stores(checksum=False)
    reader = stores(init_bm=False)
    assert owner("put", keys=["plain"], layout=LAYOUT)["codes"] == [0]
    path, offset, size = locate(meta, "plain")
    flip_byte(path, offset)
    got = reader("get", keys=["plain"], layout=LAYOUT)
    assert got["codes"] == [0] and got["mismatches"] == ["plain"]


def test_second_writer_of_a_pending_key_waits_and_never_reports_a_false_success(meta, stores):
    """Scenario: writer 1 allocates a key and stalls; writer 2 puts the same key. Writer 2 is not told
    "stored" while the key is pending: when writer 1 aborts, writer 2 stores the key itself."""
    a = stores()
    client = meta.rpc(5.0)
    try:
        j = expect(client.call(p.Join(0, "test-host", os.getpid(), None, [])), p.Joined)
        r = expect(client.call(p.Alloc(j.client_id, j.token, ["contended"], [sum(LAYOUT)])), p.AllocReply).results[0]
        assert r.code == 0
        import threading
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(a("put", keys=["contended"], layout=LAYOUT)))
        t.start()

        def told_pending() -> int:   # writer 2's Allocs answered "another writer's put is pending"
            return meta.http("/api/v1/stats")["outcomes"].get("put", {}).get("write_in_progress", 0)
        # told twice: writer 2 asked again after the first answer instead of reporting anything
        wait_for(lambda: told_pending() >= 2 or not t.is_alive(), 10, "the second writer to be told to wait")
        assert t.is_alive() and not out, f"the second writer returned while the first write was pending: {out}"
        client.call(p.Abort(j.client_id, j.token, ["contended"], [r.generation]))
        t.join(10)
        assert out["codes"] == [0]
        got = stores(init_bm=False)("get", keys=["contended"], layout=LAYOUT)
        assert got["codes"] == [0] and got["mismatches"] == []
    finally:
        client.close()


def test_remove_by_prefix_removes_one_namespace(meta, stores):
    a = stores()
    keys = ["t1.a", "t1.b", "t2.a", "t10.a"]
    assert a("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
    from memcache_core import DistributedObjectStore
    s = DistributedObjectStore()
    assert s.setup(LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                               protocol="host_shm", client_timeout_seconds=5)) == 0
    assert s.init(0, init_bm=False) == 0
    try:
        assert s.remove_by_prefix("t1.") == 2
        assert s.remove_by_prefix("") == -3000
        assert s.batch_is_exist(keys) == [0, 0, 1, 1]
    finally:
        s.close()


ROUNDS = int(os.environ.get("MEMCACHE_CRASH_ROUNDS", "100"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_put_that_returned_success_survives_a_meta_service_kill(stores):
    """Scenario, repeated ROUNDS (100) times: writers in other processes put into an owner's segment
    (one over shared memory, one over TCP); as soon as both puts return 0 the MetaService is killed
    with SIGKILL and restarted. The owner learns of those objects only from their headers in its
    segment (no heartbeat has told it), re-joins, and reports them. Zero objects lost, zero wrong bytes."""
    # a short lease: a re-joined segment takes new objects after one lease TTL (the rounds wait it out)
    with running_meta_service(heartbeat_timeout_ms=3000, lease_ttl_ms=300) as ms:
        from tests.integration.stores import StoreProcess, answers_again
        procs = [StoreProcess(ms, heartbeat_interval_ms=100, dram_size="128MB")]
        procs += [StoreProcess(ms, init_bm=False, heartbeat_interval_ms=100, protocol=proto)
                  for proto in ("host_shm", "host_tcp")]
        owner, shm_writer, tcp_writer = procs
        written: list[str] = []
        try:
            for r in range(ROUNDS):
                for w, name in ((shm_writer, "shm"), (tcp_writer, "tcp")):
                    key = f"round-{r}-{name}"
                    wait_for(lambda: w("put", keys=[key], layout=LAYOUT)["codes"] == [0],  # noqa: B023
                             20, f"a put of {key} to succeed (refused while recovering)")
                    written.append(key)
                ms.kill()
                ms.start()
                wait_for(lambda: shm_writer("exist", keys=written[-2:])["codes"] == [1, 1], 20,
                         f"round {r}'s objects after the restart")
            # the check above was the other writer's: the TCP writer saw the MetaService down too
            wait_for(partial(answers_again, tcp_writer, written[-1]), 20,
                     "the TCP writer to reach the restarted MetaService")
            got = tcp_writer("get", keys=written, layout=LAYOUT)
            lost = {k: c for k, c in zip(written, got["codes"], strict=True) if c != 0}
            assert lost == {} and got["mismatches"] == []
            assert owner("exist", keys=written)["codes"] == [1] * len(written)
        finally:
            for proc in procs:
                proc.stop()
