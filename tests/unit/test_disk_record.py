"""The disk tier's record format and store (local/disk_record.py, local/disk.py), on real files."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import xxhash

from memcache_core.errors import ChecksumMismatch, ConfigError, KeyNotFound
from memcache_core.host import shm_dir
from memcache_core.layout import footprint, payload_offset
from memcache_core.local import disk_record as rec
from memcache_core.local.disk import DiskStore
from memcache_core.memory import Mapping
from memcache_core.protocol import ObjectReport
from memcache_core.testing import wait_for


@pytest.fixture
def segment():
    m = Mapping(os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(4)}"), 8 << 20, create=True)
    yield m
    m.close()


def put(m: Mapping, key: str, off: int, size: int, gen: int) -> ObjectReport:
    data = np.random.default_rng(gen).integers(0, 256, size, dtype=np.uint8)
    m.array()[payload_offset(off):payload_offset(off) + size] = data
    return ObjectReport(key, off, size, gen, xxhash.xxh3_64_intdigest(data.data))


def payload(store: DiskStore, r: ObjectReport) -> bytes:
    buf, view = store.read(r.key, r.size, r.checksum)
    out = bytes(view)
    view.release()
    buf.close()
    return out


def test_header_round_trip_and_every_damage_is_refused():
    h = rec.pack_header("käy", 7, 12345, 0xDEADBEEF)
    assert len(h) == rec.BLOCK and rec.unpack_header(h) == ("käy", 7, 12345, 0xDEADBEEF)
    for pos in (0, 9, 20, 40, 50, 300):                  # magic, version, generation, key, hash
        bad = bytearray(h)
        bad[pos] ^= 0x01
        assert rec.unpack_header(bytes(bad)) is None
    assert rec.unpack_header(h[:100]) is None
    assert rec.unpack_header(rec.pack_header("k", 1, 0, 1)) is None                 # size 0
    assert rec.unpack_header(rec.pack_header("k", 1, rec.MAX_RECORD_BYTES + 1, 1)) is None
    assert rec.footprint(1) == 2 * rec.BLOCK and rec.footprint(rec.BLOCK) == 2 * rec.BLOCK
    assert rec.name_of("a") != rec.name_of("b") and rec.name_of("a").endswith(".rec")


def test_records_are_written_read_found_again_and_verified(segment, tmp_path):
    store = DiskStore(str(tmp_path), 64 << 20)
    reps = [put(segment, f"k{i}", i * footprint(300_000) // 64 * 64 + 64 * i, 300_000, i + 1) for i in range(4)]
    assert store.offer(reps, segment) == 4
    wait_for(lambda: len(store.index) == 4, 10, "four records")
    want = {r.key: bytes(segment.view(payload_offset(r.offset), r.size)) for r in reps}
    assert all(payload(store, r) == want[r.key] for r in reps)
    added, dropped = store.take_changes()
    assert sorted(a.key for a in added) == sorted(want) and not dropped
    with pytest.raises(ConfigError, match="in use by another provider"):
        DiskStore(str(tmp_path), 64 << 20)
    store.close()
    again = DiskStore(str(tmp_path), 64 << 20)          # a restart: the headers are scanned
    assert sorted(r.key for r in again.reports()) == sorted(want)
    path = os.path.join(tmp_path, "objects", rec.name_of("k2"))
    with open(path, "r+b") as f:
        f.seek(rec.BLOCK + 5)
        b = f.read(1)
        f.seek(rec.BLOCK + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatch):
        payload(again, reps[2])
    assert again.counters.integrity_failures == 1 and not os.path.exists(path)
    assert [d.key for d in again.take_changes()[1]] == ["k2"]
    with pytest.raises(KeyNotFound):
        payload(again, reps[2])
    assert payload(again, reps[0]) == want["k0"]
    again.close()


def test_scan_removes_records_filed_under_another_key_and_torn_ones(segment, tmp_path):
    store = DiskStore(str(tmp_path), 64 << 20)
    reps = [put(segment, k, i << 20, 100_000, i + 1) for i, k in enumerate(("a", "b", "c"))]
    store.offer(reps, segment)
    wait_for(lambda: len(store.index) == 3, 10, "three records")
    store.close()
    objs = os.path.join(tmp_path, "objects")
    os.replace(os.path.join(objs, rec.name_of("a")), os.path.join(objs, rec.name_of("b")))  # a under b's name
    os.truncate(os.path.join(objs, rec.name_of("c")), rec.BLOCK + 10)                        # torn
    again = DiskStore(str(tmp_path), 64 << 20)
    assert again.reports() == [] and os.listdir(os.path.join(objs, rec.name_of("b")[:2])) == []
    again.close()


def test_a_full_tier_drops_its_least_recently_used_records(segment, tmp_path):
    size = 1 << 20
    store = DiskStore(str(tmp_path), 3 * rec.footprint(size))
    reps = [put(segment, f"k{i}", i * (footprint(size) + 64) // 64 * 64, size, i + 1) for i in range(5)]
    store.offer(reps[:3], segment)
    wait_for(lambda: len(store.index) == 3, 10, "three records")
    payload(store, reps[0])                               # k0 is now the most recently used
    store.offer(reps[3:], segment)
    wait_for(lambda: store.counters.writes == 5, 10, "five writes")
    assert list(store.index) == ["k0", "k3", "k4"] and store.used <= store.capacity
    assert sorted(d.key for d in store.take_changes()[1]) == ["k1", "k2"]
    store.drop([ObjectReport("k0", 0, size, 999), ObjectReport("k3", 0, size, 4)])   # compare-and-delete
    assert list(store.index) == ["k0", "k4"]
    store.close()


def test_a_copy_whose_dram_bytes_changed_is_not_written(segment, tmp_path):
    store = DiskStore(str(tmp_path), 64 << 20)
    r = put(segment, "k", 0, 4096, 1)
    segment.array()[payload_offset(0)] ^= 0xFF           # evicted and reused before the writer got to it
    store.offer([r], segment)
    wait_for(lambda: store.counters.writes_stale == 1, 10, "the stale copy refused")
    assert not store.index
    store.close()


def test_remove_deletes_the_record_drops_queued_copies_and_refuses_one_being_written(segment, tmp_path):
    """Scenario: objects leave the pool (the owner's journal): a written record is deleted before
    ``remove`` returns and is not found again after a restart; a queued copy is never written; a copy
    that reaches the writer after the removal (it was already being written) is not kept. Another
    generation of the same key is not touched."""
    store = DiskStore(str(tmp_path), 64 << 20, write_limit=16 << 10)   # 16 KiB/s: copies stay queued
    size = 256 << 10
    a, b, c = (put(segment, k, i * footprint(size), size, i + 1) for i, k in enumerate("abc"))
    assert store.offer([a, b], segment) == 2
    wait_for(lambda: "a" in store.index and store.queued_bytes == size, 10, "the first record, the second queued")
    store.remove([a, b])
    assert not store.index and store.queued_bytes == 0
    assert not os.path.exists(os.path.join(tmp_path, "objects", rec.name_of("a")))
    store.close()
    store = DiskStore(str(tmp_path), 64 << 20)
    assert store.reports() == []
    store.remove([ObjectReport("c", 0, size, c.generation + 1, 0)])   # another write of "c"
    store.remove([a])
    assert store.offer([a, c], segment) == 2                          # "a" as if already in flight
    wait_for(lambda: "c" in store.index and store.queued_bytes == 0, 10, "the writer to finish")
    assert sorted(store.index) == ["c"] and sorted(r.key for r in store.reports()) == ["c"]
    assert not os.path.exists(os.path.join(tmp_path, "objects", rec.name_of("a")))
    store.close()
