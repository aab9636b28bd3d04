"""Writers granted space before a provider was declared dead never land in that space once the
provider re-joined the *same* MetaService (docs/design.md, "Failure of the MetaService": the fence
holds the token of the segment's join, ``memcache_core/fence.py``).

The sequence: writer W is granted space in provider P's segment and stalls before its copy; P is
frozen (SIGSTOP) past ``heartbeat_timeout_ms``, the MetaService declares it dead and drops its
segment's allocations; P is thawed, re-joins the same MetaService (the same epoch) reporting no
object; another client's put lands at the same offset and is acknowledged; then W's copy runs under
its old grant. A reader that skips checksum verification (``checksum_verify_ratio: 0``) must read
the new object's bytes exactly, or miss: never W's.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from memcache_core import H2G
from memcache_core.layout import payload_offset
from memcache_core.testing import running_meta_service, started, wait_for
from tests.integration.stores import StoreProcess
from tests.integration.test_stale_writers import stalled_repair_copy, two_phase_parties

pytestmark = pytest.mark.integration

LAYOUT = [512 << 10] * 8             # 4 MiB in 8 layers
SIZE = sum(LAYOUT)
OLD_FILL = 0xA5                      # every byte the old writer copies
OFFSET_MASK = (1 << 42) - 1          # a GVA's offset bits (local/gva.py)
ROUNDS = int(os.environ.get("MEMCACHE_REJOIN_WRITER_ROUNDS", "2"))    # per protocol


@pytest.fixture
def meta():
    with running_meta_service(heartbeat_timeout_ms=1500, lease_ttl_ms=2000) as ms:
        yield ms


@pytest.fixture
def stores(meta):
    with started(lambda **cfg: StoreProcess(meta, **cfg), StoreProcess.stop) as start:
        yield start


def segment_ids(meta) -> list[int]:
    return sorted(int(s["segment_id"]) for s in meta.http("/get_all_segments")["segments"])


def empty(meta, p_id: int) -> bool:
    """P's space is all free (the last round's object removed and its read lease ended)."""
    return any(int(s["segment_id"]) == p_id and s["used_bytes"] == 0 for s in meta.http("/get_all_segments")["segments"])


def declare_dead_and_rejoin(meta, p: StoreProcess, p_id: int) -> None:
    """Freeze P past the heartbeat timeout, wait for the MetaService to drop its segment, thaw it and
    wait for its re-join (the same id, the same MetaService)."""
    epoch = meta.http("/health")["epoch"]
    p.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: p_id not in segment_ids(meta), 20, "P to be declared dead")
    finally:
        p.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: p_id in segment_ids(meta), 20, "P to re-join")
    assert meta.http("/health")["epoch"] == epoch   # the same MetaService life


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_two_phase_put_across_a_provider_rejoin_never_overwrites_a_new_object(meta, stores, protocol):
    """Scenario, ROUNDS times (``MEMCACHE_REJOIN_WRITER_ROUNDS``, default 2 per protocol): writer W (in
    this process) allocates a 4 MiB put in P; before its copy starts, P is declared dead and re-joins
    the same MetaService with 0 objects, and N's 4 MiB put lands at the same offset and is
    acknowledged; then W's copy runs. W's put fails, and reader R (``checksum_verify_ratio: 0``)
    reads N's bytes exactly."""
    p, p_id, n, r, w = two_phase_parties(meta, stores, protocol)
    try:
        engine = w._service().engine   # fault injection: the copy starts only after P's re-join
        assert engine is not None
        real_write = engine.write
        buf = np.full(SIZE, OLD_FILL, np.uint8)
        assert w.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        for i in range(ROUNDS):
            new = f"new-{i}"
            wait_for(lambda: empty(meta, p_id), 10, "P's space to be free")   # (so N's put lands where W's was)
            places: list[tuple[int, int]] = []

            def late_write(ops, new=new, places=places):
                if not places:
                    declare_dead_and_rejoin(meta, p, p_id)
                    wait_for(lambda: n("put", keys=[new], layout=LAYOUT)["codes"] == [0], 20, f"the put of {new}")
                    at = meta.http(f"/query_key?key={new}")["locations"]
                    places.append((int(at[0]["offset"]), ops[0].offset))
                return real_write(ops)

            engine.write = late_write   # type: ignore[method-assign]
            put = w.put_from(f"old-{i}", buf.ctypes.data, SIZE)
            engine.write = real_write   # type: ignore[method-assign]
            assert len(places) == 1 and places[0][0] == places[0][1], f"round {i}: not the same place: {places}"
            got = r("get", keys=[new], layout=LAYOUT)
            assert got["mismatches"] == [], f"round {i}: a reader got the stale writer's bytes with success"
            assert got["codes"] == [0], f"round {i}: the new object was not read: {got}"
            assert put != 0, f"round {i}: a put granted before P's re-join was acknowledged"
            assert r("exist", keys=[f"old-{i}"])["codes"] == [0]
            assert n("remove", keys=[new])["codes"] == [0]   # (P holds no object at the next round)
    finally:
        w.close()


@pytest.fixture
def long_grants():
    # a GVA write grant lasts up to lease_ttl_ms: longer than P's freeze here, so W's copies after P's
    # re-join run under the grant it holds (no Grant round trip, which the MetaService would refuse)
    with running_meta_service(heartbeat_timeout_ms=1500, lease_ttl_ms=10_000, evict_threshold_high=100,
                              evict_threshold_low=99) as ms:
        yield ms


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_gva_writer_across_a_provider_rejoin_never_overwrites_a_new_object(long_grants, protocol):
    """Scenario: writer W ``batch_alloc``s a 4 MiB object in P and copies layer 0 of 8 through its GVA;
    P is declared dead and re-joins the same MetaService with 0 objects; N's put of two 4 MiB objects
    succeeds into P (room for two: one lands where W's object was); W copies layers 1-7 under the
    grant it still holds. W's copies are refused (never 0), and reader R (``checksum_verify_ratio:
    0``) reads N's bytes of the object W's space went to exactly."""
    meta = long_grants
    with started(lambda **cfg: StoreProcess(meta, **cfg), StoreProcess.stop) as stores:
        p = stores(protocol=protocol, dram_size="9MB")
        p_id = p("id")["id"]
        w = stores(protocol=protocol, init_bm=False)
        n = stores(protocol=protocol, init_bm=False)
        r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
        assert w("call", method="batch_alloc", args=[["old"], [SIZE]])["result"] == [0]
        gva = w("gva_info", keys=["old"])["gvas"][0][0]
        assert w("gva_copy", gvas=[gva], size=LAYOUT[0], direct=H2G, fill=OLD_FILL)["code"] == 0
        declare_dead_and_rejoin(meta, p, p_id)
        new = ["new-a", "new-b"]
        wait_for(lambda: n("put", keys=new, layout=LAYOUT)["codes"] == [0, 0], 20, "the puts into P")
        offsets = [payload_offset(int(meta.http(f"/query_key?key={k}")["locations"][0]["offset"])) for k in new]
        assert gva & OFFSET_MASK in offsets   # one of them where W's object was
        late = [w("gva_copy", gvas=[gva + j * LAYOUT[0]], size=LAYOUT[0], direct=H2G, fill=OLD_FILL)["code"]
                for j in range(1, len(LAYOUT))]
        got = r("get", keys=[new[offsets.index(gva & OFFSET_MASK)]], layout=LAYOUT)
        assert got["mismatches"] == [], "a reader got the stale GVA writer's bytes with success"
        assert got["codes"] == [0]
        assert 0 not in late, f"a GVA copy granted before P's re-join landed after it: {late}"


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_repair_copy_across_a_target_rejoin_never_overwrites_a_new_object(meta, stores, protocol):
    """Scenario: a repair copy to T is granted; before it starts, T is declared dead and re-joins the
    same MetaService with 0 objects, and N's put lands in T at the same offset, acknowledged; then the
    copy runs. It is refused, and a reader without checksum verification reads N's bytes exactly
    (``stalled_repair_copy``)."""
    def rejoin_and_put_anew(t: StoreProcess, t_id: int, n: StoreProcess) -> int:
        declare_dead_and_rejoin(meta, t, t_id)
        wait_for(lambda: n("put", keys=["new"], layout=LAYOUT, preferred=[t_id])["codes"] == [0], 20, "the put into T")
        at = meta.http("/query_key?key=new")["locations"]
        return int(at[0]["offset"]) if at[0]["segment"] == t_id else -1

    got = stalled_repair_copy(meta, stores, protocol, rejoin_and_put_anew)("get", keys=["new"], layout=LAYOUT)
    assert got["mismatches"] == [], "a reader got the stale repair copy's bytes with success"
    assert got["codes"] == [0]
