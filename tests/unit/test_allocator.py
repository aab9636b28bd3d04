from __future__ import annotations

import random

import pytest

from memcache_core.meta.allocator import ALIGN, Allocator, aligned


def alloc(a: Allocator, n: int) -> int:
    """An allocation that must fit."""
    off = a.alloc(n)
    assert off is not None
    return off


def test_alloc_free_coalesces_back_to_one_range():
    a = Allocator(1 << 20)
    offs = [alloc(a, 1000) for _ in range(100)]
    assert all(o % ALIGN == 0 for o in offs)
    assert len(set(offs)) == 100
    random.Random(1).shuffle(offs)
    for o in offs:
        a.free_range(o, 1000)
    assert a.used == 0 and a.largest_free == a.size


def test_best_fit_reuses_the_smallest_hole():
    a = Allocator(10 * 4096)
    x = [alloc(a, 4096) for _ in range(10)]
    a.free_range(x[2], 4096)            # a 4 KiB hole
    a.free_range(x[5], 4096)
    a.free_range(x[6], 4096)            # an 8 KiB hole
    assert a.alloc(4096) == x[2]
    assert a.alloc(8192) == x[5]


def test_alloc_returns_none_when_nothing_fits():
    a = Allocator(8192)
    assert a.alloc(8192) == 0
    assert a.alloc(1) is None
    a.free_range(0, 8192)
    assert a.alloc(8193) is None and a.alloc(8192) == 0


def test_from_used_rebuilds_the_free_space():
    a = Allocator.from_used(1 << 16, [(4096, 100), (0, 64), (8192, 4096)])
    assert a.used == aligned(100) + 64 + 4096
    assert a.alloc(4096 - 64) == 64          # the gap between the first two ranges
    with pytest.raises(ValueError):
        Allocator.from_used(4096, [(0, 128), (64, 128)])


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_overlaps(seed):
    rng = random.Random(seed)
    a = Allocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free_range(off, live.pop(off))
        else:
            n = rng.randint(1, 40000)
            got = a.alloc(n)
            if got is not None:
                live[got] = n
        spans = sorted((o, o + aligned(n)) for o, n in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False))
        assert a.used == sum(aligned(n) for n in live.values())
        assert all(e <= a.size for _, e in spans)
