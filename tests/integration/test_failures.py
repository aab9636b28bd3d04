"""Failures: a LocalService killed mid-traffic, a MetaService restart, a MetaService down, a writer dying."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from memcache_core import DistributedObjectStore, LocalConfig
from memcache_core import protocol as p
from memcache_core.local.service import LocalService
from memcache_core.rpc import expect
from memcache_core.testing import running_meta_service, wait_for
from tests.integration.stores import stalled_reads

pytestmark = pytest.mark.integration

LOAD_SLACK_S = 2.0   # what a loaded CI host may add to a bound (scheduling), far below the hang it rules out


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_kill9_of_a_local_service_mid_traffic(short_heartbeat, meta, stores, protocol):
    """Scenario: C dies with kill -9 while A and B keep writing and reading. Keys held by C become
    misses (never wrong bytes); everything else keeps working, and no error outlives the timeout."""
    a, b, c = (stores(protocol=protocol) for _ in range(3))
    layout = [64 << 10, 16 << 10]
    on_c = [f"c-{i}" for i in range(10)]
    assert c("put", keys=on_c, layout=layout)["codes"] == [0] * 10   # placed in C's own segment
    on_a = [f"a-{i}" for i in range(10)]
    assert a("put", keys=on_a, layout=layout)["codes"] == [0] * 10
    c.kill()
    rounds = iter(range(1 << 30))

    def traffic_round() -> bool:
        """One round of traffic between A and B; true once C's keys are no longer listed."""
        keys = [f"traffic-{next(rounds)}-{i}" for i in range(4)]
        assert a("put", keys=keys, layout=layout)["codes"] == [0] * 4
        got = b("get", keys=keys + on_a, layout=layout)
        assert got["codes"] == [0] * 14 and got["mismatches"] == []
        from_c = b("get", keys=on_c, layout=layout)
        assert from_c["mismatches"] == []        # whatever is read is right, or it is a miss
        return b("exist", keys=on_c)["codes"] == [0] * 10

    wait_for(traffic_round, 15, "the dead LocalService's keys to leave the listing (its heartbeat timeout)",
             interval_s=0)
    assert all(code == -3007 for code in b("get", keys=on_c, layout=layout)["codes"])
    # C's segment left with its keys; A's and B's stay (a member starved of CPU for a heartbeat timeout
    # re-joins, and is listed again once it has)
    wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 2, 10,
             "the pool to list A's and B's segments only")


def test_meta_service_restart_recovers_the_table(meta, stores):
    """Scenario: the MetaService is killed between writes and reads; after a restart on the same
    address the LocalServices re-join and report their objects, and every read is byte-exact."""
    a, b = stores(), stores(protocol="host_tcp")
    layout = [100 << 10] * 3
    keys = [f"persist-{i}" for i in range(20)]
    assert a("put", keys=keys[:10], layout=layout)["codes"] == [0] * 10
    assert b("put", keys=keys[10:], layout=layout)["codes"] == [0] * 10
    meta.kill()       # at once: a put that returned is in its segment's object headers, heartbeat or not
    got = a("exist", keys=keys[:1])["codes"]
    assert got[0] == -3017
    meta.start()
    wait_for(lambda: len(meta.http("/get_all_keys")["keys"]) == 20, 15, "recovery of 20 keys")
    for reader in (a, b):
        got = reader("get", keys=keys, layout=layout)
        assert got["codes"] == [0] * 20 and got["mismatches"] == []
    # and the pool takes new writes again once the recovery grace has passed
    wait_for(lambda: a("put", keys=["after-restart"], layout=layout)["codes"] == [0], 10, "new puts")
    assert b("get", keys=["after-restart"], layout=layout)["mismatches"] == []


def test_meta_service_down_gives_3017_without_hanging():
    with running_meta_service() as ms:
        s = DistributedObjectStore()
        assert s.setup(ms.local_config(client_timeout_seconds=2, heartbeat_interval_ms=200)) == 0
        assert s.init(0, True) == 0
        assert s.put("k", b"v") == 0
        assert ms.pid is not None
        os.kill(ms.pid, signal.SIGSTOP)  # frozen: connections stay open, nothing answers
        try:
            t = time.monotonic()
            assert s.is_exist("k") == -3017
            assert time.monotonic() - t < 2 + LOAD_SLACK_S      # client_timeout_seconds, and a loaded host
            # once known down, calls fail at once: not one waits its timeout. "At once" is within 0.2 s
            # of the last failure, so a stall of this process between two calls (a loaded host) makes
            # the next one try again and wait; a few tries, one of which must be quick (none would be
            # if calls waited their timeout: each try would take 2 x 2 s)
            took = []
            for _ in range(3):
                t = time.monotonic()
                assert s.batch_is_exist(["k", "j"]) == [-3017, -3017]
                assert s.get("k") == b""
                took.append(time.monotonic() - t)
                if took[-1] < 1.5:
                    break
            assert min(took) < 1.5, took
        finally:
            os.kill(ms.pid, signal.SIGCONT)
        wait_for(lambda: s.is_exist("k") == 1, 5, "the MetaService to answer again")
        ms.kill()
        t = time.monotonic()
        assert s.put("k2", b"v") == -3017
        assert time.monotonic() - t < 2 + LOAD_SLACK_S
        s.close()
    # a store whose MetaService never existed does not start
    s = DistributedObjectStore()
    cfg = LocalConfig(meta_service_url="tcp://127.0.0.1:1", protocol="host_shm", dram_size="8MB",
                      client_timeout_seconds=1)
    assert s.setup(cfg) == 0
    t = time.monotonic()
    assert s.init(0, True) == -3017
    assert time.monotonic() - t < 1 + LOAD_SLACK_S


def test_writer_dying_between_alloc_and_commit_leaves_nothing(short_heartbeat, meta):
    """Scenario: a writer allocates (objects PENDING) and dies before commit: nothing becomes
    visible, and its space comes back when it is declared dead."""
    reader = DistributedObjectStore()
    assert reader.setup(meta.local_config()) == 0 and reader.init(0, True) == 0
    before = meta.http("/api/v1/capacity/usage")["used_bytes"]
    code = f"""
import os
from memcache_core.local.service import LocalService
from memcache_core.config import LocalConfig
from memcache_core import protocol as p
svc = LocalService(LocalConfig(meta_service_url={meta.meta_service_url!r}, protocol="host_shm",
                               dram_size="8MB", heartbeat_interval_ms=200))
svc.start(0, with_segment=False)
r = svc.rpc.call(p.Alloc(svc.client_id, svc.session.token, ["half-written"], [1 << 20]))
assert r.results[0].code == 0, r
print("allocated", flush=True)
os.kill(os.getpid(), 9)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "allocated" in out.stdout, out.stderr
    assert reader.is_exist("half-written") == 0
    assert reader.get("half-written") == b""
    assert meta.http("/api/v1/capacity/usage")["used_bytes"] > before
    wait_for(lambda: meta.http("/api/v1/capacity/usage")["used_bytes"] == before, 10, "space reclaimed")
    assert reader.put("half-written", b"now whole") == 0
    assert reader.get("half-written") == b"now whole"
    reader.close()


def test_pending_deadline_and_commit_after_abort():
    with running_meta_service(pending_timeout_ms=300) as ms:
        svc = LocalService(ms.local_config())     # a member that allocates and commits by hand
        svc.start(0, with_segment=True)
        try:
            r = expect(svc.rpc.call(p.Alloc(svc.client_id, svc.session.token, ["slow"], [4096])), p.AllocReply)
            gen = r.results[0].generation
            wait_for(lambda: ms.http("/api/v1/stats")["counters"]["pending_reclaimed"] == 1, 5, "pending reclaim")
            codes = expect(svc.rpc.call(p.Commit(svc.client_id, svc.session.token, ["slow"], [gen])),
                           p.Codes).codes
            assert codes == [-3101]
            assert svc.exist(["slow"]) == [False]
        finally:
            svc.close()


def test_stalled_reader_never_reports_bytes_of_a_reused_space():
    """Scenario: a reader stalls past its lease; meanwhile the object is removed, its lease ends,
    and the same space is given to another object. The late read must fail, not return J's bytes.
    The reader verifies no checksums here, so this proves the lease validation on its own (with
    checksums on the same read is also a miss, -3110)."""
    import numpy as np
    with running_meta_service(lease_ttl_ms=300, heartbeat_timeout_ms=10_000) as ms:   # no death wanted here
        owner, reader = DistributedObjectStore(), DistributedObjectStore()
        assert owner.setup(ms.local_config(dram_size="4MB")) == 0 and owner.init(0, True) == 0
        assert reader.setup(ms.local_config(checksum_verify_ratio=0.0)) == 0 and reader.init(1, False) == 0
        assert owner.put("K", b"k" * 65536) == 0
        k_loc = ms.http("/query_key?key=K")["locations"]

        def meanwhile() -> None:
            assert owner.remove("K") == 0
            wait_for(lambda: ms.http("/api/v1/capacity/usage")["used_bytes"] == 0, 10,
                     "the lease (300 ms) to end and K's space to be freed")
            assert owner.put("J", b"j" * 65536) == 0  # best fit: J lands where K was

        dst = np.zeros(65536, np.uint8)
        assert reader.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        with stalled_reads(reader, meanwhile):
            assert reader.get_into("K", dst.ctypes.data, 65536) == -3101
        assert ms.http("/query_key?key=J")["locations"] == k_loc   # the space really was reused
        assert owner.put("K", b"k" * 65536) == 0
        assert reader.get_into("K", dst.ctypes.data, 65536) == 0 and bytes(dst) == b"k" * 65536
        owner.close()
        reader.close()
