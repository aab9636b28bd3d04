"""Scenario tests for allocation arenas (``meta/arena.py``): what a commit in an arena may do, and
where the arena's space goes."""

from __future__ import annotations

import math

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.layout import footprint
from memcache_core.meta import arena
from memcache_core.meta.allocator import aligned
from memcache_core.meta.table import ObjectTable

MB = 1 << 20
ARENA = 1 * MB
SMALL = 4096
STEP = aligned(footprint(SMALL))


def make(size: int = 16 * MB) -> ObjectTable:
    t = ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
    for i in (1, 2):
        t.add_segment(p.SegmentInfo(i, size, f"h{i}", f"/dev/shm/x{i}", "127.0.0.1:1"))
    return t


def commit(t: ObjectTable, sid: int, arena_id: int, objs: list[tuple[str, int]], refill: bool = False,
           release: bool = False, now: float = 0.0) -> p.ArenaReply:
    req = p.ArenaCommit(sid, b"", arena_id, [k for k, _ in objs], [o for _, o in objs], [SMALL] * len(objs),
                        [0] * len(objs), refill, release)
    return arena.commit(t, sid, req, now, ARENA)


def test_grant_commit_and_visibility():
    t = make()
    r = commit(t, 1, 0, [], refill=True)
    assert r.arena and r.size == ARENA and t.segments[1].allocator.used == ARENA
    assert not t.exists("a")   # nothing is visible before its commit, whatever was copied
    r2 = commit(t, 1, r.arena, [("a", r.start), ("b", r.start + STEP)])
    assert r2.codes == [0, 0] and r2.arena == r.arena
    assert t.exists("a") and t.exists("b")
    found = t.lookup_many(["a"], 0.0, False)[0]
    assert found is not None and found.locations == [p.Location(1, r.start)]
    # generations are issued at commit, in order, above every one issued before
    assert r2.generations[1] > r2.generations[0] > 7 << 32


def test_forged_commits_are_refused_and_corrupt_nothing():
    """Scenario: an insider commits over its own object, outside its arena, unaligned, or in an
    arena that is not its own; every one is refused and the table is unchanged."""
    t = make()
    r = commit(t, 1, 0, [], refill=True)
    other = commit(t, 2, 0, [], refill=True)
    assert commit(t, 1, r.arena, [("a", r.start)]).codes == [0]
    before = dict(t.objects)
    codes = commit(t, 1, r.arena, [("over", r.start + 64),            # inside a's range
                                   ("past", r.start + ARENA - 64),     # runs past the arena's end
                                   ("before", r.start - STEP),         # below the arena
                                   ("odd", r.start + 3 * STEP + 1)]).codes
    assert codes == [errors.INVALID_PARAM] * 4
    # member 1 naming member 2's arena: void (the arena is looked up by the caller's own segment)
    assert commit(t, 1, other.arena, [("theirs", other.start)]).codes == [errors.ARENA_VOID]
    assert t.objects == before


def test_existing_and_pending_keys():
    t = make()
    r = commit(t, 1, 0, [], refill=True)
    code, _, _ = t.alloc(5, "pending", SMALL, 1, [2], 0.0)
    assert code == 0
    assert commit(t, 1, r.arena, [("x", r.start)]).codes == [0]
    codes = commit(t, 1, r.arena, [("x", r.start + STEP), ("pending", r.start + 2 * STEP)]).codes
    assert codes == [errors.OBJECT_ALREADY_EXISTS, errors.WRITE_IN_PROGRESS]


def test_freed_objects_stay_in_the_arena_until_it_is_retired():
    """Scenario: an object of a live arena is removed: its space is not handed to anyone else (the
    holder's bump pointer has passed it); retiring the arena returns every range not held by a
    committed object, and objects still held free their space as any other later."""
    t = make()
    seg = t.segments[1]
    r = commit(t, 1, 0, [], refill=True)
    commit(t, 1, r.arena, [("a", r.start), ("b", r.start + STEP)])
    assert t.remove("a", 0.0) == 0
    assert seg.allocator.used == ARENA               # a's space stays the arena's
    r2 = commit(t, 1, r.arena, [], refill=True)       # retire + a new arena
    assert r2.arena != r.arena
    assert seg.allocator.used == ARENA + STEP         # the new arena and b
    assert commit(t, 1, r.arena, [("late", r.start + 2 * STEP)]).codes == [errors.ARENA_VOID]
    t.remove("b", 0.0)
    assert seg.allocator.used == ARENA
    commit(t, 1, r2.arena, [], release=True)
    assert seg.allocator.used == 0 and seg.arena is None


def test_no_arena_where_no_new_object_may_go():
    t = make()
    t.segments[1].alloc_after = math.inf            # draining
    assert commit(t, 1, 0, [], refill=True).arena == 0
    t.segments[2].alloc_after = 0.0
    small = make(size=4 * MB)                        # an arena would take more than an eighth
    assert commit(small, 1, 0, [], refill=True).arena == 0


def test_a_new_table_knows_no_arena():
    """Scenario: the MetaService restarted (or a new leader took over) between the grant and the
    commit: the arena is void, nothing is committed, and the caller falls back to the two-phase put."""
    r = commit(make(), 1, 0, [], refill=True)
    t = make()
    assert commit(t, 1, r.arena, [("a", r.start)]).codes == [errors.ARENA_VOID]
    assert not t.objects


def test_eviction_frees_arena_objects_like_any_other():
    t = make(size=16 * MB)
    r = commit(t, 1, 0, [], refill=True)
    commit(t, 1, r.arena, [(f"k{i}", r.start + i * STEP) for i in range(10)])
    t.alloc(9, "big", 14 * MB - STEP, 1, [1], 0.0)   # fills the segment past its high-water mark
    t.evict_all(0.0)
    assert not any(t.exists(f"k{i}") for i in range(10))
    assert not t.segments[1].arena.used   # (their space returns when the holder refills the arena)


def test_small_puts_count_in_their_writers_quota():
    """Scenario: an object committed from an arena counts in its writer's kept objects (the member
    quotas), and leaves them when it leaves the table; a writer at its quota is refused per key."""
    t = make()
    r = commit(t, 1, 0, [], refill=True)
    commit(t, 1, r.arena, [("a", r.start), ("b", r.start + STEP)])
    assert t.kept_of[1] == [2, 2 * SMALL]
    t.remove("a", 0.0)
    assert t.kept_of[1] == [1, SMALL]
    req = p.ArenaCommit(1, b"", r.arena, ["c"], [r.start + 2 * STEP], [SMALL], [0])
    assert arena.commit(t, 1, req, 0.0, ARENA, lambda size: False).codes == [errors.QUOTA_EXCEEDED]
    assert not t.exists("c")


def test_a_reservation_that_fails_publishes_no_object_of_the_batch():
    """Scenario (HA): the batch's generations cross the point where the next block is reserved and
    etcd refuses it: the commit fails whole (nothing published, the arena unchanged), and a later
    commit of the same objects, once reservations work, publishes them all."""
    import pytest

    from memcache_core.errors import MetaServiceUnavailable
    from memcache_core.meta import generations

    t = make()
    r = commit(t, 1, 0, [], refill=True)
    assert commit(t, 1, r.arena, [("first", r.start)]).codes == [0]   # a block is reserved
    objs = [(f"k{i}", r.start + (i + 1) * STEP) for i in range(8)]
    t.bump_generation(t.gen_ceiling - generations.BLOCK // 2 - 4)   # the 5th generation would reserve

    def refused(last: int, ceiling: int) -> tuple[int, int]:
        raise MetaServiceUnavailable("another MetaService reserved generations meanwhile")

    t.reserve, works = refused, t.reserve
    with pytest.raises(MetaServiceUnavailable):
        commit(t, 1, r.arena, objs)
    assert not any(t.exists(k) for k, _ in objs)
    t.reserve = works
    assert commit(t, 1, r.arena, objs).codes == [0] * len(objs)
    assert all(t.exists(k) for k, _ in objs)
