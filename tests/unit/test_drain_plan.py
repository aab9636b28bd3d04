"""Scenario tests for drain planning and commits (meta/drain.py) on a real object table, time passed in."""

from __future__ import annotations

from typing import Any

import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta.drain import MAX_ATTEMPTS, Drains
from memcache_core.meta.table import ObjectTable

MB = 1 << 20
OBJ = MB - HEADER_BYTES     # one object of OBJ payload bytes takes exactly 1 MB with its header


def make(sizes: tuple[int, ...] = (10, 10, 10)) -> tuple[ObjectTable, Drains]:
    t = ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
    for i, mb in enumerate(sizes, start=1):
        t.add_segment(p.SegmentInfo(i, mb * MB, "h", f"/dev/shm/x{i}", "127.0.0.1:1"))
        t.segments[i].rotates = True   # (owners rotate their fence when asked: Join.rotates)
    return t, Drains(lambda: t, timeout_s=10.0, move_timeout_s=5.0)


def put(t: ObjectTable, key: str, seg: int, now: float = 0.0, checksum: int = 0) -> None:
    code, gen, _ = t.alloc(1, key, OBJ, 1, [seg], now)
    assert code == 0
    assert t.commit(1, key, gen, now, checksum) == 0


def done(d: Drains, batch: p.DrainBatch, ok: bool = True, checksum: int | None = None,
         now: float = 0.0) -> list[int]:
    ms = batch.moves
    return d.report(1, p.DrainDone(0, b"", [m.key for m in ms], [m.new_generation for m in ms],
                                   [m.checksum if checksum is None else checksum for m in ms], [ok] * len(ms)), now)


def found(d: Drains, segment_id: int, now: float) -> dict[str, Any]:
    """The drain's snapshot, which must exist."""
    snap = d.find(segment_id, now)
    assert snap is not None
    return snap


def test_a_drain_moves_every_object_most_free_first_and_releases_the_source_after():
    t, d = make()
    for i in range(4):
        put(t, f"k{i}", 1, checksum=100 + i)
    put(t, "on-2", 2)
    b = d.next_batch(1, 0, 0.0)
    assert len(b.moves) == 4 and t.segments[1].alloc_after == float("inf")
    assert b.moves[0].target.segment_id == 3     # 3 is emptier than 2
    # Scenario: until the owner reports, readers find the object at its source only.
    obj = t.lookup("k0", 0.0, False)
    assert obj is not None and obj.locations == [p.Location(1, b.moves[-1].source_offset)]
    assert done(d, b) == [0] * 4
    for m in b.moves:
        o = t.objects[m.key]
        assert o.locations == [m.target] and o.generation == m.new_generation and o.checksum == m.checksum
    assert t.segments[1].allocator.used == 0 and not t.segments[1].lru
    assert d.next_batch(1, 0, 0.0).done and found(d, 1, 0.0)["state"] == "done"
    assert found(d, 1, 0.0)["moved_objects"] == 4 and d.totals.moved_bytes == 4 * OBJ
    # Scenario: new puts never land on a drained segment.
    assert t.alloc(1, "new", OBJ, 1, [1], 0.0)[0] == errors.OUT_OF_MEMORY


def test_objects_without_room_are_dropped_and_counted_and_the_drain_ends():
    t, d = make((10, 2, 2))
    for i in range(6):
        put(t, f"k{i}", 1)
    b = d.next_batch(1, 0, 0.0)     # 2 MB segments under a 90% mark hold one 1 MB object each
    assert len(b.moves) == 2
    assert found(d, 1, 0.0)["dropped_objects"] == 4 and len(t.objects) == 2
    assert done(d, b) == [0, 0]
    assert d.next_batch(1, 0, 0.0).done
    assert (d.totals.moved_objects, d.totals.dropped_objects) == (2, 4)


def test_right_after_a_meta_service_start_an_object_without_room_waits_for_members_to_rejoin():
    t, d = make((10,))
    d.settle_until = 1.0                # members of the previous MetaService may still be re-joining
    put(t, "k", 1)
    b = d.next_batch(1, 0, 0.5)
    assert b.moves == [] and not b.done and "k" in t.objects
    t.add_segment(p.SegmentInfo(2, 10 * MB, "h", "/dev/shm/x2", "127.0.0.1:1"), alloc_after=1.5)
    assert d.next_batch(1, 0, 1.2).moves == []      # settled, but segment 2 is in its re-join grace
    b = d.next_batch(1, 0, 1.6)
    assert [m.target.segment_id for m in b.moves] == [2] and done(d, b, now=1.6) == [0]


def test_a_new_table_forgets_its_drains_and_gives_members_time_to_rejoin():
    """Scenario: an HA leader change replaces the MetaService's table; the drains of the old one mean
    nothing there (their owners ask again), and the new table's members are still re-joining."""
    t, _ = make()
    tables = [t]
    d = Drains(lambda: tables[-1], timeout_s=10.0, move_timeout_s=5.0, settle_s=2.0)
    put(t, "k", 1)
    assert d.next_batch(1, 0, 0.0).moves and d.draining(1)
    fresh, _ = make((10,))
    tables.append(fresh)
    put(fresh, "k", 1)                  # the owner re-joined the new leader with its object
    b = d.next_batch(1, 0, 10.0)
    assert not found(d, 1, 10.0)["moves_in_flight"] and b.moves == [] and not b.done   # others not back yet
    fresh.add_segment(p.SegmentInfo(2, 10 * MB, "h", "/dev/shm/x2", "127.0.0.1:1"))
    b = d.next_batch(1, 0, 11.0)
    assert [m.target.segment_id for m in b.moves] == [2] and done(d, b, now=11.0) == [0]


def test_a_remove_or_a_reput_racing_a_move_wins_and_the_target_space_comes_back():
    t, d = make()
    put(t, "gone", 1)
    put(t, "replaced", 1)
    b = d.next_batch(1, 0, 0.0)
    used = t.segments[2].allocator.used + t.segments[3].allocator.used
    assert used == 2 * MB
    assert t.remove("gone", 0.0) == 0 and t.remove("replaced", 0.0) == 0
    put(t, "replaced", 2)           # a new object under the same key, elsewhere
    assert done(d, b) == [errors.STATE_MISMATCH] * 2
    assert t.objects["replaced"].locations[0].segment_id == 2 and "gone" not in t.objects
    assert t.segments[2].allocator.used + t.segments[3].allocator.used == MB   # only the new put
    # the target owners are told to clear any header the copies wrote
    assert any(e.obj.key == "gone" for s in (2, 3) for e in t.segments[s].journal)


def test_a_target_that_dies_mid_copy_is_avoided_and_the_object_goes_elsewhere():
    t, d = make()
    put(t, "k", 1)
    b = d.next_batch(1, 0, 0.0)
    dead = b.moves[0].target.segment_id
    t.drop_segment(dead)
    assert done(d, b) == [errors.STATE_MISMATCH]     # the copy "succeeded" into a segment that left
    assert t.objects["k"].locations[0].segment_id == 1
    b = d.next_batch(1, 0, 0.0)
    assert b.moves[0].target.segment_id not in (1, dead)
    assert done(d, b) == [0]


def test_a_target_whose_owner_went_silent_gets_no_commit_and_no_new_moves():
    t, d = make()
    silent: set[int] = set()
    d.answering = lambda sid, now: sid not in silent
    put(t, "k", 1)
    b = d.next_batch(1, 0, 0.0)
    first = b.moves[0].target.segment_id
    silent.add(first)                   # stopped heartbeating while the owner copied: may be dead
    assert done(d, b) == [errors.ERROR]
    assert t.objects["k"].locations[0].segment_id == 1 and t.segments[first].allocator.used == 0
    b = d.next_batch(1, 0, 0.0)
    assert b.moves[0].target.segment_id not in (1, first)
    assert done(d, b) == [0]


def test_when_every_segment_with_room_is_silent_the_object_waits_instead_of_being_dropped():
    t, d = make()
    silent = {2, 3}                     # a loaded host: heartbeats late, not dead
    d.answering = lambda sid, now: sid not in silent
    put(t, "j", 1)
    b = d.next_batch(1, 0, 0.0)
    assert b.moves == [] and not b.done and "j" in t.objects
    silent.clear()
    assert done(d, d.next_batch(1, 0, 0.0)) == [0]


def test_failed_copies_are_retried_on_other_targets_then_dropped():
    t, d = make((10, 10, 10, 10, 10))
    put(t, "k", 1)
    targets = []
    for _ in range(MAX_ATTEMPTS):
        b = d.next_batch(1, 0, 0.0)
        targets.append(b.moves[0].target.segment_id)
        assert done(d, b, ok=False) == [errors.ERROR]
    assert len(set(targets)) == MAX_ATTEMPTS
    assert d.next_batch(1, 0, 0.0).done and "k" not in t.objects
    assert found(d, 1, 0.0)["failed_moves"] == MAX_ATTEMPTS and found(d, 1, 0.0)["dropped_objects"] == 1
    assert sum(s.allocator.used for s in t.segments.values()) == 0


def test_bytes_that_fail_the_committed_checksum_are_never_moved():
    t, d = make()
    put(t, "k", 1, checksum=42)
    b = d.next_batch(1, 0, 0.0)
    assert done(d, b, checksum=43) == [errors.CHECKSUM_MISMATCH]
    assert "k" not in t.objects and t.counters.integrity_failures == 1


def test_a_leased_source_is_freed_only_when_the_lease_ends():
    t, d = make()
    put(t, "k", 1)
    t.lookup("k", 0.0, True)        # a reader holds a 1 s lease on the source
    assert done(d, d.next_batch(1, 0, 0.0)) == [0]
    assert t.segments[1].allocator.used == MB
    t.reclaim(1.5)
    assert t.segments[1].allocator.used == 0


def test_deadline_timeout_unreported_moves_and_leaving_are_bounded():
    t, d = make()
    for i in range(3):
        put(t, f"k{i}", 1)
    b = d.next_batch(1, 2000, 0.0)
    assert len(b.moves) == 3 and b.left_ms == 2000
    d.housekeeping(5.0)             # past the drain's deadline and the moves' (quarantined) deadline
    assert found(d, 1, 5.0)["state"] == "timed_out" and found(d, 1, 5.0)["moves_in_flight"] == 0
    assert d.next_batch(1, 0, 5.0).moves     # asked again by its owner: a new drain starts
    d.segment_left(1, 6.0)
    t.drop_segment(1)
    snap = found(d, 1, 6.0)
    assert snap["state"] == "left" and snap["dropped_objects"] == 3
    t.reclaim(10.0)   # the unreported moves' targets: free once their owners rotated their fences
    assert all(s.rotated(s.rotate_to) for s in t.segments.values() if s.fenced)
    assert sum(s.allocator.used for s in t.segments.values()) == 0


@pytest.mark.parametrize("replicas", [2])
def test_a_replica_is_moved_to_a_segment_without_one(replicas):
    t, d = make((10, 10, 10))
    code, gen, locs = t.alloc(1, "r", OBJ, replicas, [1, 2], 0.0)
    assert code == 0 and t.commit(1, "r", gen, 0.0) == 0
    b = d.next_batch(1, 0, 0.0)
    assert b.moves[0].target.segment_id == 3
    assert done(d, b) == [0]
    assert sorted(loc.segment_id for loc in t.objects["r"].locations) == [2, 3]


def test_on_a_warm_pool_a_drain_pushes_out_colder_objects_and_keeps_every_hotter_one():
    """Scenario: targets 2 and 3 (10 MB, high-water mark 90%) hold 8 objects each: 4 put at t=0
    (cold), 2 used until t=6 (hotter than the drained ones) and 2 leased until t=11. Segment
    1 holds 6 objects put at t=4 and read at t=0 (lease TTL 5 s: used until t=5). Two of them fit
    under the marks without evicting, so the drain pushes out cold objects, only as many as it needs: every
    drained object moves, the hotter and the leased objects all stay, and the pool stays under its
    high-water mark. (Moving into free room only, 4 of the 6 were dropped.)"""
    t, d = make((10, 10, 10))
    t.lease_ttl_s = 5.0
    for s in (2, 3):
        for i in range(8):
            put(t, f"o{s}-{i}", s)
    hot = [f"o{s}-{i}" for s in (2, 3) for i in (4, 5)]
    leased = [f"o{s}-{i}" for s in (2, 3) for i in (6, 7)]
    drained = [f"k{i}" for i in range(6)]
    for k in drained:
        put(t, k, 1, now=4.0)
    for k in drained:
        assert t.lookup(k, 0.0, True) is not None   # leased until 5: last used then
    for k in hot:
        assert t.lookup(k, 1.0, True) is not None   # leased until 6: used after the drained ones
    for k in leased:
        assert t.lookup(k, 6.0, True) is not None   # leased until 11: in use during the drain
    b = d.next_batch(1, 0, 7.0)
    assert len(b.moves) == 6 and done(d, b, now=7.0) == [0] * 6
    assert all(t.objects[k].locations[0].segment_id in (2, 3) for k in drained)
    assert all(k in t.objects for k in hot + leased)
    assert found(d, 1, 7.0)["dropped_objects"] == 0
    gone = [f"o{s}-{i}" for s in (2, 3) for i in range(4) if f"o{s}-{i}" not in t.objects]
    assert len(gone) == 4 and t.counters.evictions == 4       # 2 x 9 fit under the marks: 16 + 6 - 18
    assert all(s.allocator.used <= 0.9 * s.allocator.size for s in t.segments.values())


def test_a_drain_never_pushes_out_an_object_as_hot_as_the_one_it_moves():
    """Scenario: the targets are at their high-water mark with objects put at the same time as the
    drained ones (t=0) and never read since: none is colder, so nothing is evicted and the drained
    objects that do not fit are dropped, as before."""
    t, d = make((10, 10, 10))
    for s in (2, 3):
        for i in range(9):
            put(t, f"o{s}-{i}", s)
    for i in range(3):
        put(t, f"k{i}", 1)
    b = d.next_batch(1, 0, 1.0)
    assert b.moves == [] and found(d, 1, 1.0)["dropped_objects"] == 3
    assert t.counters.evictions == 0 and len(t.objects) == 18


def test_objects_in_the_targets_arena_are_not_pushed_out_for_nothing():
    """Scenario: target 2 holds its owner's allocation arena (1 MB, small objects committed in it at
    t=0, the least recently used of the segment) and 8 objects of 1 MB (t=0): at its high-water mark.
    Evicting the arena's objects would give their space back to the arena, not make room for a
    move: the drain of segment 1 (objects put at t=4) pushes out the 1 MB objects only."""
    from memcache_core.meta import arena
    t, d = make((10, 10))
    r = arena.commit(t, 2, p.ArenaCommit(2, b"", 0, [], [], [], [], True, False), 0.0, MB)
    step = 4096
    small = [f"s{i}" for i in range(8)]
    got = arena.commit(t, 2, p.ArenaCommit(2, b"", r.arena, small, [r.start + i * step for i in range(8)],
                                           [1024] * 8, [0] * 8, False, False), 0.0, MB)
    assert got.codes == [0] * 8
    for i in range(8):
        put(t, f"o{i}", 2)
    assert t.segments[2].allocator.used == 9 * MB
    for i in range(3):
        put(t, f"k{i}", 1, now=4.0)
    b = d.next_batch(1, 0, 5.0)
    assert len(b.moves) == 3 and done(d, b, now=5.0) == [0] * 3
    assert all(k in t.objects for k in small)
    assert sum(f"o{i}" in t.objects for i in range(8)) == 5 and t.counters.evictions == 3
