"""Scenario tests for the table's disk locations (meta/disk.py): offload windows, eviction to disk,
drops, promotions, and how a provider's reports are checked."""

from __future__ import annotations

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta import disk
from memcache_core.meta.table import ObjectTable

MB = 1 << 20
OBJ = MB - HEADER_BYTES


def make(policy: str = "on_evict") -> ObjectTable:
    t = ObjectTable(90, 80, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
    t.add_segment(p.SegmentInfo(1, 10 * MB, "h", "/dev/shm/x1", "127.0.0.1:1"))
    sync(t, policy=policy)
    return t


def put(t: ObjectTable, key: str, now: float = 0.0) -> int:
    code, gen, _ = t.alloc(1, key, OBJ, 1, [1], now)
    assert code == 0 and t.commit(1, key, gen, now, checksum=gen) == 0
    return gen


def sync(t: ObjectTable, added: list[p.ObjectReport] = (), dropped: list[p.ObjectReport] = (),  # type: ignore[assignment]
         room: int = 64 * MB, now: float = 0.0, policy: str = "on_evict") -> p.DiskWork:
    return disk.sync(t, 1, p.DiskSync(1, b"", policy, 100 * MB, 0, room, list(added), list(dropped)), now)


def report(t: ObjectTable, key: str) -> p.ObjectReport:
    o = t.objects[key]
    return p.ObjectReport(key, 0, o.size, o.generation, o.checksum)


def test_on_evict_offers_the_lru_head_above_the_mark_and_eviction_keeps_disk_objects():
    t = make()
    for i in range(2):
        put(t, f"k{i}")
    assert sync(t).offload == []                           # 2 MB of 10: under a quarter of the low mark
    for i in range(2, 8):
        put(t, f"k{i}")
    offered = [r.key for r in sync(t).offload]             # 8 MB used, mark 2 MB: the first 6 MB
    assert offered == [f"k{i}" for i in range(6)] and sync(t).offload == []   # not offered twice
    sync(t, added=[report(t, k) for k in offered[:3]])
    put(t, "k8")
    put(t, "k9")                                           # over 90%: eviction down to 80% - 1 MB (2 objects)
    gone = [k for k in t.objects if not t.objects[k].locations]
    assert gone == ["k0", "k1"] and all(t.exists(k) for k in gone)
    assert t.counters.evictions_to_disk == 2 and t.lookup("k0", 0.0, True) is not None
    assert t.counters.disk_hits == 1


def test_removed_and_dropped_disk_objects_leave_and_their_records_are_deleted():
    t = make("write_through")
    gens = [put(t, f"k{i}") for i in range(3)]
    assert sorted(r.key for r in sync(t, policy="write_through").offload) == ["k0", "k1", "k2"]
    sync(t, added=[report(t, f"k{i}") for i in range(3)], policy="write_through")
    t.to_disk_only(t.objects["k0"], 0.0)
    t.to_disk_only(t.objects["k1"], 0.0)
    assert t.remove("k0", 0.0) == 0
    # deleted through the owner's journal, which a remove's confirmation waits for
    assert [(e.obj.key, e.obj.generation) for e in t.segments[1].journal if e.disk] == [("k0", gens[0])]
    assert sync(t).drop == []
    sync(t, dropped=[p.ObjectReport("k1", 0, OBJ, gens[1], gens[1])])   # the tier dropped it: gone
    assert not t.exists("k1") and t.counters.disk_drops == 1
    sync(t, dropped=[p.ObjectReport("k2", 0, OBJ, gens[2], gens[2])])   # DRAM copy left: stays
    assert t.exists("k2") and t.objects["k2"].disk is None


def test_reports_that_mean_another_object_are_sent_back():
    t = make()
    put(t, "k")
    bad = [p.ObjectReport("k", 0, OBJ, 5, 12345),            # another checksum
           p.ObjectReport("k", 0, OBJ + 1, 5, 0),            # another size
           p.ObjectReport("gone", 0, OBJ, 5, 1)]             # no such object (create only at join)
    assert sync(t, added=bad).drop == bad and t.objects["k"].disk is None
    assert disk.add_reports(t, 1, [p.ObjectReport("new", 0, 10, 99, 7), bad[0]]) == 1
    assert t.exists("new") and t.objects["new"].locations == [] and sync(t).drop == [bad[0]]
    assert t.issue_generation() > 99


def test_promotion_gives_the_object_a_dram_location_again_and_a_dead_provider_takes_its_disk():
    t = make()
    disk.add_reports(t, 1, [p.ObjectReport("d", 0, OBJ, 99, 7)])
    assert disk.promote(t, 1, ["d", "absent"], 0.0)[1].code == errors.OBJECT_NOT_EXISTS
    res = disk.promote(t, 1, ["d"], 0.0)
    assert res[0].code == errors.OBJECT_ALREADY_EXISTS          # the first call reserved it already
    off = t.promoting[("d", 1)][1]
    assert disk.promoted(t, 1, p.Promoted(1, b"", ["d"], [off], [True]), 0.0) == [0]
    assert t.objects["d"].locations == [p.Location(1, off)] and t.counters.promotions == 1
    t.drop_segment(1)
    assert not t.exists("d")


def test_demote_keeps_disk_objects_on_disk_only_and_asks_for_copies_of_the_others():
    t = make()
    put(t, "a")
    put(t, "b")
    sync(t, added=[report(t, "a")])
    assert sync(t).offload == []                           # nothing changed: nothing scanned
    assert disk.demote(t, ["b", "x"], 0.0) == [errors.STATE_MISMATCH, errors.OBJECT_NOT_EXISTS]
    assert [r.key for r in sync(t).offload] == ["b"]
    assert disk.demote(t, ["a"], 0.0) == [0] and t.objects["a"].locations == []


def test_write_through_offers_new_commits_of_a_large_segment_from_its_tail():
    t = ObjectTable(90, 80, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
    t.add_segment(p.SegmentInfo(1, 1 << 40, "h", "/dev/shm/x1", "127.0.0.1:1"))
    sync(t, policy="write_through")
    n = disk.MAX_SCAN + 10
    for i in range(n):
        code, gen, _ = t.alloc(1, f"o{i}", 100, 1, [1], 0.0)
        assert t.commit(1, f"o{i}", gen, 0.0, checksum=gen) == 0
        t.objects[f"o{i}"].disk = (1, gen)                 # all on disk already
    put(t, "new")
    assert [r.key for r in sync(t, policy="write_through").offload] == ["new"]


def test_a_restarted_provider_s_records_replace_those_of_its_old_self():
    """A provider killed and restarted on the same disk_path joins (a new segment) before its old self
    is declared dead: its records take over, the old self is told to drop its copies, and the old
    self's death then loses nothing."""
    t = make()
    disk.add_reports(t, 1, [p.ObjectReport("d", 0, OBJ, 99, 7)])
    t.add_segment(p.SegmentInfo(2, 10 * MB, "h", "/dev/shm/x2", "127.0.0.1:2"))
    assert disk.add_reports(t, 2, [p.ObjectReport("d", 0, OBJ, 99, 7)]) == 1
    assert t.objects["d"].disk == (2, 99) and [r.key for r in t.disk_drops[1]] == ["d"]
    t.drop_segment(1)
    assert t.exists("d")


def test_a_remove_waits_for_the_owner_to_delete_the_disk_record():
    """Scenario: an object has a disk record (and a DRAM copy being offered to a second tier). Its
    remove names both segments to confirm; they count as confirmed only once the owners acknowledged
    the journal that deletes the record."""
    t = make("write_through")
    t.add_segment(p.SegmentInfo(2, 10 * MB, "h", "/dev/shm/x2", "127.0.0.1:2"))
    disk.sync(t, 2, p.DiskSync(2, b"", "write_through", 100 * MB, 0, 64 * MB, [], []), 0.0)
    code, gen, locs = t.alloc(1, "k", OBJ, 2, [1, 2], 0.0)
    assert code == 0 and t.commit(1, "k", gen, 0.0, checksum=gen) == 0
    sync(t, added=[report(t, "k")])
    reply = t.removing(lambda: [t.remove("k", 0.0)], epoch=1)
    waits = {sid: (serial, seq) for sid, serial, seq in reply.confirm}
    assert set(waits) == {1, 2}
    for sid in (1, 2):
        assert [e.obj.generation for e in t.segments[sid].journal if e.disk] == [gen]
        assert not t.confirmed(sid, *waits[sid])
        t.segments[sid].journal_since(waits[sid][1])   # the owner's heartbeat acknowledges it
        assert t.confirmed(sid, *waits[sid])


def test_records_of_removed_objects_are_refused_when_a_provider_rejoins_with_them():
    """Scenario: an object with a disk record on segment 1 is removed while segment 1's owner is frozen.
    A provider restarted on that disk_path joins (segment 2) while the old one is still in the table,
    and another (segment 3) after the old one was declared dead: both have the record refused (and
    sent back to be deleted); a record of an object still in the pool is accepted."""
    t = make()
    gen = put(t, "k")
    keep = put(t, "keep")
    sync(t, added=[report(t, "k"), report(t, "keep")])
    rec, kept = report(t, "k"), report(t, "keep")
    assert t.remove("k", 0.0) == 0
    t.add_segment(p.SegmentInfo(2, 10 * MB, "h", "/dev/shm/x2", "127.0.0.1:2"))
    assert disk.add_reports(t, 2, [rec, kept]) == 1
    assert not t.exists("k") and t.disk_drops[2] == [rec] and t.objects["keep"].disk == (2, keep)
    t.drop_segment(1)
    t.drop_segment(2)
    assert ("k", gen) in t.unconfirmed_records
    t.add_segment(p.SegmentInfo(3, 10 * MB, "h", "/dev/shm/x3", "127.0.0.1:3"))
    assert disk.add_reports(t, 3, [rec]) == 0 and not t.exists("k")


def test_a_record_attaches_only_to_its_own_write_and_the_newest_write_wins_at_join():
    """Scenario: a record of an older generation than the table's object is refused; at a join, one of
    a newer generation replaces the table's object (the key was written again: newest write wins)."""
    t = make()
    gen = put(t, "k")
    older = p.ObjectReport("k", 0, OBJ, gen - 1, gen)   # same size and checksum, another write
    assert sync(t, added=[older]).drop == [older] and t.objects["k"].disk is None
    assert disk.add_reports(t, 1, [older]) == 0 and t.objects["k"].generation == gen
    newer = p.ObjectReport("k", 0, OBJ, gen + 10, 5)
    assert disk.add_reports(t, 1, [newer]) == 1
    assert t.objects["k"].generation == gen + 10 and t.objects["k"].disk == (1, gen + 10)
    assert t.objects["k"].locations == []


def test_controls_survive_rounds_of_removes_and_quick_restarts_on_one_disk_path():
    """Scenario (test_disk_removal's rounds, in the table): each round puts objects on the provider's
    current segment with their disk records, removes some while the owner is frozen, then the provider
    restarted on the disk_path joins as a new segment reporting every record on disk, and only then is
    the old segment declared dead. The objects never removed keep their record, attached to the newest
    segment; nothing the new segment is told to delete (drops, journal) names one of them; the removed
    records are refused."""
    t = make("write_through")
    sid, kept = 1, set()
    on_disk: dict[str, p.ObjectReport] = {}   # the records on the disk_path
    for n in range(4):
        for i in range(3):
            code, gen, _ = t.alloc(1, f"{n}-{i}", OBJ, 1, [sid], 0.0)
            assert code == 0 and t.commit(1, f"{n}-{i}", gen, 0.0, checksum=gen) == 0
        disk.sync(t, sid, p.DiskSync(sid, b"", "write_through", 100 * MB, 0, 64 * MB,
                                     [report(t, f"{n}-{i}") for i in range(3)], []), 0.0)
        on_disk.update((f"{n}-{i}", report(t, f"{n}-{i}")) for i in range(3))
        kept.add(f"{n}-2")
        for i in range(2):
            assert t.remove(f"{n}-{i}", 0.0) == 0
        new = sid + 1
        t.add_segment(p.SegmentInfo(new, 10 * MB, "h", f"/dev/shm/x{new}", "127.0.0.1:1"))
        assert disk.add_reports(t, new, list(on_disk.values())) == len(kept)
        t.drop_segment(sid)   # the old incarnation is declared dead after the new one re-attached
        sid = new
        assert set(t.objects) == kept and all(t.objects[k].disk == (sid, on_disk[k].generation) for k in kept)
        told = {r.key for r in t.disk_drops.get(sid, [])} | {e.obj.key for e in t.segments[sid].journal}
        assert not told & kept and told == set(on_disk) - kept
        for k in told:
            on_disk.pop(k)   # the new incarnation deletes them
