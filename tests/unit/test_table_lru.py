"""The segments' LRU lists (``meta/lru.py``, linked through the objects) against a model: random puts
with one to three replicas, leased reads, exists, removals, replicas reported corrupt, evictions and
lease ends; after every step each segment's list holds exactly its committed objects, once each, in
the order of their last use (commit or leased read), forwards and backwards; and the counts of
under-replicated and pending objects stay true."""

from __future__ import annotations

import random

import pytest

from memcache_core import protocol as p
from memcache_core.meta.table import ObjectTable

SEGMENTS = (11, 22, 33)


def _check(t: ObjectTable, used: dict[str, int]) -> None:
    assert t.under_replicated == sum(o.committed and 0 < len(o.locations) < o.replicas for o in t.objects.values())
    assert t.pending == sum(not o.committed for o in t.objects.values())
    for sid in SEGMENTS:
        lru = t.segments[sid].lru
        forward, backward = list(lru), list(reversed(lru))
        assert forward == backward[::-1] and len(forward) == len(set(forward)) == len(lru)
        held = {k for k, o in t.objects.items() if o.committed and sid in {loc.segment_id for loc in o.locations}}
        assert set(forward) == held
        assert forward == sorted(forward, key=used.__getitem__)   # least recently used first
        assert all(lru.get(k) is t.objects[k] for k in forward) and [o.key for o in lru.values()] == forward


def _step(t: ObjectTable, rng: random.Random, used: dict[str, int], clock: list[int], now: float) -> None:
    k = f"k{rng.randrange(40)}"
    op = rng.random()
    if op < 0.45:
        code, gen, _ = t.alloc(1, k, rng.choice((500, 3000, 9000)), rng.randint(1, 3),
                               rng.sample(SEGMENTS, 3), now)
        if code == 0 and rng.random() < 0.9 and t.commit(1, k, gen, now) == 0:
            clock[0] += 1
            used[k] = clock[0]
    elif op < 0.75:
        lease = rng.random() < 0.8
        if t.lookup(k, now, lease) is not None and lease:
            clock[0] += 1
            used[k] = clock[0]
    elif op < 0.8:
        t.exists(k)
    elif op < 0.88:
        t.remove(k, now)
    elif op < 0.95:
        o = t.objects.get(k)
        if o is not None and o.committed:
            t.corrupt(k, o.generation, now, segment_id=rng.choice(SEGMENTS))
    else:
        t.reclaim(now)
        t.evict_all(now)


@pytest.mark.parametrize("seed", range(6))
def test_lru_lists_follow_the_last_use_through_every_change(seed: int):
    rng = random.Random(seed)
    t = ObjectTable(90, 70, 2.0, 5.0, 1 << 40)
    for sid in SEGMENTS:
        t.add_segment(p.SegmentInfo(sid, 160 << 10, f"h{sid}", f"/dev/shm/memcache-{sid}-ab", "127.0.0.1:9"))
    used: dict[str, int] = {}
    clock = [0]
    for i in range(1500):
        _step(t, rng, used, clock, now=i * 0.01)
        _check(t, used)
    assert t.counters.evictions > 5 and t.counters.commits > 100 and t.counters.hits > 100
