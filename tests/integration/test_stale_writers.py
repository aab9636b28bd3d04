"""Writers of an earlier MetaService life never land in space allocated again since (docs/design.md,
"Failure of the MetaService": the segment's write fence, ``memcache_core/fence.py``).

The sequence: a writer is granted space in provider P's segment and copies part of an object; the
MetaService is killed and restarted; P re-joins reporting no object (it held only the unfinished
one), so the new MetaService may place a new object at the same offset at once; another client puts
one there and it is acknowledged; then the old writer goes on copying under its old grant. A reader
that skips checksum verification (``checksum_verify_ratio: 0``) must read the new object's bytes
exactly, or miss: never the old writer's.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np
import pytest

from memcache_core import H2G, DistributedObjectStore, LocalConfig, ReplicateConfig
from memcache_core.layout import payload_offset
from memcache_core.testing import running_meta_service, started, wait_for
from tests.integration.stores import StoreProcess, answers_again

pytestmark = pytest.mark.integration

LAYER = 512 << 10
LAYOUT = [LAYER] * 8                 # 4 MiB in 8 layers
SIZE = sum(LAYOUT)
OFFSET_MASK = (1 << 42) - 1          # a GVA's offset bits (local/gva.py)
OLD_FILL = 0xA5                      # every byte the old writer copies
ROUNDS = int(os.environ.get("MEMCACHE_STALE_WRITER_ROUNDS", "10"))    # per protocol
# the old writer's heartbeat: the default (1 s); a slower one (3 s) leaves it unaware of the restart longer
WRITER_HEARTBEAT_MS = int(os.environ.get("MEMCACHE_STALE_WRITER_HEARTBEAT_MS", "1000"))


@pytest.fixture
def meta():
    # (no eviction: the segment of the GVA test is full with two objects)
    with running_meta_service(heartbeat_timeout_ms=10_000, lease_ttl_ms=2000, evict_threshold_high=100,
                              evict_threshold_low=99) as ms:
        yield ms


@pytest.fixture
def stores(meta):
    with started(lambda **cfg: StoreProcess(meta, **cfg), StoreProcess.stop) as start:
        yield start


def restart_and_put_anew(meta, p_id: int, newer: StoreProcess, keys: list[str], preferred: list[int] | None = None,
                         segments: int = 1) -> list[int]:
    """Kill and restart the MetaService; wait until P re-joined (with no object: ``segments`` segments
    in all) and ``newer``'s put of ``keys`` (4 MiB each, into P) is acknowledged; where their headers
    lie in P."""
    meta.kill()
    meta.start()
    wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == segments, 20, "the segments to re-join")
    wait_for(lambda: newer("put", keys=keys, layout=LAYOUT, preferred=preferred)["codes"] == [0] * len(keys), 20,
             f"the put of {keys} after the restart")
    offsets = []
    for k in keys:
        at = [(loc["segment"], loc["offset"]) for loc in meta.http(f"/query_key?key={k}")["locations"]]
        assert [sid for sid, _ in at] == [p_id]
        offsets.append(int(at[0][1]))
    return offsets


def allocated(writer: StoreProcess, key: str) -> bool:
    return bool(writer("call", method="batch_alloc", args=[[key], [SIZE]])["result"] == [0])


def assert_new_bytes_or_miss(reader: StoreProcess, key: str, what: str) -> bool:
    """The reader (no checksum verification) reads ``key``'s own bytes or misses; True for a hit."""
    wait_for(lambda: answers_again(reader, key), 20, "the reader to reach the restarted MetaService")
    got = reader("get", keys=[key], layout=LAYOUT)
    assert got["mismatches"] == [], f"{what}: a reader got bytes that are not {key}'s with success"
    return bool(got["codes"] == [0])


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_gva_writer_of_an_earlier_meta_service_life_never_overwrites_a_new_object(meta, stores, protocol):
    """Scenario, ROUNDS times (``MEMCACHE_STALE_WRITER_ROUNDS``, default 10 per protocol): writer W
    (heartbeat ``MEMCACHE_STALE_WRITER_HEARTBEAT_MS``, default 1 s) ``batch_alloc``s a 4 MiB object in
    P and copies layer 0 of 8; the MetaService is killed and restarted; P re-joins reporting 0
    objects; N's put of two 4 MiB objects succeeds into P (room for two: one lands where W's object
    was); W copies layers 1-7 through its old GVAs. W's copies are refused (never 0), and reader R
    (``checksum_verify_ratio: 0``) gets N's bytes of the object W's space went to exactly, or a miss."""
    p = stores(protocol=protocol, dram_size="9MB")   # room for two 4 MiB objects, A and B
    p_id = p("id")["id"]
    w = stores(protocol=protocol, init_bm=False, heartbeat_interval_ms=WRITER_HEARTBEAT_MS)
    n = stores(protocol=protocol, init_bm=False)
    r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
    hits = 0
    for i in range(ROUNDS):
        old, new = f"old-{i}", [f"new-{i}-a", f"new-{i}-b"]
        # W's object lands where no read lease holds the space: A or B, the one R did not read last round
        wait_for(functools.partial(allocated, w, old), 15, f"room for {old}")
        gva = w("gva_info", keys=[old])["gvas"][0][0]
        assert w("gva_copy", gvas=[gva], size=LAYER, direct=H2G, fill=OLD_FILL)["code"] == 0
        offsets = [payload_offset(at) for at in restart_and_put_anew(meta, p_id, n, new)]   # in A and B
        assert gva & OFFSET_MASK in offsets   # one of them where W's object was
        late = [w("gva_copy", gvas=[gva + j * LAYER], size=LAYER, direct=H2G, fill=OLD_FILL)["code"]
                for j in range(1, len(LAYOUT))]
        hits += assert_new_bytes_or_miss(r, new[offsets.index(gva & OFFSET_MASK)], f"round {i}")
        assert 0 not in late, f"round {i}: a copy granted before the restart landed after P re-joined: {late}"
        w("call", method="batch_write_finish", args=[[old], [1]])   # (refused: that life is gone)
        assert n("remove", keys=new)["codes"] == [0, 0]   # (P holds no object at the next restart)
    assert hits == ROUNDS   # the new objects were read, not merely missed


def two_phase_parties(meta, stores, protocol):
    """Provider P (its segment id), N (puts the new object), reader R (``checksum_verify_ratio: 0``)
    and writer W, a pure client in this process."""
    p = stores(protocol=protocol, dram_size="32MB")
    n = stores(protocol=protocol, init_bm=False)
    r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
    w = DistributedObjectStore()
    assert w.setup(LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                               protocol=protocol, client_timeout_seconds=5)) == 0
    assert w.init(0, init_bm=False) == 0
    return p, p("id")["id"], n, r, w


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_two_phase_put_across_a_restart_never_overwrites_a_new_object(meta, stores, protocol):
    """Scenario: writer W (in this process) allocates a 4 MiB put in P; before its copy starts, the
    MetaService is killed and restarted, P re-joins with 0 objects and N's 4 MiB put lands at the same
    offset and is acknowledged; then W's copy runs. W's put fails (nothing of it is visible), and
    reader R (``checksum_verify_ratio: 0``) reads N's bytes exactly."""
    p, p_id, n, r, w = two_phase_parties(meta, stores, protocol)
    try:
        engine = w._service().engine   # fault injection: the copy starts only after the restart
        assert engine is not None
        real_write = engine.write
        once = threading.Event()

        def late_write(ops):
            if not once.is_set():
                once.set()
                assert restart_and_put_anew(meta, p_id, n, ["new"]) == [ops[0].offset]   # the same place
            return real_write(ops)

        engine.write = late_write   # type: ignore[method-assign]
        buf = np.full(SIZE, OLD_FILL, np.uint8)
        assert w.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert w.put_from("old", buf.ctypes.data, SIZE) != 0   # its commit is refused either way
        assert once.is_set()
        assert assert_new_bytes_or_miss(r, "new", "after the stale put")
        assert r("exist", keys=["old"])["codes"] == [0]
    finally:
        w.close()



def stalled_repair_copy(meta, stores, protocol, put_new) -> StoreProcess:
    """Holder H (in this process) holds the one replica of a 2-replica object; target T joins empty
    and H is asked to copy the object there (a repair); before H's copy starts, ``put_new(t, t_id,
    n)`` disrupts T's join and has N's 4 MiB put ``new`` land in T, returning its offset there; then
    H's copy runs. Asserts both were at the same place; returns reader R (``checksum_verify_ratio:
    0``) for the caller to read ``new`` with. (A drain's move is the same copy.)"""
    h = DistributedObjectStore()
    assert h.setup(LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                               protocol=protocol, dram_size="32MB", client_timeout_seconds=5,
                               heartbeat_interval_ms=200)) == 0
    assert h.init(0, init_bm=True) == 0
    try:
        buf = np.full(SIZE, OLD_FILL, np.uint8)
        assert h.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert h.put_from("old", buf.ctypes.data, SIZE, replicateConfig=ReplicateConfig(2, [])) == 0
        stalled = threading.Event()
        places: list[tuple[int, int]] = []   # (the new object's offset in T, the repair copy's)
        drainer = h._service().drainer   # fault injection: the repair's copy starts only after put_new
        make_engine = drainer._engine

        def late_engine(timeout_s):
            engine = make_engine(timeout_s)
            real_write = engine.write

            def late_write(ops):
                if ops and not stalled.is_set():
                    stalled.set()
                    places.append((put_new(t, t_id, n), ops[0].offset))
                return real_write(ops)

            engine.write = late_write   # type: ignore[method-assign]
            return engine

        drainer._engine = late_engine   # type: ignore[method-assign]
        t = stores(protocol=protocol, dram_size="32MB")
        t_id = t("id")["id"]
        n = stores(protocol=protocol, init_bm=False)
        r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
        wait_for(stalled.is_set, 30, "H's repair copy to T")
        wait_for(lambda: not [th for th in threading.enumerate() if th.name == "memcache-repair"], 30,
                 "H's repair copy to end")
        assert len(places) == 1 and places[0][0] == places[0][1], f"not the same place: {places}"
        return r
    finally:
        h.close()


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_repair_copy_across_a_restart_never_overwrites_a_new_object(meta, stores, protocol):
    """Scenario: a repair copy to T is granted; before it starts, the MetaService is killed and
    restarted, T re-joins with 0 objects and N's put lands in T at the same offset, acknowledged;
    then the copy runs. It is refused, and a reader without checksum verification reads N's bytes
    exactly (``stalled_repair_copy``)."""
    r = stalled_repair_copy(meta, stores, protocol, lambda t, t_id, n: restart_and_put_anew(
        meta, t_id, n, ["new"], preferred=[t_id], segments=2)[0])
    assert assert_new_bytes_or_miss(r, "new", "after the stale repair copy")
