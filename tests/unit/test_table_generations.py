"""Scenario tests: after a MetaService restart the newest generation of a key wins whatever order its
holders re-join in; removals not confirmed by a dead owner stay removed; generations are reserved
ahead and carried by members (meta/generations.py). Time is passed in; nothing sleeps."""

from __future__ import annotations

import pytest

from memcache_core.layout import HEADER_BYTES
from memcache_core.meta import generations
from memcache_core.meta.table import ObjectTable
from memcache_core.protocol import ObjectReport, SegmentInfo

MB = 1 << 20
OBJ = MB - HEADER_BYTES
G = 7 << 32


def table() -> ObjectTable:
    return ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=G)


def seg(i: int) -> SegmentInfo:
    return SegmentInfo(i, 10 * MB, f"h{i}", f"/dev/shm/x{i}", "127.0.0.1:1")


def removals(t: ObjectTable, sid: int) -> list[tuple[str, int]]:
    return [(e.obj.key, e.obj.generation) for e in t.segments[sid].journal_since(0) if not e.added]


@pytest.mark.parametrize("newer_first", [True, False])
def test_the_newest_generation_wins_whichever_holder_re_joins_first(newer_first):
    """Scenario: k was put on segment 1 (generation G+1), removed, put again on segment 2 (G+5); the
    MetaService crashed before 1's owner cleared the old header. Both re-join, in either order: the
    table holds G+5 at segment 2 only, segment 1's owner is told to forget G+1, its space is free."""
    t = table()
    old, new = ObjectReport("k", 0, OBJ, G + 1, 0xA), ObjectReport("k", 3 * MB, OBJ, G + 5, 0xB)
    order = [(2, new), (1, old)] if newer_first else [(1, old), (2, new)]
    refused: dict[int, list[ObjectReport]] = {}
    for sid, r in order:
        refused[sid] = t.add_segment(seg(sid), [r], now=10.0)
    obj = t.objects["k"]
    assert obj.generation == G + 5 and [loc.segment_id for loc in obj.locations] == [2] and obj.checksum == 0xB
    if newer_first:
        assert refused == {2: [], 1: [old]}          # refused: the caller journals it to the owner
    else:
        assert refused == {1: [], 2: []}
        assert removals(t, 1) == [("k", G + 1)]       # dropped: journaled to its owner by the table
    assert t.segments[1].allocator.used == 0 and "k" not in t.segments[1].lru
    assert t.counters.superseded == (0 if newer_first else 1)
    code, gen, _ = t.alloc(1, "other", 100, 1, [1], 10.0)
    assert code == 0 and gen > G + 5                  # and new generations are above every report


def test_an_older_value_still_leased_is_hidden_at_once_and_its_space_freed_when_the_lease_ends():
    """Scenario: a reader holds a lease on the older object when the newer report arrives: the key
    reads as the newer object at once; the older space is not reused until the lease ends."""
    t = table()
    t.add_segment(seg(1), [ObjectReport("k", 0, OBJ, G + 1)], now=0.0)
    assert t.lookup("k", 0.0, lease=True) is not None          # leased until 1.0
    t.add_segment(seg(2), [ObjectReport("k", 0, OBJ, G + 2)], now=0.5)
    assert t.objects["k"].generation == G + 2
    assert t.segments[1].allocator.used == MB                   # still leased
    t.reclaim(0.9)
    assert t.segments[1].allocator.used == MB
    t.reclaim(1.1)
    assert t.segments[1].allocator.used == 0


def test_same_generation_is_a_replica_older_is_refused_and_a_put_in_flight_keeps_its_key():
    t = table()
    t.add_segment(seg(1), [ObjectReport("k", 0, OBJ, G + 3), ObjectReport("p", MB, OBJ, G + 1)])
    assert t.add_segment(seg(2), [ObjectReport("k", 0, OBJ, G + 3)]) == []
    assert sorted(loc.segment_id for loc in t.objects["k"].locations) == [1, 2]
    assert t.add_segment(seg(3), [ObjectReport("k", 0, OBJ, G + 2)]) == [ObjectReport("k", 0, OBJ, G + 2)]
    # a put of "q" is in flight: a report of q, whatever its generation, is refused
    code, gen, _ = t.alloc(1, "q", OBJ, 1, [1], 0.0)
    assert code == 0
    high = ObjectReport("q", 0, OBJ, gen + 100)
    assert t.add_segment(seg(4), [high]) == [high]
    assert not t.objects["q"].committed and t.objects["q"].generation == gen


def test_a_removal_its_dead_owner_never_confirmed_is_refused_when_it_re_joins():
    """Scenario: k is removed; its owner is declared dead before its next heartbeat (it never cleared
    the header) and later re-joins reporting k: k stays removed. A removal it did confirm leaves no
    trace, and another segment re-joining is not affected."""
    t = table()
    t.add_segment(seg(1), [ObjectReport("k", 0, OBJ, G + 1), ObjectReport("j", MB, OBJ, G + 2)])
    t.add_segment(seg(2), [ObjectReport("x", 0, OBJ, G + 3)])
    codes = t.removing(lambda: [t.remove("k", 0.0)], epoch=5)
    [(sid, serial, seq)] = codes.confirm
    assert codes.codes == [0] and codes.epoch == 5 and sid == 1
    assert not t.confirmed(sid, serial, seq)
    t.drop_segment(1)
    assert t.confirmed(sid, serial, seq)               # the owner is gone: nothing to wait for
    refused = t.add_segment(seg(1), [ObjectReport("k", 0, OBJ, G + 1), ObjectReport("j", MB, OBJ, G + 2)])
    assert refused == [ObjectReport("k", 0, OBJ, G + 1)] and not t.exists("k") and t.exists("j")
    assert not t.confirmed(sid, serial + 5, seq) or t.segments[1].serial != serial + 5
    # confirmed by a heartbeat's acknowledgement
    codes = t.removing(lambda: [t.remove("j", 0.0)], epoch=5)
    [(sid, serial, seq)] = codes.confirm
    assert serial == t.segments[1].serial and not t.confirmed(sid, serial, seq)
    t.segments[1].journal_since(seq)
    assert t.confirmed(sid, serial, seq)
    t.drop_segment(1)
    assert t.add_segment(seg(1), [ObjectReport("j2", 0, OBJ, G + 9)]) == []


def test_a_remove_of_a_missing_key_has_nothing_to_confirm():
    t = table()
    t.add_segment(seg(1))
    assert t.removing(lambda: [t.remove("nope", 0.0)], epoch=1).confirm == []


def test_generations_are_issued_below_a_ceiling_reserved_ahead_a_block_at_a_time():
    """Scenario: the first alloc reserves a block; the next block is reserved when half of the
    current one is used, so what is issued stays below a ceiling announced 2**31 allocations before."""
    t = table()
    calls: list[tuple[int, int]] = []

    def reserve(last: int, ceiling: int) -> tuple[int, int]:
        calls.append((last, ceiling))
        return generations.in_memory(last, ceiling)

    t.reserve = reserve
    t.add_segment(seg(1))
    _, g1, _ = t.alloc(1, "a", 100, 1, [1], 0.0)
    assert calls == [(G, 0)] and g1 == G + 1 and t.gen_ceiling == G + generations.BLOCK
    t.bump_generation(G + generations.BLOCK // 2)         # as if half a block had been issued
    _, g2, _ = t.alloc(1, "b", 100, 1, [1], 0.0)
    assert len(calls) == 2 and g2 == G + generations.BLOCK // 2 + 1
    assert t.gen_ceiling == G + 2 * generations.BLOCK       # the next block
    assert g2 <= G + generations.BLOCK                    # still below the ceiling reserved a block ago


def test_a_member_carried_ceiling_lifts_a_restarted_table_above_its_clock():
    """Scenario: the restarted MetaService's clock is behind its predecessor's (another host); a
    re-joining member carries the ceiling it heard: generations continue above it."""
    old = table()
    old.add_segment(seg(1))
    old.bump_generation(G + 10_000)
    _, issued, _ = old.alloc(1, "k", 100, 1, [1], 0.0)
    carried = old.gen_ceiling
    behind = ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=G - (1 << 40))
    behind.add_segment(seg(2))
    behind.bump_generation(carried)                      # what MetaServiceCore._join does
    _, gen, _ = behind.alloc(2, "k", 100, 1, [2], 0.0)
    assert gen > carried >= issued


def test_a_reservation_that_fails_fails_the_alloc_before_any_space_is_taken():
    """Scenario (HA): etcd refuses the next block (another leader reserved): the put fails, the
    segment's space and the key are untouched, and a later reservation that works issues above."""
    from memcache_core.errors import MetaServiceUnavailable

    t = table()
    t.add_segment(seg(1))

    def refused(last: int, ceiling: int) -> tuple[int, int]:
        raise MetaServiceUnavailable("another MetaService reserved generations meanwhile")

    t.reserve = refused
    with pytest.raises(MetaServiceUnavailable):
        t.alloc(1, "k", OBJ, 1, [1], 0.0)
    assert t.segments[1].allocator.used == 0 and "k" not in t.objects and t.pending == 0
    t.reserve = generations.in_memory
    code, gen, _ = t.alloc(1, "k", OBJ, 1, [1], 0.0)
    assert code == 0 and gen == G + 1
