"""Scenario tests for finding a segment's objects from their headers (MetaService recovery)."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import xxhash

from memcache_core.host import shm_dir
from memcache_core.layout import HEADER_BYTES, pack_header
from memcache_core.local import recovery
from memcache_core.memory import Mapping
from memcache_core.protocol import ObjectReport


@pytest.fixture
def segment():
    m = Mapping(os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(4)}"), 8 << 20, create=True)
    yield m
    m.close()


def write(m: Mapping, key: str, off: int, size: int, gen: int, fill: int) -> None:
    a = m.array()
    a[off + HEADER_BYTES:off + HEADER_BYTES + size] = fill
    digest = xxhash.xxh3_64_intdigest(a[off + HEADER_BYTES:off + HEADER_BYTES + size].data)
    a[off:off + HEADER_BYTES] = np.frombuffer(pack_header(key, gen, size, digest), np.uint8)


def test_scan_finds_verified_objects_and_skips_cleared_and_corrupt_ones(segment):
    write(segment, "a", 0, 5000, 10, 1)
    write(segment, "b", 1 << 20, 5000, 11, 2)
    write(segment, "c", 2 << 20, 5000, 12, 3)
    write(segment, "removed", 3 << 20, 5000, 13, 4)
    recovery.clear_header(segment, ObjectReport("removed", 3 << 20, 5000, 13))
    recovery.clear_header(segment, ObjectReport("a", 0, 5000, 9))     # an older generation: a stays
    segment.array()[(2 << 20) + HEADER_BYTES + 17] ^= 0xFF           # c's payload changed
    assert sorted(r.key for r in recovery.scan(segment)) == ["a", "b"]


def test_scan_keeps_the_newest_of_overlapping_headers(segment):
    """Scenario: an object's space was freed and reused by a newer allocation that starts inside it;
    the older header survived. The newer generation proves the older object is gone."""
    write(segment, "old", 0, 100_000, 20, 5)
    write(segment, "new", 4096, 5000, 21, 6)
    found = recovery.scan(segment)
    assert [(r.key, r.offset) for r in found] == [("new", 4096)]


def test_scan_of_a_fresh_segment_reads_nothing(segment):
    assert recovery.scan(segment) == []
