"""A writer frozen past ``pending_timeout_ms`` never lands in the space its reclaimed grant was given
to (docs/design.md, "Cleanup of half-written objects" and "Failure of the MetaService": a reclaimed
range is quarantined until the segment's owner rotated its write fence to a new token).

The sequence, without any re-join or restart: writer W is granted space in provider P's segment and
passes its own deadline check (it starts copying before half of ``pending_timeout_ms``); it stops
right there: a writer process stops itself (SIGSTOP) from a hook in its transfer engine that runs
after every check, before a byte moves (``stop_before_write`` of the store worker), or a writer in
this process stalls in that hook (a hung engine). The MetaService reclaims the pending
grant at its deadline; another client's put lands at the same offset and is acknowledged; then W's
copy runs. A reader that skips checksum verification (``checksum_verify_ratio: 0``) must read the
new object's bytes exactly, and a reader that verifies must find it (a checksum failure would drop
the acknowledged object: data lost).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from memcache_core import H2G
from memcache_core.layout import payload_offset
from memcache_core.testing import die_with_parent, running_meta_service, started, wait_for
from tests.integration.stores import StoreProcess
from tests.integration.test_frozen_peer import stopped
from tests.integration.test_held_segment import INSIDER, segments
from tests.integration.test_stale_writers import (
    LAYOUT,
    OLD_FILL,
    SIZE,
    stalled_repair_copy,
    two_phase_parties,
)

pytestmark = pytest.mark.integration

PENDING_MS = 1500       # W's grant is reclaimed this long after it was made
OFFSET_MASK = (1 << 42) - 1          # a GVA's offset bits (local/gva.py)


@pytest.fixture
def meta():
    # a short pending deadline and lease (without fence rotations a reclaimed range came back after
    # the lease, at least 1 s); no eviction: P holds one object at a time, so the new one lands where W's was
    with running_meta_service(heartbeat_timeout_ms=1500, lease_ttl_ms=500, pending_timeout_ms=PENDING_MS,
                              evict_threshold_high=100, evict_threshold_low=99) as ms:
        yield ms


@pytest.fixture
def stores(meta):
    with started(lambda **cfg: StoreProcess(meta, **cfg), StoreProcess.stop) as start:
        yield start


def free(meta, sid: int) -> bool:
    """Segment ``sid`` holds nothing (W's reclaimed range is back in its allocator)."""
    return any(int(s["segment_id"]) == sid and s["used_bytes"] == 0 for s in meta.http("/get_all_segments")["segments"])


def put_where_reclaimed(meta, n: StoreProcess, sid: int, key: str) -> int:
    """Once the pending grant in ``sid`` was reclaimed and its space is free again, N puts ``key`` there
    (acknowledged); its offset in ``sid`` (-1 elsewhere)."""
    wait_for(lambda: free(meta, sid), 30, f"the reclaimed range of segment {sid} to be free")
    wait_for(lambda: n("put", keys=[key], layout=LAYOUT, preferred=[sid])["codes"] == [0], 30, f"the put of {key}")
    at = meta.http(f"/query_key?key={key}")["locations"]
    return int(at[0]["offset"]) if at[0]["segment"] == sid else -1


def read_back(stores, protocol: str, key: str) -> None:
    """The acknowledged ``key`` reads back byte-exact without verification, then with it (a checksum
    failure there would drop the object from the pool)."""
    r = stores(protocol=protocol, init_bm=False, checksum_verify_ratio=0)
    unverified = r("get", keys=[key], layout=LAYOUT)
    v = stores(protocol=protocol, init_bm=False)
    verified = v("get", keys=[key], layout=LAYOUT)
    assert unverified["mismatches"] == [], f"a reader got the stale writer's bytes with success ({verified=})"
    assert unverified["codes"] == [0], f"the acknowledged object was not read: {unverified}"
    assert verified["codes"] == [0] and verified["mismatches"] == [], f"the acknowledged object was lost: {verified}"
    assert v("exist", keys=[key])["codes"] == [1]   # (1: it exists)


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_two_phase_put_frozen_past_its_deadline_never_overwrites_the_space_given_to_another(meta, stores, protocol):
    """Scenario: W (in this process) allocates a 4 MiB put in P, passes its deadline check and stalls
    before its copy; the MetaService reclaims the put, N's put lands in P at the same offset and is
    acknowledged; then W's copy runs. W's put fails, and N's object reads back byte-exact."""
    p, p_id, n, _, w = two_phase_parties(meta, stores, protocol)
    try:
        engine = w._service().engine   # fault injection: W stalls after its deadline check, before its copy
        assert engine is not None
        real_write = engine.write
        places: list[tuple[int, int]] = []

        def late_write(ops):
            if not places:
                places.append((put_where_reclaimed(meta, n, p_id, "new"), ops[0].offset))
            return real_write(ops)

        engine.write = late_write   # type: ignore[method-assign]
        buf = np.full(SIZE, OLD_FILL, np.uint8)
        assert w.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        put = w.put_from("old", buf.ctypes.data, SIZE)
        engine.write = real_write   # type: ignore[method-assign]
        assert len(places) == 1 and places[0][0] == places[0][1], f"not the same place: {places}"
        read_back(stores, protocol, "new")
        assert put != 0, "a put whose grant was reclaimed was acknowledged"
    finally:
        w.close()


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_repair_copy_frozen_past_its_deadline_never_overwrites_the_space_given_to_another(meta, stores, protocol):
    """Scenario: a repair copy to T is granted; H passes its deadline check and stalls before the copy;
    the MetaService gives the reservation back at its deadline, N's put lands in T at the same offset
    and is acknowledged; then the copy runs. N's object reads back byte-exact (``stalled_repair_copy``)."""
    done = threading.Event()

    def reclaimed_and_put_anew(t: StoreProcess, t_id: int, n: StoreProcess) -> int:
        at = put_where_reclaimed(meta, n, t_id, "new")
        done.set()
        return at

    stalled_repair_copy(meta, stores, protocol, reclaimed_and_put_anew)
    assert done.is_set()
    read_back(stores, protocol, "new")


def stopped_writer(stores, protocol: str, begin) -> StoreProcess:
    """Writer W in a process of its own, which stops itself (SIGSTOP) in the write ``begin(w)`` starts,
    after every check of its own, before a byte moves; returned once every thread of it is stopped."""
    w = stores(protocol=protocol, init_bm=False)
    w("stop_before_write")
    begin(w)
    wait_for(lambda: stopped(w.proc.pid), 10, "the writer to stop itself before its copy")
    return w


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_a_stopped_writer_process_past_its_deadline_never_overwrites_the_space_given_to_another(meta, stores,
                                                                                                protocol):
    """Scenario: W's two-phase put of a 4 MiB object into P stops (SIGSTOP) right before its copy; the
    MetaService reclaims it (its deadline passed, and W falls silent past the heartbeat timeout), N's
    put lands in P at the same offset and is acknowledged; W is resumed (SIGCONT) and copies. W's put
    fails, and N's object reads back byte-exact."""
    p = stores(protocol=protocol, dram_size="32MB")
    p_id = p("id")["id"]
    n = stores(protocol=protocol, init_bm=False)
    w = stopped_writer(stores, protocol, lambda w: w.begin("put", keys=["old"], layout=LAYOUT))
    try:
        at = put_where_reclaimed(meta, n, p_id, "new")
    finally:
        w.proc.send_signal(signal.SIGCONT)
    assert w.end()["codes"] != [0], "a put whose grant was reclaimed was acknowledged"
    assert w("stopped_at")["offsets"] == [at], "not the same place"
    read_back(stores, protocol, "new")


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_a_stopped_gva_writer_past_its_deadline_never_overwrites_the_space_given_to_another(meta, stores, protocol):
    """Scenario: W ``batch_alloc``s a 4 MiB object in P and its first ``batch_copy`` into it stops
    (SIGSTOP) within the write grant it holds, right before the copy; the MetaService reclaims the
    object, N's put lands in P at the same offset and is acknowledged; W is resumed and copies. The
    copy is refused (never 0), and N's object reads back byte-exact."""
    p = stores(protocol=protocol, dram_size="32MB")
    p_id = p("id")["id"]
    n = stores(protocol=protocol, init_bm=False)
    gvas: list[int] = []

    def alloc_and_copy(w: StoreProcess) -> None:
        assert w("call", method="batch_alloc", args=[["old"], [SIZE]])["result"] == [0]
        gvas.append(w("gva_info", keys=["old"])["gvas"][0][0])
        w.begin("gva_copy", gvas=gvas, size=LAYOUT[0], direct=H2G, fill=OLD_FILL)

    w = stopped_writer(stores, protocol, alloc_and_copy)
    try:
        at = put_where_reclaimed(meta, n, p_id, "new")
    finally:
        w.proc.send_signal(signal.SIGCONT)
    assert w.end()["code"] != 0, "a copy under a reclaimed grant landed"
    assert gvas[0] & OFFSET_MASK == payload_offset(at), "not the same place"
    read_back(stores, protocol, "new")


def test_a_rotation_that_a_writer_frozen_mid_copy_holds_up_keeps_the_segment_held_until_it_ends(meta, stores):
    """Scenario: a process holds P's fence page's shared lock with the current token, as a writer frozen
    in the middle of its copy does (the insider of ``test_held_segment``); W's put into P stops before
    its copy and is reclaimed. P cannot rotate its fence within ``fence_wait_ms``: it is held (nothing
    new goes there, its reclaimed range stays out of use, ``memcache_fenced_bytes`` says how much) while
    the insider writes over that range (harmless: it is nobody's). Once the insider lets go, P rotates,
    the range is free and N's put lands there; W's copy, resumed, is refused."""
    p = stores(dram_size="32MB", fence_wait_ms=500)
    p_id = p("id")["id"]
    stores(dram_size="32MB")                     # Q: where puts go while P is held
    n = stores(init_bm=False)
    info = meta.segment(p_id)
    insider = subprocess.Popen([sys.executable, "-c", INSIDER, info.shm_path, str(info.size)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, bufsize=1, preexec_fn=die_with_parent())
    w = None
    try:
        assert insider.stdout is not None and insider.stdin is not None
        assert insider.stdout.readline().strip() == "locked"
        w = stopped_writer(stores, "host_shm", lambda w: w.begin("put", keys=["old"], layout=LAYOUT, preferred=[p_id]))
        wait_for(lambda: segments(meta)[p_id]["held"], 10, "P to be held by the frozen writer")
        assert segments(meta)[p_id]["used_bytes"] > 0 and meta.metric("fenced_bytes") > 0
        assert n("put", keys=["while-held"], layout=LAYOUT, preferred=[p_id])["codes"] == [0]
        assert meta.http("/query_key?key=while-held")["locations"][0]["segment"] != p_id
        insider.stdin.write(f"[[0, {SIZE + 4096}]]\n")   # the frozen writer's copy goes on, over its range
        assert insider.stdout.readline().strip() == "written"
        insider.stdin.write("release\n")
        assert insider.stdout.readline().strip() == "released"
        at = put_where_reclaimed(meta, n, p_id, "new")
        assert not segments(meta)[p_id]["held"] and meta.metric("fenced_bytes") == 0
        assert meta.metric("fence_rotations_total") >= 1
    finally:
        insider.kill()
        insider.wait()
        if w is not None:
            w.proc.send_signal(signal.SIGCONT)
    assert w.end()["codes"] != [0], "a put whose grant was reclaimed was acknowledged"
    assert w("stopped_at")["offsets"] == [at], "not the same place"
    read_back(stores, "host_shm", "new")
