"""Scenario tests for the object table: two-phase put, leases, LRU eviction, pending reclaim, recovery."""

from __future__ import annotations

import pytest

from memcache_core import errors
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta.table import ObjectTable
from memcache_core.protocol import ObjectReport, SegmentInfo

MB = 1 << 20
OBJ = MB - HEADER_BYTES     # an object of OBJ payload bytes takes exactly 1 MB with its header


def make(n_segments: int = 1, size: int = 10 * MB, high: float = 90, low: float = 50,
         lease_s: float = 1.0) -> ObjectTable:
    t = ObjectTable(high, low, lease_s, pending_timeout_s=5.0, first_generation=7 << 32)
    for i in range(1, n_segments + 1):
        t.add_segment(SegmentInfo(i, size, "h", f"/dev/shm/x{i}", "127.0.0.1:1"))
    return t


def put(t: ObjectTable, key: str, size: int = OBJ, now: float = 0.0, order: list[int] | None = None) -> int:
    code, gen, _ = t.alloc(1, key, size, 1, order or list(t.segments), now)
    if code == 0:
        assert t.commit(1, key, gen, now) == 0
    return code


def test_pending_objects_are_invisible_until_commit():
    t = make()
    code, gen, locs = t.alloc(1, "k", 100, 1, [1], 0.0)
    assert code == 0 and len(locs) == 1
    assert not t.exists("k") and t.lookup("k", 0.0, True) is None
    # Scenario: a second writer of a pending key is told the write is in progress, not "stored".
    assert t.alloc(2, "k", 100, 1, [1], 0.0)[0] == errors.WRITE_IN_PROGRESS
    assert t.commit(1, "k", gen + 1, 0.0) == errors.STATE_MISMATCH
    assert t.commit(1, "k", gen, 0.0) == 0
    assert t.exists("k") and t.lookup("k", 0.0, True) is not None


def test_abort_and_pending_deadline_give_the_space_back():
    t = make()
    seg = t.segments[1]
    seg.rotates = True                       # (its owner rotates its fence when asked: Join.rotates)
    _, gen, _ = t.alloc(1, "a", OBJ, 1, [1], 0.0)
    t.alloc(2, "b", OBJ, 1, [1], 0.0)
    t.alloc(3, "c", OBJ, 1, [1], 0.0)
    t.abort(2, "a", gen)                     # not the writer's: ignored
    assert seg.allocator.used == 3 * MB
    t.abort(1, "a", gen)
    assert seg.allocator.used == 2 * MB
    old = seg.fence
    assert t.reclaim(1.0, {2}) == 1          # writer 2 died
    assert seg.rotate_to not in (0, old)     # the owner is asked to rotate its fence
    asked = seg.rotate_to
    assert t.reclaim(5.0) == 1               # c passed its deadline
    assert not t.objects
    # Scenario: a reclaimed writer may be frozen mid-copy, not dead, and its grant's fence token still
    # opens the segment: its space stays out of use, however long, until the owner rotated its fence.
    t.reclaim(1000.0)
    assert seg.allocator.used == 2 * MB and seg.fence == old
    assert seg.rotated(old) == 0 and seg.rotated(asked + 1) == 0   # (not the token asked for)
    assert seg.rotated(asked) == 2 * MB
    assert seg.allocator.used == 0 and seg.fence == asked and seg.rotate_to == 0   # grants carry the new token


def test_reclaimed_space_of_an_owner_that_cannot_rotate_stays_out_of_use():
    """Scenario: an owner of an older build (no ``Join.rotates``) is never asked to rotate; a grant
    reclaimed in its segment keeps its space out of use (until the segment re-joins or leaves) rather
    than giving it to another object while the frozen writer's token still opens the fence."""
    t = make()
    t.alloc(1, "a", OBJ, 1, [1], 0.0)
    assert t.reclaim(5.0) == 1
    t.reclaim(10_000.0)
    assert t.segments[1].rotate_to == 0 and t.segments[1].allocator.used == MB


def test_lru_eviction_between_watermarks_keeps_recently_read_objects():
    """Scenario: 9 of 10 MB used (high 90%); a new put evicts least-recently-used objects down to 50%."""
    t = make()
    for i in range(9):
        assert put(t, f"k{i}", now=float(i)) == 0
    t.lookup("k0", 100.0, lease=True)       # a read (its lease ends at 101) makes k0 recent
    assert put(t, "new", now=200.0) == 0
    survivors = {k for k in t.objects}
    assert "k0" in survivors and "new" in survivors
    assert "k1" not in survivors and "k2" not in survivors
    assert t.segments[1].allocator.used <= 5 * MB + MB


def test_exist_does_not_pin_or_refresh():
    t = make()
    for i in range(9):
        put(t, f"k{i}", now=float(i))
    for _ in range(10):
        assert t.exists("k0")
    put(t, "new", now=100.0)
    assert not t.exists("k0")


def test_leased_objects_are_not_evicted_and_removal_waits_for_the_lease():
    t = make(lease_s=10.0)
    for i in range(9):
        put(t, f"k{i}", now=0.0)
    assert t.lookup("k0", 20.0, lease=True) is not None      # leased until 30.0
    put(t, "new", now=21.0)
    assert t.exists("k0")
    assert t.remove("k0", 22.0) == 0
    assert not t.exists("k0")
    used = t.segments[1].allocator.used
    t.reclaim(25.0)
    assert t.segments[1].allocator.used == used              # still leased: space not reused
    t.reclaim(31.0)
    assert t.segments[1].allocator.used == used - MB


def test_put_that_cannot_fit_fails_with_out_of_space_never_blocks():
    t = make(size=4 * MB, lease_s=100.0)
    for i in range(3):
        put(t, f"k{i}", now=0.0)
    for i in range(3):
        t.lookup(f"k{i}", 1.0, lease=True)     # everything is leased
    assert put(t, "more", 2 * OBJ, now=2.0) == errors.OUT_OF_MEMORY
    assert put(t, "huge", 5 * MB, now=2.0) == errors.OVER_CAPACITY
    assert t.counters.alloc_failures == 2


def test_placement_order_and_replicas():
    t = make(n_segments=3)
    code, _, locs = t.alloc(1, "r", OBJ, 2, [2, 1, 3], 0.0)
    assert code == 0 and [loc.segment_id for loc in locs] == [2, 1]


def test_dead_segment_drops_its_objects_but_keeps_other_replicas():
    t = make(n_segments=2)
    put(t, "only-on-1", order=[1])
    code, gen, _ = t.alloc(1, "both", OBJ, 2, [1, 2], 0.0)
    t.commit(1, "both", gen, 0.0)
    assert t.drop_segment(1) == 1
    assert not t.exists("only-on-1")
    assert [loc.segment_id for loc in t.objects["both"].locations] == [2]


def test_recovery_from_reports_and_generations_stay_unique():
    t = make(n_segments=0)
    refused = t.add_segment(SegmentInfo(1, 10 * MB, "h", "/x", "a:1"),
                            [ObjectReport("a", 0, OBJ, (7 << 32) + 5), ObjectReport("b", MB, OBJ, (7 << 32) + 9)])
    assert refused == [] and t.exists("a") and t.exists("b")
    assert t.segments[1].allocator.used == 2 * MB
    code, gen, locs = t.alloc(1, "c", OBJ, 1, [1], 0.0)
    assert gen > (7 << 32) + 9 and locs[0].offset == 2 * MB
    # a second segment reporting a different object under an existing key is refused
    refused = t.add_segment(SegmentInfo(2, 10 * MB, "h", "/y", "b:1"), [ObjectReport("a", 0, OBJ, 1)])
    assert [r.key for r in refused] == ["a"]


@pytest.mark.parametrize("n", [1, 50])
def test_journal_tells_the_owner_what_left_its_segment(n):
    """Scenario: commits need no journal (the headers in the segment describe them); every object that
    leaves (removed, evicted, aborted) is journaled so the owner clears its header."""
    t = make()
    for i in range(n):
        put(t, f"k{i}", size=100_000)
    assert t.segments[1].journal_since(0) == []
    t.remove("k0", 10.0)
    _, gen, _ = t.alloc(1, "pending", 100, 1, [1], 10.0)
    t.abort(1, "pending", gen)
    j = t.segments[1].journal_since(0)
    assert [(e.added, e.obj.key) for e in j] == [(False, "k0"), (False, "pending")]
    assert t.segments[1].journal_since(j[-1].seq) == []


def test_the_acknowledged_point_only_rises_and_never_passes_what_was_journaled():
    """Scenario: heartbeats acknowledge the journal; an ack from an older heartbeat (lower) does not
    move it back, an ack past the last entry (a member of an earlier table) stops at the last entry,
    and the empty journal of a quiet segment answers every heartbeat with a list of its own."""
    t = make()
    put(t, "k0", size=100_000)
    put(t, "k1", size=100_000)
    seg = t.segments[1]
    assert seg.journal_since(5) == [] and seg.acked == 0   # nothing journaled: nothing to acknowledge
    t.remove("k0", 10.0)
    t.remove("k1", 10.0)
    first, second = seg.journal_since(0)
    assert seg.journal_since(first.seq) == [second] and seg.acked == first.seq
    assert seg.journal_since(0) == [second] and seg.acked == first.seq   # a stale ack moves nothing
    assert seg.journal_since(second.seq + 100) == [] and seg.acked == second.seq
    a, b = seg.journal_since(second.seq), seg.journal_since(second.seq)
    assert a == b == [] and a is not b


def test_second_writer_commit_and_foreign_commit_are_refused():
    """Scenario: only the writer that allocated a pending object may commit or abort it."""
    t = make()
    _, gen, _ = t.alloc(1, "k", 100, 1, [1], 0.0)
    assert t.commit(2, "k", gen, 0.0) == errors.STATE_MISMATCH
    assert t.commit(1, "k", gen, 0.0, checksum=1234) == 0
    assert t.objects["k"].checksum == 1234


def test_remove_prefix_takes_one_namespace_only():
    t = make()
    for k in ("ns1.a", "ns1.b", "ns2.a", "ns10.a"):
        put(t, k, size=1000)
    _, gen, _ = t.alloc(1, "ns1.pending", 100, 1, [1], 0.0)
    assert t.remove_prefix("ns1.", 1.0) == 2
    assert sorted(k for k, o in t.objects.items() if o.committed) == ["ns10.a", "ns2.a"]
    assert "ns1.pending" in t.objects        # a pending put is not removed under its writer


def test_corrupt_report_drops_that_generation_only():
    t = make()
    put(t, "k", size=1000)
    gen = t.objects["k"].generation
    assert not t.corrupt("k", gen + 1, 1.0) and t.exists("k")
    assert t.corrupt("k", gen, 1.0) and not t.exists("k")
    assert t.counters.integrity_failures == 2
