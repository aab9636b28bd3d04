"""Scenario tests for the MetaService's side of the GVA path (``meta/gva.py``): which copies a caller
may make, decided on the table's state. Time is passed in; nothing sleeps."""

from __future__ import annotations

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.meta import gva
from memcache_core.meta.table import ObjectTable

SEG = 1 << 20


def make() -> ObjectTable:
    t = ObjectTable(90, 50, lease_ttl_s=1.0, pending_timeout_s=10.0, first_generation=7 << 32)
    t.add_segment(p.SegmentInfo(1, SEG, "h", "/dev/shm/x1", "127.0.0.1:1"))
    return t


def grant(t: ObjectTable, cid: int, key: str, gen: int, lo: int, hi: int, write: bool, now: float,
          sid: int = 1) -> int:
    return gva.grant(t, cid, p.Grant(cid, b"", [key], [gen], [sid], [lo], [hi], write), now).codes[0]


def test_writes_only_into_the_callers_unfinished_object_in_time():
    """Scenario: the writer may write any range of its pending object until half its pending timeout
    has passed; another client, another generation, another segment, a range past the end and a
    finished object are refused."""
    t = make()
    code, gen, _ = t.alloc(5, "k", 1000, 1, [1], 0.0)
    assert code == 0
    assert grant(t, 5, "k", gen, 0, 1000, True, 1.0) == 0
    assert grant(t, 5, "k", gen, 999, 1000, True, 1.0) == 0
    assert grant(t, 6, "k", gen, 0, 10, True, 1.0) == errors.STATE_MISMATCH       # not its writer
    assert grant(t, 5, "k", gen + 1, 0, 10, True, 1.0) == errors.STATE_MISMATCH   # stale generation
    assert grant(t, 5, "k", gen, 0, 10, True, 1.0, sid=2) == errors.STATE_MISMATCH
    assert grant(t, 5, "k", gen, 990, 1001, True, 1.0) == errors.INVALID_PARAM    # past the end
    assert grant(t, 5, "k", gen, 10, 10, True, 1.0) == errors.INVALID_PARAM       # empty
    assert grant(t, 5, "k", gen, 0, 10, False, 1.0) == errors.STATE_MISMATCH      # unfinished: unreadable
    assert grant(t, 5, "k", gen, 0, 10, True, 5.1) == errors.TIMEOUT              # too late to start
    assert grant(t, 5, "nope", gen, 0, 10, True, 1.0) == errors.OBJECT_NOT_EXISTS
    assert t.commit(5, "k", gen, 2.0) == 0
    assert grant(t, 5, "k", gen, 0, 10, True, 2.0) == errors.STATE_MISMATCH       # finished


def test_reads_need_the_callers_own_live_lease():
    """Scenario: reading a committed object needs a lease of the caller's own, of that generation,
    not ended nor removed; the lease also pins the object against eviction like a get's lease."""
    t = make()
    _, gen, _ = t.alloc(5, "k", 1000, 1, [1], 0.0)
    t.commit(5, "k", gen, 0.0)
    assert grant(t, 7, "k", gen, 0, 1000, False, 0.0) == errors.STATE_MISMATCH   # no lease
    assert gva.add_lease(t, 7, ["k", "nope"], [0, 0], 2.0, 0.0) == [0, errors.OBJECT_NOT_EXISTS]
    assert t.objects["k"].lease_until == 2.0
    assert grant(t, 7, "k", gen, 0, 1000, False, 1.0) == 0
    assert gva.grant(t, 7, p.Grant(7, b"", ["k"], [gen], [1], [0], [10], False), 1.5).left_ms == [500]
    assert grant(t, 8, "k", gen, 0, 1000, False, 1.0) == errors.STATE_MISMATCH   # another reader's lease
    assert grant(t, 7, "k", gen, 0, 1000, False, 2.0) == errors.STATE_MISMATCH   # ended
    assert gva.add_lease(t, 7, ["k"], [gen + 1], 2.0, 3.0) == [errors.STATE_MISMATCH]
    assert gva.add_lease(t, 7, ["k"], [gen], 2.0, 3.0) == [0]
    assert gva.remove_lease(t, 7, ["k"]) == [0]
    assert gva.remove_lease(t, 7, ["k"]) == [errors.OBJECT_NOT_EXISTS]
    assert grant(t, 7, "k", gen, 0, 10, False, 3.5) == errors.STATE_MISMATCH     # removed


def test_a_lease_does_not_survive_its_object():
    """Scenario: a key removed and written again is a new object: the old lease does not cover it,
    and housekeeping forgets leases of objects that are gone."""
    t = make()
    _, gen, _ = t.alloc(5, "k", 1000, 1, [1], 0.0)
    t.commit(5, "k", gen, 0.0)
    gva.add_lease(t, 7, ["k"], [gen], 10.0, 0.0)
    assert t.remove("k", 1.0) == 0
    _, gen2, _ = t.alloc(5, "k", 1000, 1, [1], 1.0)
    t.commit(5, "k", gen2, 1.0)
    assert grant(t, 7, "k", gen2, 0, 10, False, 1.0) == errors.STATE_MISMATCH
    gva.expire(t, 1.0)
    assert t.held == {}


def test_info_shows_committed_objects_and_the_callers_unfinished_ones():
    t = make()
    _, gen, _ = t.alloc(5, "mine", 100, 1, [1], 0.0)
    _, gen2, _ = t.alloc(6, "theirs", 100, 1, [1], 0.0)
    _, gen3, _ = t.alloc(6, "done", 100, 1, [1], 0.0)
    t.commit(6, "done", gen3, 0.0)
    r = gva.info(t, 5, ["mine", "theirs", "done", "nope"])
    assert [f.generation if f else None for f in r.results] == [gen, None, gen3, None]
    assert r.pending == [True, False, False, False]


def test_a_gva_resolves_only_inside_an_object_described_in_this_session():
    """Scenario (client side, ``local/gva.py``): a GVA plus an offset inside the object resolves to
    that object; ranges past its end, other slots, other sessions and forged numbers do not; an
    object described over reused space makes the old one's GVAs unresolvable."""
    import pytest

    from memcache_core.errors import InvalidParameter, StateMismatch
    from memcache_core.layout import HEADER_BYTES
    from memcache_core.local.gva_book import GvaBook, GvaObject
    from memcache_core.local.membership import Session

    book = GvaBook(Session(3, 0x1234_5601, 1.0, 10.0, None), lambda sid: 1)
    a, b = book.add([GvaObject("a", 9, 77, 0, 1000, True)])[0], book.add([GvaObject("b", 9, 77, 4096, 500, False)])[0]
    assert a and b and a >> 56 == 0x01 and a & ((1 << 42) - 1) == HEADER_BYTES
    o, start = book.resolve(a + 600, 400)
    assert (o.key, start) == ("a", 600)
    for addr, n in ((a + 600, 401), (a - 1, 1), (b + (1 << 42), 10), (a | 12345, 1), (0, 1), (a, 0)):
        with pytest.raises(InvalidParameter):
            book.resolve(addr, n)
    with pytest.raises(StateMismatch):
        book.resolve(12345, 1)                                     # no session's tag
    with pytest.raises(StateMismatch):
        GvaBook(Session(3, 0x99, 1.0, 10.0, None), lambda sid: 1).resolve(a, 1)   # another MetaService session
    book.add([GvaObject("c", 10, 77, 512, 2000, True)])            # a's space reused since
    with pytest.raises(InvalidParameter):
        book.resolve(a, 1)
    assert book.resolve(b, 500)[0].key == "b"


def test_client_grants_hold_until_their_end_and_no_further():
    """Scenario: a grant remembered for a replica lets copies start without asking until its ``until``
    (time is a parameter), never after it, never once the client opened a new MetaService connection,
    never for the other direction; removing a lease revokes read grants only; describing the key anew
    (another generation) or forgetting it drops everything granted for it."""
    from memcache_core.local.gva_book import GvaBook, GvaObject
    from memcache_core.local.membership import Session

    book = GvaBook(Session(3, 0x1234_5601, 1.0, 10.0, None), lambda sid: 1)
    w, r = GvaObject("w", 5, 77, 0, 1000, True), GvaObject("r", 6, 77, 4096, 1000, False)
    book.add([w])
    book.add([r])
    book.grant([w], True, [10.0], [20.0], connects=1)
    book.grant([r], False, [12.0], [12.0], connects=1)
    assert book.granted([w], True, 9.0, 1) == 11.0          # seconds left to the end it was granted under
    assert book.granted([w, r], True, 9.0, 1) is None       # r holds no write grant
    assert book.granted([w], True, 10.0, 1) is None         # past until: ask again
    assert book.granted([w], True, 9.0, 2) is None          # a new connection: maybe a restarted MetaService
    assert book.granted([w], False, 9.0, 1) is None         # a write grant is not a read grant
    assert book.granted([r], False, 11.0, 1) == 1.0
    book.revoke(["r", "w"], write=False)
    assert book.granted([r], False, 11.0, 1) is None and book.granted([w], True, 9.0, 1) == 11.0
    book.add([GvaObject("w", 8, 77, 0, 1000, True)])        # the key described anew: another object
    assert book.granted([w], True, 9.0, 1) is None
    stale = GvaObject("gone", 1, 77, 8192, 100, True)
    book.grant([stale], True, [10.0], [20.0], connects=1)   # not described here: nothing remembered
    assert book.granted([stale], True, 9.0, 1) is None


def test_digest_follows_ranges_in_order_and_gives_up_otherwise():
    """Scenario: the digest fed by copies equals the XXH3-64 of the whole payload when the ranges come
    in order from byte 0, is the copy loop's own for a copy of the whole payload, and is None (read
    back at finish) once a range comes out of order or is written twice."""
    import numpy as np
    import xxhash

    from memcache_core.local.gva_book import Digest

    data = np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8)
    p = data.ctypes.data
    d = Digest()
    d.add(0, [(p, 300)], None)
    d.add(300, [(p + 300, 200), (p + 500, 500)], None)
    assert d.value(1000) == xxhash.xxh3_64_intdigest(data.tobytes())
    whole = Digest()
    whole.add(0, [(p, 1000)], 1234)
    assert whole.value(1000) == 1234
    for ranges in ([(300, 300), (0, 300), (600, 400)], [(0, 300), (0, 300), (300, 700)], [(0, 300)]):
        d = Digest()
        for start, n in ranges:
            d.add(start, [(p + start, n)], None)
        assert d.value(1000) is None
