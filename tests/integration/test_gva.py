"""The GVA path (memcache_hybrid's layer-wise calls) across processes: a provider P holds the pool's
memory; writer A and reader B are pure clients, so every copy crosses processes (shared memory with
``host_shm``, P's data server with ``host_tcp``). The sequence: A allocates, copies layer by layer,
finishes; B describes, leases, copies layer by layer, unleases; byte-exact. Then every misuse returns a
code and corrupts nothing (docs/design.md "GVA path")."""

from __future__ import annotations

import re

import pytest

from memcache_core import G2H, H2G
from memcache_core.layout import payload_offset
from memcache_core.testing import mapped_segment, running_meta_service, started, wait_for
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [32 << 10] * 4 + [8 << 10] * 4     # 8 "layers" of one block: K slices then V slices
SIZE = sum(LAYOUT)
INVALID_PARAM, OBJECT_EXISTS, NOT_EXISTS, TIMEOUT, STATE_MISMATCH = -3000, -3006, -3007, -3004, -3101
CHECKSUM_MISMATCH = -3110


@pytest.fixture(params=["host_shm", "host_tcp"])
def pool(request, meta, stores):
    """(P, A, B): P provides the memory; A and B are pure clients (no segment of their own)."""
    proto = request.param
    return (stores(protocol=proto), stores(protocol=proto, init_bm=False),
            stores(protocol=proto, init_bm=False))


def test_save_and_load_layer_by_layer_across_processes(pool):
    """Scenario: A saves 6 blocks layer by layer and finishes; before the finish nothing is visible;
    B loads them layer by layer (and with batch_copy_layers) byte-exact; an ordinary get, which
    verifies the checksum, reads the same bytes (the checksum of a piecewise write is true)."""
    _, a, b = pool
    keys = [f"gva-{i}" for i in range(6)]
    saved = a("gva_save", keys=keys, layout=LAYOUT)
    assert saved["alloc"] == [0] * 6 and all(saved["gvas"]) and len(set(saved["gvas"])) == 6
    assert saved["copies"] == [0] * len(LAYOUT) and saved["finish"] == [0] * 6
    got = b("gva_load", keys=keys, layout=LAYOUT)
    assert got["sizes"] == [SIZE] * 6 and got["lease"] == [0] * 6 and got["unlease"] == 0
    assert got["copies"] == [0] * len(LAYOUT) and got["mismatches"] == []
    got = b("gva_load", keys=keys, layout=LAYOUT, layers=True)
    assert got["copies"] == [0] and got["mismatches"] == []
    plain = b("get", keys=keys, layout=LAYOUT)
    assert plain["codes"] == [0] * 6 and plain["mismatches"] == []


def _connects(*stores) -> int:
    """Connections the stores' clients opened to the MetaService so far."""
    return sum(s("connects")["connects"] for s in stores)


def _grants(meta) -> float:
    """Grant round trips the MetaService answered so far."""
    m = re.search(r'^memcache_request_seconds_count\{op="grant"\} (\S+)$', meta.http("/metrics"), re.M)
    return float(m.group(1)) if m else 0.0


def test_grants_last_and_checksums_follow_the_copies(meta, pool):
    """Scenario: A saves layer by layer and B loads layer by layer without one Grant round trip
    (writes are granted at batch_alloc, reads at batch_add_lease; finish writes only the header with
    the digest fed by the copies, or computed by the copy loop for a copy of the whole object).
    Layers written out of order, or one written twice with other
    bytes first, still get a true checksum (read back once at finish): an ordinary get reads them
    byte-exact. A byte flipped in the segment afterwards is caught by the reader (-3110, a miss)."""
    p, a, b = pool
    before, opened = _grants(meta), _connects(a, b)
    assert a("gva_save", keys=["g-0", "g-1"], layout=LAYOUT)["finish"] == [0, 0]
    got = b("gva_load", keys=["g-0", "g-1"], layout=LAYOUT)
    assert got["copies"] == [0] * len(LAYOUT) and got["mismatches"] == []
    # No Grant round trip, but one per connection a client opened meanwhile: a new connection voids
    # what was granted (it may be to a restarted MetaService), and under load a heartbeat holding the
    # only one makes a call open another.
    assert _grants(meta) - before <= _connects(a, b) - opened
    # negative control: a copy on no grant (the lease was removed) asks the MetaService, and is refused
    before = _grants(meta)
    assert b("gva_copy", gvas=[got["gvas"][0]], size=64, direct=G2H)["code"] == STATE_MISMATCH
    assert _grants(meta) == before + 1
    order = list(range(len(LAYOUT)))[::-1]
    assert a("gva_save", keys=["g-rev"], layout=LAYOUT, order=order)["finish"] == [0]
    assert a("gva_save", keys=["g-twice"], layout=LAYOUT, garbage_first=True)["finish"] == [0]
    assert a("gva_save", keys=["g-whole"], layout=LAYOUT, whole=True)["finish"] == [0]
    keys = ["g-0", "g-1", "g-rev", "g-twice", "g-whole"]
    plain = b("get", keys=keys, layout=LAYOUT)
    assert plain["codes"] == [0] * 5 and plain["mismatches"] == []
    for k in keys:
        loc = meta.http(f"/query_key?key={k}")["locations"][0]
        with mapped_segment(meta.segment(loc["segment"]).shm_path) as m:
            m[payload_offset(loc["offset"]) + SIZE - 100] ^= 0xFF
    assert b("get", keys=keys, layout=LAYOUT)["codes"] == [CHECKSUM_MISMATCH] * 5


def test_misuse_returns_a_code_and_corrupts_nothing(pool):
    """Scenario: every misuse of the GVA path is refused with a code: reading an unfinished object,
    a range past an object's end (into the next key's bytes), forged GVAs, writing into a finished
    object (its own or another's), reading without a lease or after removing it, finishing someone
    else's object, bad arguments. Afterwards every object still reads byte-exact."""
    _, a, b = pool
    assert a("gva_save", keys=["m-done"], layout=LAYOUT)["finish"] == [0]
    assert a("call", method="batch_alloc", args=[["m-pend", "m-next"], [SIZE, SIZE]])["result"] == [0, 0]
    # allocated, unfinished: invisible to everyone else, its key taken
    assert b("exist", keys=["m-pend"])["codes"] == [0]
    assert b("gva_info", keys=["m-pend"]) == {"sizes": [0], "gvas": [[]]}
    assert b("get", keys=["m-pend"], layout=LAYOUT)["codes"] == [NOT_EXISTS]
    assert b("call", method="batch_alloc", args=[["m-done", "m-pend"], [SIZE, SIZE]])["result"] == \
        [OBJECT_EXISTS, -3102]
    info = a("gva_info", keys=["m-pend", "m-next", "m-done"])
    assert info["sizes"] == [SIZE] * 3
    pend, nxt, done = (g[0] for g in info["gvas"])
    assert a("gva_copy", gvas=[pend], size=1024, direct=G2H)["code"] == STATE_MISMATCH   # out of unfinished
    for gva in (pend + SIZE - 512, nxt - 512):   # a range that runs past the end of m-pend
        assert a("gva_copy", gvas=[gva], size=1024, direct=H2G, fill=0x55)["code"] == INVALID_PARAM
    for forged in (12345, pend ^ (1 << 42), pend ^ (1 << 60), done + SIZE):
        assert a("gva_copy", gvas=[forged], size=64, direct=H2G, fill=0x55)["code"] in (INVALID_PARAM,
                                                                                        STATE_MISMATCH)
    # one refused range refuses the whole batch: the good one is not written either
    assert a("gva_copy", gvas=[nxt, done], size=64, direct=H2G, fill=0x55)["code"] == STATE_MISMATCH
    assert a("gva_copy", gvas=[done], size=1024, direct=H2G, fill=0x55)["code"] == STATE_MISMATCH
    b_done = b("gva_info", keys=["m-done"])["gvas"][0][0]
    assert b("gva_copy", gvas=[b_done], size=1024, direct=H2G, fill=0x55)["code"] == STATE_MISMATCH
    assert b("gva_copy", gvas=[b_done], size=1024, direct=G2H)["code"] == STATE_MISMATCH   # no lease
    assert b("gva_copy", gvas=[done], size=64, direct=G2H)["code"] in (INVALID_PARAM, STATE_MISMATCH)  # A's GVA
    assert b("call", method="batch_add_lease", args=[["m-done"], 60_000])["result"] == [0]
    leased = b("gva_copy", gvas=[b_done], size=1024, direct=G2H, fill=0xEE)
    assert leased["code"] == 0 and leased["values"] != [0xEE]
    assert b("call", method="batch_remove_lease", args=[["m-done"]])["result"] == 0
    assert b("gva_copy", gvas=[b_done], size=1024, direct=G2H)["code"] == STATE_MISMATCH   # lease removed
    assert b("call", method="batch_remove_lease", args=[["m-done"]])["result"] == NOT_EXISTS
    assert b("call", method="batch_write_finish", args=[["m-pend"], [0]])["result"] == [NOT_EXISTS]
    assert b("call", method="batch_add_lease", args=[["m-pend"], 0])["result"] == [NOT_EXISTS]
    assert a("gva_copy", gvas=[nxt], size=64, direct=9)["code"] == INVALID_PARAM
    assert a("call", method="batch_alloc", args=[["m-bad"], [0]])["result"] == [INVALID_PARAM]
    assert a("call", method="batch_alloc", args=[["m-bad"], [SIZE], 7])["result"] == [INVALID_PARAM]
    # an aborted object is gone; its key can be written again, and nothing was corrupted
    assert a("call", method="batch_write_finish", args=[["m-pend", "m-next"], [1, -1]])["result"] == [0, 0]
    assert b("exist", keys=["m-pend", "m-next"])["codes"] == [0, 0]
    assert a("gva_save", keys=["m-pend", "m-next"], layout=LAYOUT)["finish"] == [0, 0]
    got = b("gva_load", keys=["m-done", "m-pend", "m-next"], layout=LAYOUT)
    assert got["copies"] == [0] * len(LAYOUT) and got["mismatches"] == []
    plain = b("get", keys=["m-done", "m-pend", "m-next"], layout=LAYOUT)
    assert plain["codes"] == [0] * 3 and plain["mismatches"] == []


def test_copy_after_the_lease_expired_is_refused(pool):
    """Scenario: B leases for 300 ms and keeps reading; every read that succeeds is byte-exact, and
    once the lease has ended the copies are refused (a code, never stale bytes)."""
    _, a, b = pool
    assert a("gva_save", keys=["e-1"], layout=LAYOUT)["finish"] == [0]
    b("call", method="batch_add_lease", args=[["e-1"], 300])
    seen: list[int] = []

    def refused() -> bool:
        got = b("gva_load", keys=["e-1"], layout=LAYOUT, lease_ms=300, unlease=False) if not seen else \
            b("gva_copy", gvas=[seen[0]], size=1024, direct=G2H)
        if not seen:
            seen.append(got["gvas"][0])
            assert got["mismatches"] in ([], None)
            return False
        return got["code"] == STATE_MISMATCH

    wait_for(refused, 15, "B's copies to be refused once its lease ended")


def test_gva_from_before_a_meta_service_restart_is_refused(meta, stores):
    """Scenario: A holds the GVA of an unfinished object, B a leased GVA of a finished one; the
    MetaService restarts. Both copies are refused; the finished object is recovered byte-exact and
    the unfinished one is gone."""
    stores(protocol="host_tcp")
    a, b = stores(protocol="host_tcp", init_bm=False), stores(protocol="host_tcp", init_bm=False)
    assert a("gva_save", keys=["r-done"], layout=LAYOUT)["finish"] == [0]
    assert a("call", method="batch_alloc", args=[["r-pend"], [SIZE]])["result"] == [0]
    pend = a("gva_info", keys=["r-pend"])["gvas"][0][0]
    held = b("gva_load", keys=["r-done"], layout=LAYOUT, unlease=False)
    assert held["mismatches"] == []
    meta.kill()
    meta.start()
    wait_for(lambda: meta.http("/get_all_keys")["keys"] == ["r-done"], 15, "recovery of r-done")
    wait_for(lambda: all(x("exist", keys=["r-done"])["codes"] == [1] for x in (a, b)), 15,
             "A and B to reach the restarted MetaService")
    stale = (INVALID_PARAM, NOT_EXISTS, STATE_MISMATCH)   # which one: whether the client re-joined yet
    assert a("gva_copy", gvas=[pend], size=1024, direct=H2G, fill=0x55)["code"] in stale
    assert b("gva_copy", gvas=[held["gvas"][0]], size=1024, direct=G2H)["code"] in stale
    assert b("exist", keys=["r-pend"])["codes"] == [0]
    got = b("gva_load", keys=["r-done"], layout=LAYOUT)
    assert got["copies"] == [0] * len(LAYOUT) and got["mismatches"] == []


def test_objects_of_a_writer_that_dies_or_never_finishes_are_reclaimed():
    """Scenario: A allocates and writes half the layers of one object, then dies (kill -9); C
    allocates another and never finishes it. Neither is ever visible; each key is taken until its
    writer is declared dead or its pending deadline passes, then B writes and reads them byte-exact."""
    with running_meta_service(heartbeat_timeout_ms=1500, pending_timeout_ms=6000) as ms, \
            started(lambda **cfg: StoreProcess(ms, **cfg), StoreProcess.stop) as start:
        start()
        a, b, c = (start(init_bm=False) for _ in range(3))
        assert a("call", method="batch_alloc", args=[["dead"], [SIZE]])["result"] == [0]
        assert c("call", method="batch_alloc", args=[["idle"], [SIZE]])["result"] == [0]
        gva = a("gva_info", keys=["dead"])["gvas"][0][0]
        assert a("gva_copy", gvas=[gva], size=SIZE // 2, direct=H2G, fill=0x55)["code"] == 0
        a.kill()
        assert b("exist", keys=["dead", "idle"])["codes"] == [0, 0]
        wait_for(lambda: b("gva_save", keys=["dead"], layout=LAYOUT)["finish"] == [0], 20,
                 "the dead writer's object to be reclaimed")
        wait_for(lambda: b("gva_save", keys=["idle"], layout=LAYOUT)["finish"] == [0], 20,
                 "the unfinished object to pass its pending deadline")
        got = b("gva_load", keys=["dead", "idle"], layout=LAYOUT)
        assert got["copies"] == [0] * len(LAYOUT) and got["mismatches"] == []
