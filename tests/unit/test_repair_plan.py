"""Scenario tests for re-replication (meta/repair.py) on a real object table, time passed in."""

from __future__ import annotations

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta.repair import REST_S, Repairs
from memcache_core.meta.table import ObjectTable

MB = 1 << 20
OBJ = MB - HEADER_BYTES     # one object of OBJ payload bytes takes exactly 1 MB with its header


class Pool:
    """A table of segments (ids 1..n, hosts as given) and its Repairs; owners answer unless silenced."""

    def __init__(self, hosts: str = "abc", mb: int = 10) -> None:
        self.t = ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
        for i, host in enumerate(hosts, start=1):
            self.t.add_segment(p.SegmentInfo(i, mb * MB, host, f"/dev/shm/x{i}", "127.0.0.1:1"))
            self.t.segments[i].rotates = True   # (owners rotate their fence when asked: Join.rotates)
        self.silent: set[int] = set()
        self.drained: set[int] = set()
        self.r = Repairs(lambda: self.t, 5.0, lambda sid, now: sid not in self.silent,
                         lambda sid: sid in self.drained, settle_s=1.0, settle_until=0.0)

    def put(self, key: str, segments: list[int], checksum: int = 0x1234) -> None:
        code, gen, locs = self.t.alloc(1, key, OBJ, len(segments), segments, 0.0, preferred=segments)
        assert code == 0 and [loc.segment_id for loc in locs] == segments
        assert self.t.commit(1, key, gen, 0.0, checksum) == 0

    def holders(self, key: str) -> list[int]:
        return [loc.segment_id for loc in self.t.objects[key].locations]

    def done(self, source: int, batch: p.DrainBatch, ok: bool = True, checksum: int | None = None,
             now: float = 1.0) -> list[int]:
        ms = batch.moves
        return self.r.report(source, p.RepairDone(0, b"", [m.key for m in ms], [m.new_generation for m in ms],
                                                  [m.checksum if checksum is None else checksum for m in ms],
                                                  [ok] * len(ms)), now)

    def free(self) -> list[int]:
        return [s.allocator.free for s in self.t.segments.values()]


def test_a_replica_lost_with_its_segment_is_copied_from_the_survivor_to_a_new_host():
    pool = Pool("abcc")
    pool.put("k", [1, 2])
    pool.t.drop_segment(2)                      # its holder died
    assert pool.t.under_replicated == 1
    pool.r.housekeeping(0.5)
    assert pool.r.wanted(1) and not pool.r.wanted(3)
    early = p.DrainBatch([pool.r.copies["k"].move()])
    assert pool.done(1, early) == [errors.STATE_MISMATCH]   # planned, not handed out yet
    b = pool.r.next_batch(1, 0.6)
    [m] = b.moves
    # the copy is a replica: same generation and checksum in its header
    assert m.generation == m.new_generation == pool.t.objects["k"].generation and m.checksum == 0x1234
    assert m.target.segment_id in (3, 4)
    # until the holder reports, readers see one replica; only the holder asked can report the copy
    assert pool.holders("k") == [1]
    assert pool.done(3, b) == [errors.STATE_MISMATCH] and pool.r.stats()["repairs_in_flight"] == 1
    assert pool.done(1, b) == [errors.SUCCESS]
    assert pool.holders("k") == [1, m.target.segment_id]
    assert pool.t.under_replicated == 0 and pool.r.stats()["repaired_objects"] == 1
    assert pool.t.segments[m.target.segment_id].lru.get("k") is pool.t.objects["k"]
    pool.r.housekeeping(2.0)
    assert not pool.r.wanted(1) and pool.r.stats()["repairs_in_flight"] == 0


def test_hosts_without_a_replica_come_first():
    pool = Pool("aab")
    pool.put("k", [1, 2, 3])
    pool.t.drop_segment(3)                      # host b lost its replica; host a holds two
    pool.t.add_segment(p.SegmentInfo(4, 10 * MB, "a", "/dev/shm/x4", "127.0.0.1:1"))
    pool.t.add_segment(p.SegmentInfo(5, 10 * MB, "b", "/dev/shm/x5", "127.0.0.1:1"))
    pool.r.housekeeping(0.5)
    [m] = pool.r.next_batch(1, 0.5).moves
    assert m.target.segment_id == 5


def test_a_copy_of_an_object_removed_meanwhile_is_not_added_and_its_space_comes_back():
    pool = Pool()
    pool.put("k", [1, 2])
    pool.t.drop_segment(2)
    before = pool.free()
    pool.r.housekeeping(0.5)
    b = pool.r.next_batch(1, 0.5)
    assert pool.free() != before                # space reserved for the copy
    assert pool.t.remove("k", 0.7) == 0
    assert pool.done(1, b) == [errors.STATE_MISMATCH]
    pool.t.reclaim(10.0)                        # the removed object's own space after its lease
    assert pool.free() == [10 * MB, 10 * MB]
    assert "k" not in pool.t.objects


def test_a_source_that_fails_its_checksum_is_dropped_as_a_corrupt_replica():
    pool = Pool("abcd")
    pool.put("k", [1, 2, 3])
    pool.t.drop_segment(3)
    pool.r.housekeeping(0.5)
    b = pool.r.next_batch(1, 0.5)
    assert pool.done(1, b, checksum=0x9999) == [errors.CHECKSUM_MISMATCH]
    assert pool.holders("k") == [2]             # segment 1's copy was corrupt: only 2's is left
    assert pool.t.counters.integrity_failures == 1
    # and the object is repaired from the good replica on a later pass
    pool.r.housekeeping(1.0)
    assert pool.r.wanted(2)


def test_a_failed_copy_rests_then_is_planned_again_and_unreported_copies_time_out():
    pool = Pool()
    pool.put("k", [1, 2])
    pool.t.drop_segment(2)
    pool.r.housekeeping(0.5)
    b = pool.r.next_batch(1, 0.5)
    assert pool.done(1, b, ok=False) == [errors.ERROR]
    assert pool.free() == [10 * MB - MB, 10 * MB]   # the target's space came back at once
    pool.r.housekeeping(1.0)
    assert not pool.r.wanted(1)                 # resting
    pool.r.housekeeping(1.0 + REST_S)
    assert pool.r.wanted(1)
    pool.r.next_batch(1, 1.0 + REST_S)
    pool.r.housekeeping(1.0 + REST_S + 6.0)     # handed out, never reported: quarantined, then freed
    assert pool.r.stats()["repair_failed_copies"] == 2 and pool.r.stats()["repairs_in_flight"] == 0
    assert pool.free()[1] < 10 * MB
    pool.t.reclaim(1.0 + REST_S + 600.0)
    assert pool.free()[1] < 10 * MB             # (out of use until the target's fence rotated)
    target = next(s for s in pool.t.segments.values() if s.fenced)
    assert target.rotated(target.rotate_to)
    assert pool.free() == [10 * MB - MB, 10 * MB]


def test_no_copy_from_a_draining_or_silent_holder_nor_to_a_silent_or_full_segment():
    pool = Pool("ab", mb=2)
    pool.put("k", [1])
    pool.t.objects["k"].replicas = 2            # as a partial placement would leave it
    pool.t._mark(pool.t.objects["k"])
    pool.put("fill", [2])                       # segment 2 is at its high-water mark: no room without eviction
    pool.r.housekeeping(0.5)
    assert not pool.r.wanted(1)
    pool.t.remove("fill", 0.5)
    pool.t.reclaim(10.0)
    pool.silent = {2}
    pool.r.housekeeping(0.6)
    assert not pool.r.wanted(1)
    pool.silent, pool.drained = {1}, set()
    pool.r.housekeeping(0.7)
    assert not pool.r.wanted(1)
    pool.silent, pool.drained = set(), {1}
    pool.r.housekeeping(0.8)
    assert not pool.r.wanted(1)
    pool.drained = set()
    pool.r.housekeeping(0.9)
    [m] = pool.r.next_batch(1, 0.9).moves
    assert m.target.segment_id == 2


def test_a_target_or_source_that_leaves_ends_its_copies_and_a_silent_target_fails_the_report():
    pool = Pool("abcd")
    for k in ("x", "y"):
        pool.put(k, [1, 2])
    pool.t.drop_segment(2)
    pool.r.housekeeping(0.5)
    b = pool.r.next_batch(1, 0.5)
    targets = {m.target.segment_id for m in b.moves}
    pool.silent = targets
    assert pool.done(1, b) == [errors.STATE_MISMATCH] * 2
    assert pool.holders("x") == [1] and pool.r.stats()["repair_failed_copies"] == 2
    pool.silent = set()
    pool.r.housekeeping(1.0 + REST_S)          # (they rested from the report on)
    b = pool.r.next_batch(1, 1.0 + REST_S)
    assert len(b.moves) == 2
    pool.r.segment_left(1, 11.0)                 # the holder died mid-copy
    pool.t.drop_segment(1)
    assert pool.r.stats()["repairs_in_flight"] == 0
    assert pool.done(1, b, now=11.0) == [errors.STATE_MISMATCH] * 2


def test_nothing_is_planned_while_members_may_still_be_rejoining_or_when_disabled():
    pool = Pool()
    pool.put("k", [1, 2])
    pool.t.drop_segment(2)
    pool.r.settle_until = 3.0
    pool.r.housekeeping(1.0)
    assert not pool.r.wanted(1)
    pool.r.enabled = False
    pool.r.housekeeping(4.0)
    assert not pool.r.wanted(1)
    pool.r.enabled = True
    pool.r.housekeeping(4.0)
    assert pool.r.wanted(1)


def test_in_flight_copies_are_bounded():
    from memcache_core.meta import repair
    pool = Pool("abc", mb=64)
    for i in range(30):
        pool.put(f"k{i}", [1, 2])
    pool.t.drop_segment(2)
    old = repair.IN_FLIGHT_OBJECTS
    repair.IN_FLIGHT_OBJECTS = 8
    try:
        pool.r.housekeeping(0.5)
        assert pool.r.stats()["repairs_in_flight"] == 8
        b = pool.r.next_batch(1, 0.5)
        assert pool.done(1, b) == [0] * 8
        pool.r.housekeeping(0.6)
        assert len(pool.r.next_batch(1, 0.6).moves) == 8
    finally:
        repair.IN_FLIGHT_OBJECTS = old
    assert pool.t.under_replicated == 30 - 8    # the second eight are not reported yet


def test_a_holder_declared_dead_that_re_joins_after_the_repair_has_its_surplus_copy_refused():
    """Scenario: replicas on 1 and 2; 2 is declared dead, the object is repaired onto 3; then 2's owner
    re-joins (not a MetaService start) and reports its old copy: refused (its owner forgets it, the
    space is free), the object keeps two replicas. An object not repaired takes the copy back."""
    pool = Pool("abc")
    pool.put("k", [1, 2])
    pool.put("other", [1, 2])
    old = {k: next(loc for loc in pool.t.objects[k].locations if loc.segment_id == 2) for k in ("k", "other")}
    pool.t.drop_segment(2)
    pool.r.resting["other"] = 100.0             # only "k" is repaired
    pool.r.housekeeping(0.5)
    assert pool.done(1, pool.r.next_batch(1, 0.5)) == [errors.SUCCESS]
    assert pool.holders("k") == [1, 3] and pool.holders("other") == [1]
    reports = [p.ObjectReport(k, old[k].offset, OBJ, pool.t.objects[k].generation, pool.t.objects[k].checksum)
               for k in ("k", "other")]
    refused = pool.t.add_segment(p.SegmentInfo(2, 10 * MB, "b", "/dev/shm/x2", "127.0.0.1:1"), reports,
                                 recovering=False)
    assert [r.key for r in refused] == ["k"]
    assert pool.holders("k") == [1, 3] and pool.holders("other") == [1, 2]
    assert pool.t.objects["k"].replicas == 2 and pool.t.under_replicated == 0
    assert pool.t.segments[2].allocator.used == MB          # only "other"'s copy takes space there


def test_a_copy_no_longer_needed_when_reported_is_not_added():
    """Scenario: 2's holder is declared dead and a copy of k is under way when it re-joins with its
    own copy (k is whole again): the finished copy is not added (no third replica), its space comes
    back."""
    pool = Pool("abc")
    pool.put("k", [1, 2])
    old = next(loc for loc in pool.t.objects["k"].locations if loc.segment_id == 2)
    pool.t.drop_segment(2)
    pool.r.housekeeping(0.5)
    b = pool.r.next_batch(1, 0.5)
    o = pool.t.objects["k"]
    pool.t.add_segment(p.SegmentInfo(2, 10 * MB, "b", "/dev/shm/x2", "127.0.0.1:1"),
                       [p.ObjectReport("k", old.offset, OBJ, o.generation, o.checksum)], recovering=False)
    assert pool.holders("k") == [1, 2]
    assert pool.done(1, b) == [errors.STATE_MISMATCH]
    assert pool.holders("k") == [1, 2] and pool.t.segments[3].allocator.used == 0


def test_copies_are_spread_over_two_empty_providers_not_all_put_on_the_first_to_join():
    """Scenario: 200 objects lose one of their two replicas; two empty providers (joined one after
    the other, so the first is first in every listing) are the only segments that can take copies.
    Each takes about half the copies: a later loss of both holders of one object stays a minority,
    where "most free ratio first, first joined wins ties" sent all 200 to one provider."""
    pool = Pool("abcd", mb=400)
    keys = [f"k{i}" for i in range(200)]
    for k in keys:
        pool.put(k, [1, 2])
    pool.t.drop_segment(2)
    assert pool.t.under_replicated == 200
    pool.r.housekeeping(0.5)
    targets = [c.target.info.segment_id for c in pool.r.copies.values()]
    assert len(targets) == 200 and set(targets) == {3, 4}
    assert abs(targets.count(3) - targets.count(4)) <= 20, targets   # freer-of-two: near even


def test_when_the_survivors_are_full_a_repair_pushes_out_colder_objects_never_hotter_ones():
    """Scenario: k (2 replicas, read at t=5) loses one with its holder; the only other segment is at
    its high-water mark with objects put at t=0 (cold) and one read at t=8 (hotter than k). The
    repair evicts one cold object (the least recently used) to make room, never the hotter one."""
    pool = Pool("abc", mb=10)
    pool.t.lease_ttl_s = 1.0
    for i in range(9):
        pool.put(f"c{i}", [3])
    pool.put("k", [1, 2])
    pool.t.lookup("k", 5.0, True)          # used until t=6
    pool.t.lookup("c8", 8.0, True)         # used until t=9
    pool.t.drop_segment(2)
    pool.r.housekeeping(10.0)
    [m] = pool.r.next_batch(1, 10.0).moves
    assert m.target.segment_id == 3 and pool.done(1, p.DrainBatch([m]), now=10.0) == [0]
    assert pool.holders("k") == [1, 3] and "c0" not in pool.t.objects and pool.t.counters.evictions == 1
    assert all(f"c{i}" in pool.t.objects for i in range(1, 9))


def test_a_repair_evicts_nothing_when_every_object_there_is_hotter():
    """Scenario: as above, but every object of the full segment was read after k: the repair plans
    no copy and evicts nothing; k stays short of one replica (counted) until room comes."""
    pool = Pool("abc", mb=10)
    pool.t.lease_ttl_s = 1.0
    for i in range(9):
        pool.put(f"c{i}", [3])
    pool.put("k", [1, 2])
    pool.t.lookup("k", 5.0, True)
    for i in range(9):
        pool.t.lookup(f"c{i}", 8.0, True)
    pool.t.drop_segment(2)
    pool.r.housekeeping(10.0)
    assert pool.r.copies == {} and pool.t.counters.evictions == 0 and len(pool.t.objects) == 10
    assert pool.t.under_replicated == 1


def test_copies_made_before_a_second_provider_joined_are_spread_onto_it():
    """Scenario: 40 objects lose one of their two replicas; provider 3 joins and takes every copy
    (the only segment with room); provider 4 joins after the repair is over. The copies are then
    spread: 20 of them move from 3 to 4 (a copy from 3 that replaces 3's replica), so that losing 3
    with the last original holder loses half, not all; nothing more moves once they are even."""
    pool = Pool("ab", mb=100)
    keys = [f"k{i}" for i in range(40)]
    for k in keys:
        pool.put(k, [1, 2])
    pool.t.drop_segment(2)
    pool.t.add_segment(p.SegmentInfo(3, 100 * MB, "c", "/dev/shm/x3", "127.0.0.1:1"))
    pool.r.housekeeping(0.5)
    assert pool.done(1, pool.r.next_batch(1, 0.5)) == [0] * 40
    assert all(pool.holders(k) == [1, 3] for k in keys)
    pool.t.add_segment(p.SegmentInfo(4, 100 * MB, "d", "/dev/shm/x4", "127.0.0.1:1"))
    pool.r.housekeeping(2.0)
    assert not pool.r.wanted(1) and pool.r.wanted(3)
    b = pool.r.next_batch(3, 2.0)
    assert len(b.moves) == 20 and {m.target.segment_id for m in b.moves} == {4}
    assert all(m.new_generation == pool.t.objects[m.key].generation for m in b.moves)   # replicas
    assert pool.done(3, b, now=2.1) == [0] * 20
    on = {s: [k for k in keys if s in pool.holders(k)] for s in (1, 3, 4)}
    assert (len(on[1]), len(on[3]), len(on[4])) == (40, 20, 20)
    assert all(len(pool.holders(k)) == 2 for k in keys) and pool.t.under_replicated == 0
    assert pool.t.segments[3].allocator.used == 20 * MB and pool.r.totals.spread_objects == 20
    pool.r.housekeeping(3.0)
    assert pool.r.copies == {}                     # even: nothing more to move
