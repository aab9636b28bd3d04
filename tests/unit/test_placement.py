"""Scenario tests for replicas and placement policies on the object table (time passed in, no sleeps)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from memcache_core import errors
from memcache_core.config import MetaConfig
from memcache_core.errors import ConfigError
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta import placement
from memcache_core.meta.table import ObjectTable
from memcache_core.protocol import SegmentInfo

MB = 1 << 20
OBJ = MB - HEADER_BYTES     # one object takes exactly 1 MB with its header


def make(hosts: list[str], size: int = 10 * MB) -> ObjectTable:
    """A table with one segment per entry of ``hosts`` (ids 1..n, on those hosts)."""
    t = ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
    for i, h in enumerate(hosts, 1):
        t.add_segment(SegmentInfo(i, size, h, f"/dev/shm/x{i}", "127.0.0.1:1"))
    return t


def put(t: ObjectTable, key: str, replicas: int, order: list[int] | None = None, now: float = 0.0,
        pinned: tuple[int, ...] = ()) -> list[int]:
    code, gen, locs = t.alloc(1, key, OBJ, replicas, order or list(t.segments), now, pinned)
    assert code == 0
    assert t.commit(1, key, gen, now) == 0
    return [loc.segment_id for loc in locs]


def fill(t: ObjectTable, seg: int, n: int) -> None:
    for i in range(n):
        assert put(t, f"fill-{seg}-{i}", 1, [seg]) == [seg]


def test_replicas_go_to_distinct_segments_on_distinct_hosts_first():
    """Scenario: segments 1 and 2 share host a, 3 is on b. Two replicas written from segment 1's
    host: the second goes to host b, not to the first segment's neighbour."""
    t = make(["a", "a", "b"])
    assert put(t, "k", 2, [1, 2, 3]) == [1, 3]
    # three replicas: a third host does not exist, so the remaining segment takes it
    assert sorted(put(t, "k3", 3, [1, 2, 3])) == [1, 2, 3]
    assert t.under_replicated == 0


def test_fewer_segments_than_replicas_is_a_partial_placement_counted_as_under_replicated():
    """Scenario: replicaNum 4 in a pool of two segments: the put is placed on both (success) and
    the object is counted under-replicated until it leaves the table."""
    t = make(["a", "b"])
    assert sorted(put(t, "k", 4)) == [1, 2]
    assert t.under_replicated == 1
    assert t.remove("k", 0.0) == 0
    assert t.under_replicated == 0


def test_pending_partial_placements_are_not_counted_until_committed():
    t = make(["a"])
    code, gen, locs = t.alloc(1, "k", OBJ, 2, [1], 0.0)
    assert code == 0 and len(locs) == 1 and t.under_replicated == 0
    t.abort(1, "k", gen)
    assert t.under_replicated == 0 and t.segments[1].allocator.used == 0


def test_a_dead_replica_segment_leaves_the_object_in_the_others():
    """Scenario: replicas on 1 and 2; segment 1 dies: the object lives on in 2 and is counted
    under-replicated; when 2 dies too, the object is gone and the gauge is back to 0."""
    t = make(["a", "b", "c"])
    assert put(t, "k", 2, [1, 2, 3]) == [1, 2]
    assert t.drop_segment(1) == 0
    o = t.lookup("k", 0.0, lease=False)
    assert o is not None and [loc.segment_id for loc in o.locations] == [2]
    assert t.under_replicated == 1
    assert t.drop_segment(2) == 1
    assert t.lookup("k", 0.0, lease=False) is None and t.under_replicated == 0


def test_a_corrupt_replica_is_dropped_alone_and_its_space_freed_after_the_lease():
    """Scenario: a reader leased k and found the copy in segment 1 corrupt. Only that copy goes; its
    space is freed once the lease (1 s) ends; the copy in 2 still serves. The last copy's
    corruption drops the object."""
    t = make(["a", "b"])
    put(t, "k", 2, [1, 2])
    o = t.lookup("k", 0.0, lease=True)
    assert o is not None
    assert t.corrupt("k", o.generation, 0.5, segment_id=1)
    assert [loc.segment_id for loc in o.locations] == [2] and t.under_replicated == 1
    assert t.segments[1].allocator.used == MB          # leased until 1.0: not reused yet
    assert "k" not in t.segments[1].lru
    t.reclaim(1.5)
    assert t.segments[1].allocator.used == 0 and t.segments[2].allocator.used == MB
    assert t.corrupt("k", o.generation, 2.0, segment_id=2)
    assert t.lookup("k", 2.0, lease=False) is None and t.under_replicated == 0
    assert t.counters.integrity_failures == 2


def test_preferred_segments_win_over_host_spreading():
    """Scenario: the writer pins segments 1 and 2, both on host a: both get a replica although
    segment 3 is on another host."""
    t = make(["a", "a", "b"])
    assert put(t, "k", 2, [3, 1, 2], pinned=(1, 2)) == [1, 2]


def test_recovered_segment_waits_out_the_grace_before_taking_replicas():
    t = make(["a"])
    t.add_segment(SegmentInfo(2, 10 * MB, "b", "/dev/shm/x2", "127.0.0.1:1"), alloc_after=5.0)
    assert put(t, "early", 2, [1, 2], now=1.0) == [1]
    assert put(t, "late", 2, [1, 2], now=5.0) == [1, 2]


def test_local_first_puts_the_writers_own_segment_first_and_spreads_the_rest():
    t = make(["a", "b", "c"])
    rng = random.Random(1)
    assert all(next(placement.order("local_first", t.segments, 2, rng)) == 2 for _ in range(50))
    # a pure client (no segment of its own) gets the spread order
    firsts = Counter(next(placement.order("local_first", t.segments, None, rng)) for _ in range(300))
    assert set(firsts) == {1, 2, 3}


def test_spread_prefers_free_segments_but_an_empty_one_is_no_hot_spot():
    """Scenario: four segments, three 80% full and one restarted empty. ``spread`` puts the empty one
    first about half of the time (the better of two random picks: 1 - C(3,2)/C(4,2)), not always,
    and never puts a full one before it when both are drawn; ``random`` is uniform."""
    t = make(["a", "b", "c", "d"])
    for seg in (1, 2, 3):
        fill(t, seg, 8)
    rng = random.Random(7)
    n = 4000
    firsts = Counter(next(placement.order("spread", t.segments, None, rng)) for _ in range(n))
    assert 0.45 < firsts[4] / n < 0.55
    assert all(firsts[s] > 0 for s in (1, 2, 3))
    uniform = Counter(next(placement.order("random", t.segments, None, rng)) for _ in range(n))
    assert all(0.2 < uniform[s] / n < 0.3 for s in (1, 2, 3, 4))


def test_spread_over_a_table_evens_out_usage():
    """Scenario: 60 objects put by a pure client under ``spread`` into three empty segments end up
    within a few objects of one another (not all in the first)."""
    t = make(["a", "b", "c"], size=40 * MB)
    rng = random.Random(3)
    for i in range(60):
        put(t, f"k{i}", 1, list(placement.order("spread", t.segments, None, rng)))
    used = [t.segments[s].allocator.used // MB for s in (1, 2, 3)]
    assert sum(used) == 60 and max(used) - min(used) <= 4


def test_two_segments_spread_always_takes_the_freer():
    t = make(["a", "b"])
    fill(t, 1, 3)
    rng = random.Random(5)
    assert all(list(placement.order("spread", t.segments, None, rng)) == [2, 1] for _ in range(20))


def test_placement_policy_is_validated_naming_the_key():
    with pytest.raises(ConfigError, match="placement_policy"):
        MetaConfig(placement_policy="nearest")   # type: ignore[arg-type]   # not one of the choices, on purpose
    assert MetaConfig().placement_policy == "local_first"
    assert MetaConfig(placement_policy="spread").placement_policy == "spread"


def test_over_capacity_and_out_of_memory_still_reported_with_replicas():
    t = make(["a", "b"], size=2 * MB)
    assert t.alloc(1, "huge", 4 * MB, 2, [1, 2], 0.0)[0] == errors.OVER_CAPACITY


def test_replica_distance_orders_own_then_same_host_then_others():
    from memcache_core.local.service import replica_distance

    class Own:
        path = "/dev/shm/memcache-1-ab"

    seg = lambda sid, host, path: SegmentInfo(sid, MB, host, path, "127.0.0.1:1")  # noqa: E731
    assert replica_distance(seg(1, "a", Own.path), Own(), "a") == 0    # type: ignore[arg-type]
    assert replica_distance(seg(2, "a", "/dev/shm/memcache-2-cd"), Own(), "a") == 1  # type: ignore[arg-type]
    assert replica_distance(seg(3, "b", "/dev/shm/memcache-3-ef"), None, "a") == 2
    assert replica_distance(None, None, "a") == 3


def test_a_segment_too_small_for_the_object_is_never_evicted_for_it():
    """Scenario: a 4 MB segment and a 10 MB one, both too full to take a 6 MB object without
    evicting; the object can only ever fit the second. The eviction pass evicts there and leaves the
    small segment's objects alone (it used to empty the small segment's LRU first, for nothing)."""
    t = make(["a", "b"])
    t.add_segment(SegmentInfo(3, 4 * MB, "c", "/dev/shm/x3", "127.0.0.1:1"))
    fill(t, 3, 3)
    fill(t, 1, 9)
    code, _, locs = t.alloc(1, "big", 6 * MB, 1, [3, 1], 0.0)
    assert code == 0 and [loc.segment_id for loc in locs] == [1]
    assert len(t.segments[3].lru) == 3
    assert t.alloc(1, "huge", 20 * MB, 1, [3, 1, 2], 0.0)[0] == errors.OVER_CAPACITY
    assert len(t.segments[3].lru) == 3


def test_a_holder_that_re_joins_gives_the_object_its_replica_back():
    """Scenario: replicas on 1 and 2; segment 2 is declared dead (under-replicated), then its owner
    re-joins and reports the object again: two locations, no longer counted."""
    from memcache_core.protocol import ObjectReport
    t = make(["a", "b"])
    put(t, "k", 2, [1, 2])
    o = t.lookup("k", 0.0, lease=False)
    assert o is not None
    (loc2,) = [loc for loc in o.locations if loc.segment_id == 2]
    t.drop_segment(2)
    assert t.under_replicated == 1
    t.add_segment(SegmentInfo(2, 10 * MB, "b", "/dev/shm/x2", "127.0.0.1:1"),
                  [ObjectReport("k", loc2.offset, OBJ, o.generation, o.checksum)])
    assert len(o.locations) == 2 and t.under_replicated == 0


def test_a_corrupt_report_with_mismatched_segments_is_refused():
    from memcache_core import protocol as p
    from memcache_core.errors import InvalidParameter
    from memcache_core.meta import validate
    validate.corrupt(p.Corrupt(1, b"t", ["a", "b"], [1, 2], [5, 6]))
    validate.corrupt(p.Corrupt(1, b"t", ["a"], [1]))            # no segments: whole objects
    with pytest.raises(InvalidParameter, match="differ in length"):
        validate.corrupt(p.Corrupt(1, b"t", ["a", "b"], [1, 2], [5]))
    with pytest.raises(InvalidParameter, match="segment"):
        validate.corrupt(p.Corrupt(1, b"t", ["a"], [1], [-1]))
