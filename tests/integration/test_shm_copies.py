"""Shared-memory copies split over copy threads (transfer/shmcopy.py), with real processes on host_shm.

Every get is compared byte for byte with what was put, and the bytes between and after the pieces of
the destination must stay untouched. Checksums are on (the default), so an op cut between threads is
also proven to hash its bytes in order: otherwise its reads would fail as corrupt.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import DSR1_LAYOUT

LAYOUTS = {
    # name: (piece sizes, gap after each piece in the caller's buffer, objects per batch)
    "layered, scattered": (DSR1_LAYOUT, 64, 3),          # odd batch: one object cut between two threads
    "layered, touching": (DSR1_LAYOUT, 0, 2),            # pieces merged into one run per object
    "one large piece": ([8_994_817], 0, 1),              # one object cut in parts, odd tail
    "many small pieces": ([700] * 2000, 1, 1),           # 2,000 pieces of 700 bytes
    "around page boundaries": ([1, 4095, 4097, 8191, 65537, 131071] * 12, 3, 2),
}


def _check(reader: Any, keys: list[str], layout: list[int], gap: int) -> None:
    r = reader("get", keys=keys, layout=layout, gap=gap)
    assert r["codes"] == [0] * len(keys) and r["mismatches"] == []


def test_threaded_copies_are_byte_exact(stores: Any) -> None:
    writer = stores(shm_copy_threads=2)
    readers = [stores(init_bm=False, shm_copy_threads=n) for n in (1, 2, 3)]
    for name, (layout, gap, batch) in LAYOUTS.items():
        keys = [f"{name}/{i}" for i in range(batch)]
        r = writer("put", keys=keys, layout=layout, gap=gap)
        assert r["codes"] == [0] * batch, name
        for reader in readers:
            _check(reader, keys, layout, gap)
        _check(writer, keys, layout, gap)                # its own segment, threaded too


@pytest.mark.parametrize("threads", [1, 3])
def test_threaded_puts_are_read_back_by_any_thread_count(stores: Any, threads: int) -> None:
    """Objects written with one thread count and read with another carry the same checksum."""
    writer = stores(shm_copy_threads=threads)
    reader = stores(init_bm=False, shm_copy_threads=2)
    layout, gap, batch = LAYOUTS["layered, scattered"]
    keys = [f"t{threads}/{i}" for i in range(batch)]
    assert writer("put", keys=keys, layout=layout, gap=gap)["codes"] == [0] * batch
    _check(reader, keys, layout, gap)
    _check(reader, keys[:1], layout, gap)                # one object: cut in two, hashed after both parts
