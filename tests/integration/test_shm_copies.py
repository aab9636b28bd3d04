"""Shared-memory copies split over copy threads, with real processes on host_shm, through both loops:
the native one (transfer/native.py, shmloop.py) and the pure-Python one (shmcopy.py).

Every get is compared byte for byte with what was put, and the bytes between and after the pieces of
the destination must stay untouched. Checksums are on (the default), so an op cut between threads is
also proven to hash its bytes in order: otherwise its reads would fail as corrupt. Objects written
through one loop are read through the other: the checksums are the same.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from memcache_core import DistributedObjectStore, errors
from memcache_core.layout import payload_offset
from memcache_core.testing import MetaServiceProcess
from tests.integration.stores import DSR1_LAYOUT

LAYOUTS = {
    # name: (piece sizes, gap after each piece in the caller's buffer, objects per batch)
    "layered, scattered": (DSR1_LAYOUT, 64, 3),          # odd batch: one object cut between two threads
    "layered, touching": (DSR1_LAYOUT, 0, 2),            # pieces merged into one run per object
    "one large piece": ([8_994_817], 0, 1),              # one object cut in parts, odd tail (Python loop)
    "one object over 16 MiB": ([(9 << 20) + 1, (7 << 20) + 77_777], 5, 1),   # cut in ranges (native loop)
    "many small pieces": ([700] * 2000, 1, 1),           # 2,000 pieces of 700 bytes
    "around page boundaries": ([1, 4095, 4097, 8191, 65537, 131071] * 12, 3, 2),
}


def _check(reader: Any, keys: list[str], layout: list[int], gap: int) -> None:
    r = reader("get", keys=keys, layout=layout, gap=gap)
    assert r["codes"] == [0] * len(keys) and r["mismatches"] == []


LOOPS = ["native", "python"]


@pytest.mark.parametrize("loop", LOOPS)
def test_threaded_copies_are_byte_exact(stores: Any, loop: str) -> None:
    other = LOOPS[1 - LOOPS.index(loop)]
    writer = stores(shm_copy_threads=2, shm_copy_loop=loop)
    readers = [stores(init_bm=False, shm_copy_threads=n, shm_copy_loop=loop) for n in (1, 2, 3)]
    readers.append(stores(init_bm=False, shm_copy_threads=2, shm_copy_loop=other))
    for name, (layout, gap, batch) in LAYOUTS.items():
        keys = [f"{name}/{i}" for i in range(batch)]
        r = writer("put", keys=keys, layout=layout, gap=gap)
        assert r["codes"] == [0] * batch, name
        for reader in readers:
            _check(reader, keys, layout, gap)
        _check(writer, keys, layout, gap)                # its own segment, threaded too


@pytest.mark.parametrize(("threads", "loop"), [(1, "native"), (3, "native"), (3, "python")])
def test_threaded_puts_are_read_back_by_any_thread_count(stores: Any, threads: int, loop: str) -> None:
    """Objects written with one thread count and read with another carry the same checksum."""
    writer = stores(shm_copy_threads=threads, shm_copy_loop=loop)
    reader = stores(init_bm=False, shm_copy_threads=2, shm_copy_loop=loop)
    layout, gap, batch = LAYOUTS["layered, scattered"]
    keys = [f"t{threads}/{i}" for i in range(batch)]
    assert writer("put", keys=keys, layout=layout, gap=gap)["codes"] == [0] * batch
    _check(reader, keys, layout, gap)
    _check(reader, keys[:1], layout, gap)                # one object: the Python loop cuts it in two


@pytest.mark.parametrize(("threads", "loop"), [(1, "native"), (2, "native"), (3, "native"), (1, "python"),
                                               (2, "python")])
def test_a_corrupt_byte_in_any_part_is_a_miss(meta: MetaServiceProcess, threads: int, loop: str) -> None:
    """One object, one large piece (over 16 MiB, so both loops cut it between threads): a byte flipped
    in the segment, in the first or the last part, fails the get (-3110)."""
    owner, reader = DistributedObjectStore(), DistributedObjectStore()
    assert owner.setup(meta.local_config(dram_size="64MB")) == 0 and owner.init(0, init_bm=True) == 0
    assert reader.setup(meta.local_config(shm_copy_threads=threads, shm_copy_loop=loop)) == 0
    assert reader.init(1, init_bm=False) == 0
    try:
        size = 17 * (1 << 20) + 12345
        dst = np.zeros(size, np.uint8)
        assert reader.register_buffer(dst.ctypes.data, size) == 0
        seg = owner._service().segment
        assert seg is not None
        for n, at in enumerate((17, size - 3)):
            data = os.urandom(size)
            assert owner.put(f"k{n}", data) == 0
            assert reader.get_into(f"k{n}", dst.ctypes.data, size) == 0 and dst.tobytes() == data
            where = payload_offset(meta.http(f"/query_key?key=k{n}")["locations"][0]["offset"]) + at
            seg.view(where, 1)[0] ^= 0xFF
            assert reader.get_into(f"k{n}", dst.ctypes.data, size) == errors.CHECKSUM_MISMATCH
    finally:
        reader.close()
        owner.close()


def test_a_reader_with_another_shm_dir_reads_over_tcp_and_says_why_once(meta, stores, monkeypatch, caplog,
                                                                        tmp_path):
    """Scenario: host_shm, the provider's segment lies in /dev/shm and the reader (in this process)
    has ``MEMCACHE_SHM_DIR`` pointing elsewhere, so it cannot map the provider's file. Its gets (and
    puts) go over the provider's TCP data server instead, byte-exact, and one warning names the path
    that could not be opened and the setting; further gets log nothing more."""
    provider = stores(dram_size="64MB")
    keys = [f"dir-{i}" for i in range(6)]
    data = [os.urandom(100_000 + i) for i in range(len(keys))]
    assert provider("id")["id"] > 0
    monkeypatch.setenv("MEMCACHE_SHM_DIR", str(tmp_path))
    reader = DistributedObjectStore()
    assert reader.setup(meta.local_config(protocol="host_shm", log_level="info")) == 0
    assert reader.init(0, init_bm=False) == 0
    try:
        with caplog.at_level("INFO", logger="memcache_core"):
            assert reader.put_batch(keys, data) == 0
            for _ in range(3):
                assert reader.get_batch(keys) == data
        said = [r.getMessage() for r in caplog.records if "MEMCACHE_SHM_DIR" in r.getMessage()]
        assert len(said) == 1, said
        seg = meta.http("/get_all_segments")["segments"][0]
        assert "/dev/shm/memcache-" in said[0] and seg["data_addr"] in said[0] and str(tmp_path) in said[0]
        moved = {(s.labels["path"], s.labels["direction"]): s.value
                 for m in reader._service().metrics.registry.collect() if m.name == "memcache_local_transfer_bytes"
                 for s in m.samples if s.name.endswith("_total")}
        assert moved.get(("host_tcp", "read"), 0) >= 3 * sum(map(len, data))
        assert moved.get(("host_shm", "read"), 0) == 0
    finally:
        reader.close()
