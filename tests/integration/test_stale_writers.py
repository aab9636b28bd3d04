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

import os
import threading

import numpy as np
import pytest

from memcache_core import H2G, DistributedObjectStore, LocalConfig
from memcache_core.testing import running_meta_service, started, wait_for
from tests.integration.stores import StoreProcess, answers_again

pytestmark = pytest.mark.integration

LAYER = 512 << 10
LAYOUT = [LAYER] * 8                 # 4 MiB in 8 layers
SIZE = sum(LAYOUT)
OLD_FILL = 0xA5                      # every byte the old writer copies
ROUNDS = int(os.environ.get("MEMCACHE_STALE_WRITER_ROUNDS", "10"))    # per protocol
# the old writer's heartbeat: the default (1 s); a slower one (3 s) leaves it unaware of the restart longer
WRITER_HEARTBEAT_MS = int(os.environ.get("MEMCACHE_STALE_WRITER_HEARTBEAT_MS", "1000"))


@pytest.fixture
def meta():
    with running_meta_service(heartbeat_timeout_ms=10_000, lease_ttl_ms=2000) as ms:
        yield ms


@pytest.fixture
def stores(meta):
    with started(lambda **cfg: StoreProcess(meta, **cfg), StoreProcess.stop) as start:
        yield start


def restart_and_put_anew(meta, p_id: int, newer: StoreProcess, key: str) -> None:
    """Kill and restart the MetaService; wait until P re-joined (with no object) and ``newer``'s put of
    ``key`` (4 MiB, into P: the only segment) is acknowledged."""
    meta.kill()
    meta.start()
    wait_for(lambda: newer("put", keys=[key], layout=LAYOUT)["codes"] == [0], 20,
             f"the put of {key} after the restart")
    segs = meta.http("/get_all_segments")["segments"]
    assert [s["segment_id"] for s in segs] == [p_id]


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
    objects; N's 4 MiB put succeeds into P (offset 0 again); W copies layers 1-7 through its old GVAs.
    W's copies are refused (never 0), and reader R (``checksum_verify_ratio: 0``) gets N's bytes
    exactly, or a miss."""
    p = stores(protocol=protocol, dram_size="32MB")
    p_id = p("id")["id"]
    w = stores(protocol=protocol, init_bm=False, heartbeat_interval_ms=WRITER_HEARTBEAT_MS)
    n = stores(protocol=protocol, init_bm=False)
    r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
    hits = 0
    for i in range(ROUNDS):
        old, new = f"old-{i}", f"new-{i}"
        assert w("call", method="batch_alloc", args=[[old], [SIZE]])["result"] == [0]
        gva = w("gva_info", keys=[old])["gvas"][0][0]
        assert w("gva_copy", gvas=[gva], size=LAYER, direct=H2G, fill=OLD_FILL)["code"] == 0
        restart_and_put_anew(meta, p_id, n, new)
        late = [w("gva_copy", gvas=[gva + j * LAYER], size=LAYER, direct=H2G, fill=OLD_FILL)["code"]
                for j in range(1, len(LAYOUT))]
        hits += assert_new_bytes_or_miss(r, new, f"round {i}")
        assert 0 not in late, f"round {i}: a copy granted before the restart landed after P re-joined: {late}"
        w("call", method="batch_write_finish", args=[[old], [1]])   # (refused: that life is gone)
        assert n("remove", keys=[new])["codes"] == [0]   # (P holds no object at the next restart)
    assert hits == ROUNDS   # the new objects were read, not merely missed


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_two_phase_put_across_a_restart_never_overwrites_a_new_object(meta, stores, protocol):
    """Scenario: writer W (in this process) allocates a 4 MiB put in P; before its copy starts, the
    MetaService is killed and restarted, P re-joins with 0 objects and N's 4 MiB put lands at the same
    offset and is acknowledged; then W's copy runs. W's put fails (nothing of it is visible), and
    reader R (``checksum_verify_ratio: 0``) reads N's bytes exactly."""
    p = stores(protocol=protocol, dram_size="32MB")
    p_id = p("id")["id"]
    n = stores(protocol=protocol, init_bm=False)
    r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
    w = DistributedObjectStore()
    assert w.setup(LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                               protocol=protocol, client_timeout_seconds=5)) == 0
    assert w.init(0, init_bm=False) == 0
    try:
        engine = w._service().engine   # fault injection: the copy starts only after the restart
        assert engine is not None
        real_write = engine.write
        once = threading.Event()

        def late_write(ops):
            if not once.is_set():
                once.set()
                restart_and_put_anew(meta, p_id, n, "new")
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

