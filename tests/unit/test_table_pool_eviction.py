"""Scenario tests for eviction across the pool: a put that finds no segment with room evicts the
pool's least recently used objects, whichever segments hold them, and is placed where that made
room; an arena evicts in its holder's segment only what the pool would evict; leases, pending puts
and existence probes keep their rules."""

from __future__ import annotations

import itertools
import random

import pytest

from memcache_core import errors
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta import arena, placement
from memcache_core.meta.table import ObjectTable
from memcache_core.protocol import SegmentInfo

MB = 1 << 20
OBJ = MB - HEADER_BYTES     # an object of OBJ payload bytes takes exactly 1 MB with its header


def make(n_segments: int = 3, size: int = 10 * MB, lease_s: float = 1.0) -> ObjectTable:
    t = ObjectTable(90, 80, lease_s, pending_timeout_s=5.0, first_generation=7 << 32)
    for i in range(1, n_segments + 1):
        t.add_segment(SegmentInfo(i, size, f"h{i}", f"/dev/shm/x{i}", "127.0.0.1:1"))
    return t


def put(t: ObjectTable, key: str, order: list[int], now: float, writer: int = 1) -> int:
    """Put one object; returns the segment it went to."""
    code, gen, locs = t.alloc(writer, key, OBJ, 1, order, now)
    assert code == 0, (key, code)
    assert t.commit(writer, key, gen, now) == 0
    return locs[0].segment_id


def fill(t: ObjectTable, clock: itertools.count) -> None:
    """Each segment filled to its high-water mark (9 of 10 MB), segment 3 first (its keys oldest)."""
    for sid in (3, 1, 2):
        for i in range(9 - t.segments[sid].allocator.used // MB):
            assert put(t, f"s{sid}-{i}", [sid], float(next(clock))) == sid


def test_a_full_pool_evicts_its_least_recently_used_objects_and_places_the_put_there():
    """Scenario: three full segments; segment 3's objects are the oldest (its writer went idle). A
    put whose placement order asks for segment 1 first evicts segment 3's oldest objects, not segment
    1's, and lands in segment 3; the objects of segments 1 and 2 all stay."""
    t = make()
    clock = itertools.count()
    fill(t, clock)
    assert put(t, "new", [1, 2, 3], float(next(clock))) == 3
    assert all(f"s{sid}-{i}" in t.objects for sid in (1, 2) for i in range(9))
    assert "s3-0" not in t.objects and "s3-8" in t.objects
    assert t.counters.evictions == 2   # 10% of a 10 MB segment and the object's 1 MB: 2 objects freed


def test_a_read_makes_an_object_recent_pool_wide_and_exist_does_not():
    """Scenario: as above, but segment 3's oldest object was read since (a leased lookup, whose lease
    has ended) and another was only probed with exist: the read one stays, the probed one goes."""
    t = make()
    clock = itertools.count()
    fill(t, clock)
    assert t.lookup("s3-0", float(next(clock)), lease=True) is not None
    assert t.exists("s3-1")
    later = float(next(clock)) + 10.0   # the read's lease (1 s) is over
    for i in range(3):
        put(t, f"new{i}", [1, 2, 3], later + i)
    assert "s3-0" in t.objects and "s3-1" not in t.objects
    assert all(f"s{sid}-{i}" in t.objects for sid in (1, 2) for i in range(9))


def test_leased_and_pending_objects_are_never_evicted_pool_wide():
    """Scenario: segment 3 holds the oldest objects, all leased, and the oldest put, still pending; a
    put into the full pool evicts elsewhere (the pool's oldest unleased objects, in segment 1) and
    never touches them; once every object is leased a put that needs room fails at once (-3016)."""
    t = make(lease_s=100.0)
    clock = itertools.count()
    code, gen, _ = t.alloc(1, "pending", OBJ, 1, [3], float(next(clock)))
    assert code == 0
    fill(t, clock)   # (segment 3 takes 8 objects beside the pending one)
    now = float(next(clock))
    for i in range(8):
        assert t.lookup(f"s3-{i}", now, lease=True) is not None
    assert put(t, "new", [3, 1, 2], now) == 1
    assert all(f"s3-{i}" in t.objects for i in range(8)) and not t.objects["pending"].committed
    assert "s1-0" not in t.objects and "s2-0" in t.objects
    for k in list(t.objects):
        t.lookup(k, now, lease=True)
    code, _, _ = t.alloc(1, "more", 3 * OBJ, 1, [1, 2, 3], now)
    assert code == errors.OUT_OF_MEMORY and t.counters.alloc_failures == 1
    assert t.commit(1, "pending", gen, now) == 0


def test_evict_coldest_frees_the_oldest_objects_across_segments():
    """Scenario: ``evict_coldest`` (a helper for callers that need room anywhere: drains, repairs)
    frees at least the bytes asked for, oldest first whichever segment holds them."""
    t = make()
    clock = itertools.count()
    for i in range(9):   # interleaved: s1-0 < s2-0 < s3-0 < s1-1 < ...
        for sid in (1, 2, 3):
            put(t, f"s{sid}-{i}", [sid], float(next(clock)))
    assert t.evict_coldest(4 * MB, float(next(clock))) == 4 * MB
    assert [k for k in ("s1-0", "s2-0", "s3-0", "s1-1", "s2-1") if k not in t.objects] == ["s1-0", "s2-0", "s3-0", "s1-1"]
    assert t.evict_coldest(MB, 100.0, among=[t.segments[3]]) == MB and "s3-1" not in t.objects and "s2-1" in t.objects


@pytest.mark.parametrize("policy", ["local_first", "spread", "random"])
def test_one_idle_writer_of_four_leaves_the_pool_its_most_recent_objects(policy: str):
    """Scenario: four writers put in turn until the pool is full; then one goes idle and the others put
    three times the pool's capacity more, placed by ``policy``. The pool holds the most recent keys:
    one LRU list for the pool would keep all of the last H (per segment, ~75% under local_first)."""
    t = make(n_segments=4)
    rng = random.Random(7)
    written: list[str] = []
    clock = itertools.count()
    for n, writers in ((36, (1, 2, 3, 4)), (108, (1, 2, 3))):
        for i in range(n):
            w = writers[i % len(writers)]
            key = f"k{len(written)}"
            put(t, key, list(placement.order(policy, t.segments, w, rng)), float(next(clock)), writer=w)
            written.append(key)
    held = sum(1 for o in t.objects.values() if o.committed)
    assert all(k in t.objects for k in written[-held:]), policy


def test_an_arena_evicts_in_its_segment_only_what_the_pool_would():
    """Scenario: segment 3's objects are the pool's oldest. Writer 1, whose own segment is full, is
    refused an arena (its segment would have to evict objects more recent than segment 3's: its small
    puts go the two-phase way, placed where the pool's eviction makes room); once segment 1 holds
    the pool's oldest objects, it gets one, evicting there."""
    t = make()
    clock = itertools.count()
    fill(t, clock)
    assert arena.grant(t, t.segments[1], 512 << 10, float(next(clock))) is None
    assert all(f"s1-{i}" in t.objects for i in range(9)) and t.counters.evictions == 0
    for i in range(9):
        t.remove(f"s3-{i}", float(next(clock)))
    t.reclaim(float(next(clock)))
    assert arena.grant(t, t.segments[1], 512 << 10, float(next(clock))) is not None
    assert "s1-0" not in t.objects and t.counters.evictions >= 1
