"""A segment held by its owner (``local/hold.py``: writes of an earlier join may still be in flight into
it) takes nothing new, whichever way space is chosen: ``Segment.takes_new`` for an Alloc's placement, an
arena, a copy (drain, repair), a promotion from disk and a GVA write grant; its committed objects stay
readable. Table-level scenarios, time passed in."""

from __future__ import annotations

import msgspec
import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.errors import InvalidParameter
from memcache_core.layout import HEADER_BYTES
from memcache_core.meta import arena, disk, gva, placement, validate
from memcache_core.meta.table import ObjectTable

MB = 1 << 20
OBJ = MB - HEADER_BYTES


def make() -> ObjectTable:
    t = ObjectTable(90, 50, 1.0, pending_timeout_s=5.0, first_generation=7 << 32)
    for i in (1, 2):
        t.add_segment(p.SegmentInfo(i, 16 * MB, f"h{i}", f"/dev/shm/x{i}", "127.0.0.1:1"))
    return t


def test_the_predicate():
    t = make()
    seg = t.segments[1]
    assert seg.takes_new(0.0)
    seg.held = True
    assert not seg.takes_new(0.0)
    seg.held, seg.alloc_after = False, 5.0        # the grace of a re-joined segment, as before
    assert not seg.takes_new(4.0) and seg.takes_new(5.0)


def test_no_placement_arena_copy_or_promotion_in_a_held_segment():
    t = make()
    code, gen, locs = t.alloc(1, "old", OBJ, 1, [1], 0.0)
    assert code == 0 and locs[0].segment_id == 1 and t.commit(1, "old", gen, 0.0) == 0
    t.segments[1].held = True
    # a put asking for segment 1 first (preferred, and first in the order) goes to 2
    code, gen, locs = t.alloc(1, "new", OBJ, 1, [1, 2], 0.0, preferred=[1])
    assert code == 0 and [loc.segment_id for loc in locs] == [2]
    # two replicas: only one place takes new objects (a partial placement, not the held one)
    code, _, locs = t.alloc(1, "two", OBJ, 2, [1, 2], 0.0)
    assert code == 0 and [loc.segment_id for loc in locs] == [2]
    t.segments[2].held = True
    assert t.alloc(1, "none", OBJ, 1, [1, 2], 0.0)[0] == errors.OUT_OF_MEMORY
    assert placement.copy_takers(t, 0.0) == []
    assert placement.copy_target(t, t.objects["old"], set(), lambda sid, now: True, 0.0) is False
    assert arena.grant(t, t.segments[1], MB, 0.0) is None
    # the committed object stays where it is, readable
    found = t.lookup_many(["old"], 0.0, False)[0]
    assert found is not None and found.locations[0].segment_id == 1
    t.segments[1].held = t.segments[2].held = False
    assert placement.copy_takers(t, 0.0) == [t.segments[1], t.segments[2]]
    assert arena.grant(t, t.segments[1], MB, 0.0) is not None


def test_no_promotion_into_a_held_segment():
    t = make()
    t.segments[1].held = True
    disk.add_reports(t, 1, [p.ObjectReport("cold", 0, OBJ, 9 << 32, 5)], 0.0)
    assert [r.code for r in disk.promote(t, 1, ["cold"], 0.0)] == [errors.OUT_OF_MEMORY]
    t.segments[1].held = False
    assert [r.code for r in disk.promote(t, 1, ["cold"], 0.0)] == [errors.SUCCESS]


def test_no_gva_write_grant_in_a_held_segment():
    t = make()
    code, gen, locs = t.alloc(7, "gva", OBJ, 1, [1], 0.0)
    assert code == 0
    req = p.Grant(7, b"", ["gva"], [gen], [1], [0], [OBJ], True)
    assert gva.grant(t, 7, req, 0.0).codes == [errors.SUCCESS]
    t.segments[1].held = True
    assert gva.grant(t, 7, req, 0.0).codes == [errors.STATE_MISMATCH]


def test_held_from_peers_is_checked():
    """``held`` is a bool on the wire (the decoder refuses anything else), and a Join without a
    segment cannot be held."""
    with pytest.raises(InvalidParameter, match="a held segment reported without a segment"):
        validate.join(p.Join(0, "h", 1, held=True))
    raw = msgspec.msgpack.encode({"type": "Heartbeat", "client_id": 1, "token": b"", "held": 1})
    with pytest.raises(msgspec.ValidationError):
        p.request_decoder.decode(raw)
    beat = p.request_decoder.decode(p.request_encoder.encode(p.Heartbeat(1, b"", held=True)))
    assert isinstance(beat, p.Heartbeat) and beat.held is True
