"""No wrong bytes: a reader stalled across a MetaService restart, and a writer stalled past its pending
deadline, never make a success code carry another object's (or stale) bytes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from memcache_core import DistributedObjectStore, errors
from memcache_core import protocol as p
from memcache_core.layout import HEADER_BYTES
from memcache_core.rpc import expect
from memcache_core.testing import mapped_segment, running_meta_service, wait_for
from tests.integration.stores import stalled_reads

pytestmark = pytest.mark.integration

SIZE = 64 << 10


def _store(ms, device: int, init_bm: bool, **cfg) -> DistributedObjectStore:
    s = DistributedObjectStore()
    assert s.setup(ms.local_config(heartbeat_interval_ms=200, **cfg)) == 0
    assert s.init(device, init_bm) == 0
    return s


def test_reader_stalled_across_a_meta_service_restart_never_gets_another_objects_bytes():
    """Scenario: a reader looks K up (leased) and stalls; meanwhile the MetaService is killed (-9) and
    restarted, the owner re-joins and reports K unleased, K is removed and J is put into its space.
    The reader verifies no checksums, so only the lease grace of a recovered segment and the
    validation of a read that outlived its lease stand between it and J's bytes: it gets a miss."""
    with running_meta_service(lease_ttl_ms=2000, heartbeat_timeout_ms=10_000) as ms:   # the owner must not be declared dead
        owner = _store(ms, 0, True, dram_size="4MB")
        reader = _store(ms, 1, False, checksum_verify_ratio=0.0)
        try:
            assert owner.put("K", b"k" * SIZE) == 0
            k_loc = ms.http("/query_key?key=K")["locations"]
            landed: dict[str, float] = {}

            def meanwhile() -> None:
                ms.kill()
                ms.start()
                rejoined = time.monotonic()
                wait_for(lambda: owner.is_exist("K") == 1, 15, "the owner's re-join")
                assert owner.remove("K") == 0
                wait_for(lambda: owner.put("J", b"j" * SIZE) == 0, 15, "J to fit")
                landed["after_s"] = time.monotonic() - rejoined
                landed["same_space"] = ms.http("/query_key?key=J")["locations"] == k_loc

            dst = np.zeros(SIZE, np.uint8)
            assert reader.register_buffer(dst.ctypes.data, dst.nbytes) == 0
            with stalled_reads(reader, meanwhile):
                rc = reader.get_into("K", dst.ctypes.data, SIZE)
            assert rc != 0, "a success code for K after its space went to J"
            # (the stalled copy did move J's bytes into dst: a failed get leaves its buffer undefined,
            # what matters is that no success code ever vouches for them)
            assert landed["same_space"]                 # the space really was reused ...
            assert landed["after_s"] >= 1.9             # ... only once an old lease would have ended
            got = np.zeros(SIZE, np.uint8)
            assert reader.register_buffer(got.ctypes.data, got.nbytes) == 0
            assert reader.get_into("J", got.ctypes.data, SIZE) == 0 and bytes(got) == b"j" * SIZE
        finally:
            reader.close()
            owner.close()


def test_late_writer_bytes_in_reclaimed_and_reused_space_are_a_miss():
    """Scenario: a writer allocates ``late`` and stalls past ``pending_timeout_ms``; the MetaService
    reclaims the space, keeps it out of use until the owner rotated its write fence, then gives it to
    ``other``, which is put and committed. Bytes that reach that space past the fence (written
    through a mapping of the segment, as a process of the host could) and the late writer's commit
    follow. The commit is refused and readers of ``other`` get a miss (-3110), never the late bytes;
    a re-put of ``other`` reads back byte-exact. (A late copy through the fence is refused by it:
    tests/integration/test_stale_writers_reclaim.py.)"""
    with running_meta_service(pending_timeout_ms=300, lease_ttl_ms=500, heartbeat_timeout_ms=10_000) as ms:   # no death
        owner = _store(ms, 0, True, dram_size="4MB")
        reader = _store(ms, 1, False)
        try:
            svc = owner._service()
            assert svc.segment is not None
            a = expect(svc.rpc.call(p.Alloc(svc.client_id, svc.session.token, ["late"], [SIZE])),
                       p.AllocReply).results[0]
            assert a.code == 0
            late_off = a.locations[0].offset
            wait_for(lambda: ms.http("/api/v1/stats")["counters"]["pending_reclaimed"] == 1, 10, "the reclaim")
            # (a put meanwhile could fail with -3101: its grant would cross the rotation)
            wait_for(lambda: ms.metric("fence_rotations_total") == 1 and ms.metric("fenced_bytes") == 0, 10,
                     "the owner's fence rotation, which frees the reclaimed space")
            assert ms.http("/api/v1/capacity/usage")["used_bytes"] == 0
            assert owner.put("other", b"o" * SIZE) == 0
            assert ms.http("/query_key?key=other")["locations"][0]["offset"] == late_off
            with mapped_segment(svc.segment.path) as m:     # the stalled writer's copy lands now
                start = late_off + HEADER_BYTES
                m[start:start + SIZE] = b"L" * SIZE
            codes = expect(svc.rpc.call(p.Commit(svc.client_id, svc.session.token, ["late"], [a.generation])),
                           p.Codes).codes
            assert codes == [errors.STATE_MISMATCH]
            dst = np.zeros(SIZE, np.uint8)
            assert reader.register_buffer(dst.ctypes.data, dst.nbytes) == 0
            assert reader.get_into("other", dst.ctypes.data, SIZE) == errors.CHECKSUM_MISMATCH
            assert reader.get("other") == b""                  # reported and dropped: a miss from now on
            assert reader.is_exist("late") == 0
            assert owner.put("other", b"o" * SIZE) == 0
            assert reader.get_into("other", dst.ctypes.data, SIZE) == 0 and bytes(dst) == b"o" * SIZE
        finally:
            reader.close()
            owner.close()
