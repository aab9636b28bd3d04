"""What each member keeps in the pool (``ObjectTable.kept_of``, the ``member_max_objects`` /
``member_max_bytes`` quotas): counted at commit, given back whichever way an object leaves the table,
and carried by the object itself (``Obj.writer_slot``) so nothing scans the table."""

from __future__ import annotations

import pytest

from memcache_core import protocol as p
from memcache_core.layout import footprint
from memcache_core.meta.allocator import aligned
from memcache_core.meta.objects import WRITER_SLOTS
from memcache_core.meta.table import ObjectTable


def _table(*sizes: int) -> ObjectTable:
    t = ObjectTable(90, 80, 10.0, 120.0, 1 << 40)
    for sid, size in enumerate(sizes, start=1):
        t.add_segment(p.SegmentInfo(sid, size, f"h{sid}", f"/dev/shm/memcache-{sid}-ab", "127.0.0.1:9"))
    return t


def _put(t: ObjectTable, writer: int, key: str, size: int, order: list[int], replicas: int = 1) -> None:
    code, gen, _ = t.alloc(writer, key, size, replicas, order, 0.0)
    assert code == 0 and t.commit(writer, key, gen, 0.0, checksum=(1 << 64) - 1) == 0


def _consistent(t: ObjectTable) -> None:
    """The counts are the table's: recounted from the objects' slots, and slots freed when empty."""
    want: dict[int, list[int]] = {}
    for o in t.objects.values():
        if o.committed and o.writer_slot:
            w = want.setdefault(t.writer_in[o.writer_slot], [0, 0])
            w[0] += 1
            w[1] += o.size
    assert t.kept_of == want
    assert set(t.slot_of) == set(want) and len(t._free_slots) == WRITER_SLOTS - len(want)


def test_kept_objects_are_counted_per_writer_and_given_back_on_remove_and_death_of_a_segment():
    """Scenario: two writers put into two segments (one object with two replicas); remove, the death of
    one segment (its single-replica objects leave, the replicated one lives on) and remove_all each give
    the writers' counts back; the checksum and fields stay intact beside the slot."""
    t = _table(1 << 20, 1 << 20)
    _put(t, 101, "a", 100, [1])
    _put(t, 101, "b", 200, [2])
    _put(t, 202, "c", 300, [1, 2], replicas=2)
    assert t.kept_of == {101: [2, 300], 202: [1, 300]}
    assert t.objects["a"].checksum == (1 << 64) - 1 and t.objects["c"].size == 300
    _consistent(t)
    assert t.remove("b", 1.0) == 0 and t.kept_of[101] == [1, 100]
    t.drop_segment(1)   # "a" had its only copy there; "c" keeps its replica in segment 2
    assert 101 not in t.kept_of and t.kept_of == {202: [1, 300]} and "c" in t.objects
    _consistent(t)
    t.remove_all(2.0)
    assert t.kept_of == {} and not t.slot_of
    _consistent(t)


def test_eviction_gives_the_writers_count_back():
    """Scenario: one writer fills a small segment past its high-water mark; the objects evicted to
    make room leave its count, which stays equal to what the table holds."""
    t = _table(20 * aligned(footprint(1000)))
    for i in range(40):
        _put(t, 7, f"k{i}", 1000, [1])
        t.evict_all(float(i))
    assert t.counters.evictions > 0
    assert t.kept_of[7][0] == sum(1 for o in t.objects.values() if o.committed) < 40
    _consistent(t)


def test_recovered_objects_count_against_the_member_holding_them_and_a_moved_object_keeps_its_writer():
    """Scenario: after a MetaService restart the segments' reports do not name the writer: recovered
    objects count against the member whose segment holds them (its id is the segment's), and a report
    past that member's quota is refused (its owner forgets it). A replica dropped after a checksum
    failure keeps the object's writer."""
    t = _table(1 << 20)
    t.member_quota = (2, 0)
    refused = t.add_segment(p.SegmentInfo(9, 1 << 20, "h9", "/dev/shm/memcache-9-ab", "127.0.0.1:9"),
                            [p.ObjectReport(f"old{i}", i * 4096, 10, 5, 0) for i in range(3)])
    assert [r.key for r in refused] == ["old2"] and "old2" not in t.objects
    assert t.objects["old0"].writer_slot == t.slot_of[9] and t.kept_of == {9: [2, 20]}
    # past the quota, what was written last survives: a report of a newer generation takes the place
    # of the oldest recovered (whatever the offsets' order), one older than all is refused
    t.drop_segment(9)
    refused = t.add_segment(p.SegmentInfo(9, 1 << 20, "h9", "/dev/shm/memcache-9-ab", "127.0.0.1:9"),
                            [p.ObjectReport(f"g{g}", i * 4096, 10, g, 0) for i, g in enumerate((7, 3, 9, 5))])
    assert [r.key for r in refused] == ["g5"] and sorted(t.objects) == ["g7", "g9"]
    assert [e.obj.key for e in t.segments[9].journal] == ["g3"]   # its owner forgets it
    assert t.kept_of == {9: [2, 20]}
    _put(t, 3, "new", 10, [1, 9], replicas=2)
    assert t.corrupt("new", t.objects["new"].generation, 1.0, segment_id=1)
    assert t.objects["new"].writer_slot == t.slot_of[3] and t.kept_of == {9: [2, 20], 3: [1, 10]}
    _consistent(t)


def test_a_segment_reporting_in_batches_takes_no_new_object_until_its_last_batch():
    """Scenario: a segment joins with the first batch of its objects and more to follow (``Report``).
    Until the last batch nothing is allocated in it (its unreported space may hold objects); a report
    overlapping one taken before, or naming a key twice in the segment, is refused; after the last
    batch every object reported is in the table, counted against the member, and the space between
    them is allocatable, never the space they hold."""
    t = ObjectTable(90, 80, 10.0, 120.0, 1 << 40)
    info = p.SegmentInfo(9, 1 << 20, "h9", "/dev/shm/memcache-9-ab", "127.0.0.1:9")
    assert t.add_segment(info, [p.ObjectReport("a", 0, 100, 5, 0)], more=True) == []
    assert t.alloc(1, "x", 100, 1, [9], 0.0)[0] != 0, "a reporting segment took a new object"
    refused = t.report(9, [p.ObjectReport("b", 8192, 100, 5, 0), p.ObjectReport("c", 8192 + 64, 100, 5, 0),
                           p.ObjectReport("a", 16384, 100, 5, 0)], False, 0.0)
    assert sorted(r.key for r in refused) == ["a", "c"]
    assert t.alloc(1, "x", 100, 1, [9], 0.0)[0] != 0
    assert t.report(9, [p.ObjectReport("d", 1 << 19, 100, 5, 0)], True, 0.0) == []
    assert sorted(t.objects) == ["a", "b", "d"] and t.kept_of == {9: [3, 300]}
    taken = {(o.locations[0].offset, o.locations[0].offset + footprint(o.size)) for o in t.objects.values()}
    for i in range(40):
        code, gen, locs = t.alloc(1, f"n{i}", 4000, 1, [9], 0.0)
        assert code == 0, code
        lo = locs[0].offset
        assert all(lo + footprint(4000) <= a or lo >= b for a, b in taken), "new space overlaps a reported object"
    with pytest.raises(ValueError, match="not reporting"):
        t.report(9, [], True, 0.0)


def test_when_every_slot_is_held_a_new_writer_is_stored_and_counted_against_no_one():
    """Scenario: 4,095 writers keep objects (every slot held); a new writer's put is still stored (never
    refused: an insider joining 4,095 times must not lock new writers out), counted against no one
    (``uncounted_writes``); once a slot comes back, the next writer is counted again."""
    t = _table(1 << 30)
    for w in range(1, WRITER_SLOTS + 1):
        _put(t, w, f"k{w}", 1, [1])
    new = WRITER_SLOTS + 1
    _put(t, new, "uncounted", 1, [1])
    assert t.objects["uncounted"].writer_slot == 0 and new not in t.kept_of and t.counters.uncounted_writes == 1
    assert t.remove("k1", 1.0) == 0
    _put(t, new, "counted", 1, [1])
    assert t.kept_of[new] == [1, 1]
    _consistent(t)


def test_evict_own_takes_the_writers_least_recent_unleased_object_and_no_one_elses():
    """Scenario: writers 1 and 2 share a segment; writer 1 evicts one of its own: its least recently
    used unleased one (a leased one is skipped), never writer 2's, and nothing when all its are leased."""
    t = _table(1 << 20)
    _put(t, 2, "theirs", 10, [1])
    for k in ("a", "b", "c"):
        _put(t, 1, k, 10, [1])
    assert t.lookup("a", 0.0, True) is not None   # leased until 10.0, and now the most recent
    assert t.evict_own(1, 1.0) and "b" not in t.objects and t.kept_of[1] == [2, 20]
    assert t.evict_own(1, 1.0) and "c" not in t.objects
    assert not t.evict_own(1, 1.0) and "a" in t.objects and "theirs" in t.objects
    assert not t.evict_own(99, 1.0)
    _consistent(t)


def test_evict_own_looks_in_the_writers_own_segment_first():
    """Scenario: segment 1 is full of another writer's objects (more than the look-ahead); writer 2 at
    its quota still finds its own object in its own segment 2."""
    from memcache_core.meta.kept import OWN_LOOKAHEAD
    t = _table(1 << 24, 1 << 20)
    for i in range(OWN_LOOKAHEAD + 10):
        _put(t, 1, f"theirs{i}", 1, [1])
    _put(t, 2, "mine", 1, [2])
    assert t.evict_own(2, 0.0) and "mine" not in t.objects and len(t.objects) == OWN_LOOKAHEAD + 10


def test_an_object_another_member_leases_counts_against_the_leaser_not_in_its_writers_quota():
    """Scenario: writer 101 keeps three objects; member 303 leases two on the GVA path (101 leasing its
    own changes nothing). While leased they leave 101's quota (``quota_kept``), not its ``kept_of``; a
    removed lease, an ended one (housekeeping), a removed object and a new generation each end the
    loan, and the counts stay equal to what the table holds."""
    from memcache_core.meta import gva
    t = _table(1 << 20)
    for k, n in (("a", 100), ("b", 200), ("c", 300)):
        _put(t, 101, k, n, [1])
    assert gva.add_lease(t, 101, ["a"], [0], 5.0, 0.0) == [0]
    assert t.quota_kept(101) == (3, 600)
    assert gva.add_lease(t, 303, ["a", "b", "c"], [0] * 3, 5.0, 0.0) == [0] * 3
    assert t.quota_kept(101) == (0, 0) and t.kept_of[101] == [3, 600]
    assert gva.remove_lease(t, 303, ["a"]) == [0]
    assert t.quota_kept(101) == (1, 100)   # "a" is 101's own lease now: counted again
    assert t.remove("b", 1.0) == 0
    assert t.quota_kept(101) == (1, 100) and t.lent_of == {101: [1, 300]}
    gva.expire(t, 6.0)   # the leases ended
    assert t.quota_kept(101) == (2, 400) and t.lent == {} and t.lent_of == {}
    assert gva.add_lease(t, 303, ["c"], [0], 5.0, 7.0) == [0]
    assert t.remove("c", 8.0) == 0
    _put(t, 101, "c", 300, [1])   # a new generation: 303's lease was on the old one
    assert t.quota_kept(101) == (2, 400) and t.lent == {}
    _consistent(t)
