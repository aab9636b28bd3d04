"""The bookkeeping of ``local/hints.py``: what is remembered, for how many keys, and when early copies
are tried (the reads themselves: tests/integration/test_location_hints.py)."""

from __future__ import annotations

from memcache_core import protocol as p
from memcache_core.local.hints import PROBE_EVERY, LocationHints


def found(gen: int, locations: int = 1) -> p.Found:
    return p.Found(4096, gen, [p.Location(1, 4096 * k) for k in range(locations)], 7)


def test_objects_in_dram_are_remembered_others_forgotten_oldest_dropped_first() -> None:
    h = LocationHints(3)
    h.seen(["a", "b", "c"], [found(1), found(2), None])
    assert [f.generation if f else None for f in h.get(["a", "b", "c"])] == [1, 2, None]
    h.seen(["a"], [found(5)])                  # seen again: newest
    h.seen(["d", "e"], [found(3), found(4)])   # over capacity: b (the oldest) goes
    assert [f.generation if f else None for f in h.get(["a", "b", "d", "e"])] == [5, None, 3, 4]
    h.seen(["d", "e"], [None, found(9, locations=0)])   # gone, or on disk only: forgotten
    assert h.get(["d", "e"]) == [None, None] and len(h) == 1
    h.forget(["a"])
    assert len(h) == 0


def test_zero_capacity_remembers_nothing_and_never_tries() -> None:
    h = LocationHints(0)
    h.seen(["a"], [found(1)])
    assert h.get(["a"]) == [None] and not h.worth_trying()


def test_early_copies_stop_when_mostly_thrown_away_and_come_back_when_used() -> None:
    h = LocationHints(10)
    assert h.worth_trying()
    tries = 0
    for _ in range(200):                      # every early copy thrown away
        if h.worth_trying():
            tries += 1
            h.outcome(0, 4)
    assert tries <= 3 + 200 // PROBE_EVERY
    while not h.worth_trying():               # the next probe...
        pass
    for _ in range(3):                        # ...and the next ones find them used again
        h.outcome(4, 0)
    assert all(h.worth_trying() for _ in range(PROBE_EVERY * 2))
