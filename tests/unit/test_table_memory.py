"""What keeps the object table small (benchmarks/bench_meta_memory.py measures it): one string per key
whatever request carried it, size, generation, checksum and first location packed in one int, LRU
links in the objects (no per-object dict entry), one lease-end float per read request, objects
outside the garbage collector; and eviction from a large segment costs the same per object whatever
the segment's size."""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys

import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.layout import footprint
from memcache_core.meta.allocator import aligned
from memcache_core.meta.objects import new_obj, pack
from memcache_core.meta.table import ObjectTable

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_meta_memory.py")


def _decoded(req: p.Request) -> p.Request:
    """The request as the MetaService sees it: fresh strings and ints from msgpack."""
    return p.request_decoder.decode(p.request_encoder.encode(req))


def _table() -> ObjectTable:
    t = ObjectTable(90, 80, 10.0, 120.0, 1 << 40)
    t.add_segment(p.SegmentInfo(7, 1 << 30, "h", "/dev/shm/memcache-1-ab", "127.0.0.1:9"))
    return t


def test_a_committed_object_holds_one_copy_of_its_key_and_its_fields_in_one_int():
    t = _table()
    keys = [f"ns.{i:064x}" for i in range(3)]
    alloc = _decoded(p.Alloc(7, b"", keys, [4096, 4096, 8192]))
    assert isinstance(alloc, p.Alloc)
    gens = [t.alloc(7, k, s, 1, [7], 0.0)[1] for k, s in zip(alloc.keys, alloc.sizes, strict=True)]
    commit = _decoded(p.Commit(7, b"", keys, gens, [11, 12, (1 << 64) - 1]))
    assert isinstance(commit, p.Commit)
    for k, g, c in zip(commit.keys, commit.generations, commit.checksums, strict=True):
        assert t.commit(7, k, g, 0.0, c) == 0
    lru = t.segments[7].lru
    objs = [t.objects[k] for k in keys]
    assert [o.size for o in objs] == [4096, 4096, 8192] and [o.checksum for o in objs] == [11, 12, (1 << 64) - 1]
    assert [o.generation for o in objs] == gens and all(o.more is None for o in objs)
    assert [loc.segment_id for o in objs for loc in o.locations] == [7, 7, 7]
    assert len({o.locations[0].offset for o in objs}) == 3
    for o, k in zip(objs, lru, strict=True):
        assert k is o.key and next(k2 for k2 in t.objects if k2 == k) is o.key   # one string, not the Commit's
    assert not gc.is_tracked(objs[0]) and sys.getsizeof(objs[0]) <= 64 and sys.getsizeof(objs[0].packed) <= 64


def test_packed_fields_round_trip_at_their_limits_and_wider_values_are_refused():
    big = new_obj("k", (1 << 40), (1 << 63) - 1, [p.Location((1 << 63) - 1, (1 << 48) - 1)], (1 << 64) - 1)
    assert (big.size, big.generation, big.checksum) == (1 << 40, (1 << 63) - 1, (1 << 64) - 1)
    assert big.locations == [p.Location((1 << 63) - 1, (1 << 48) - 1)]
    disk_only = new_obj("d", 1, 1, [], disk=(3, 1))
    assert disk_only.locations == [] and disk_only.disk == (3, 1)
    for bad in ((1 << 48, 1, 0, None), (1, 1 << 64, 0, None), (1, 1, -1, None), (1, 1, 0, p.Location(1, 1 << 48))):
        with pytest.raises(ValueError):
            pack(*bad)


def test_an_object_with_more_replicas_keeps_them_and_its_lru_links_in_each_segment():
    t = ObjectTable(90, 80, 10.0, 120.0, 1 << 40)
    for sid in (1, 2, 3):
        t.add_segment(p.SegmentInfo(sid, 1 << 20, f"h{sid}", f"/dev/shm/memcache-{sid}-ab", "127.0.0.1:9"))
    for k in ("a", "b", "c"):
        code, gen, locs = t.alloc(1, k, 100, 3, [1, 2, 3], 0.0)
        assert code == 0 and t.commit(1, k, gen, 0.0) == 0
    assert t.lookup("a", 1.0, True) is not None   # most recent everywhere
    assert [list(t.segments[s].lru) for s in (1, 2, 3)] == [["b", "c", "a"]] * 3
    t.corrupt("b", t.objects["b"].generation, 2.0, segment_id=1)   # b loses its first replica
    assert [loc.segment_id for loc in t.objects["b"].locations] == [2, 3] and t.under_replicated == 1
    assert [list(t.segments[s].lru) for s in (1, 2, 3)] == [["c", "a"], ["b", "c", "a"], ["b", "c", "a"]]
    assert [list(reversed(t.segments[s].lru)) for s in (2, 3)] == [["a", "c", "b"]] * 2
    assert t.remove("b", 3.0) == 0 and [len(t.segments[s].lru) for s in (1, 2, 3)] == [2, 2, 2]


def test_keys_read_by_one_request_share_their_lease_end():
    t = _table()
    for k in ("a", "b", "c"):
        t.alloc(7, k, 64, 1, [7], 0.0)
        assert t.commit(7, k, t.objects[k].generation, 0.0) == 0
    now = 5.25
    a, b = (t.lookup(k, now, True) for k in ("a", "b"))
    assert a is not None and b is not None and a.lease_until == now + 10.0 and a.lease_until is b.lease_until
    c = t.lookup("c", 6.5, True)   # a later request: its own lease end
    assert c is not None and c.lease_until == 16.5
    assert t.lookup("a", 1.0, True) is a and a.lease_until == now + 10.0   # a lease never shrinks


def test_bytes_per_object_stay_in_budget():
    """benchmarks/bench_meta_memory.py at 20,000 objects (it checks every object it put): ~290 bytes each
    here, 90-character keys included (~140 of them); the table before these savings took ~550."""
    out = subprocess.run([sys.executable, BENCH, "--objects", "20000", "--method", "tracemalloc"], check=True,
                         capture_output=True, text=True, timeout=240).stdout
    after_put, after_read = (float(x) for x in re.findall(r"([\d.]+) (?:bytes/object after put|after one)", out))
    assert after_put < 320 and after_read < 320, out


class _CountingDict(dict):  # type: ignore[type-arg]
    """The table's key -> object dict, counting the look-ups the LRU lists make through it."""

    reads = 0

    def __getitem__(self, k: str) -> object:
        _CountingDict.reads += 1
        return super().__getitem__(k)

    def get(self, k: str, default: object = None) -> object:
        _CountingDict.reads += 1
        return super().get(k, default)


def _lookups_per_eviction(n: int) -> float:
    """Fill one segment with ``n`` objects, then put n/4 more, each evicting what it needs (high and low
    marks equal: an eviction step per put); the look-ups of the eviction phase, per object evicted."""
    t = ObjectTable(90, 90, 10.0, 120.0, 1 << 40)
    t.objects = _CountingDict()
    t.add_segment(p.SegmentInfo(1, (n * 10 // 9 + 1) * aligned(footprint(4000)), "h", "/dev/shm/memcache-1-ab", "127.0.0.1:9"))
    for i in range(n):
        code, gen, _ = t.alloc(1, f"k{i}", 4000, 1, [1], 0.0)
        assert code == 0 and t.commit(1, f"k{i}", gen, 0.0) == 0
    assert t.counters.evictions == 0
    _CountingDict.reads = 0
    for i in range(n, n + n // 4):
        code, gen, _ = t.alloc(1, f"k{i}", 4000, 1, [1], 0.0)
        assert code == 0 and t.commit(1, f"k{i}", gen, 0.0) == errors.SUCCESS
    assert t.counters.evictions >= n // 4 and f"k{n // 4 - 1}" not in t.objects and f"k{n // 4 + 1}" in t.objects
    return _CountingDict.reads / t.counters.evictions


def test_eviction_costs_the_same_per_object_in_a_large_segment():
    """Evicting a quarter of a segment one put at a time: the look-ups per evicted object do not grow
    with the segment (a plain dict evicted from its front would rescan its deleted slots each time)."""
    small, large = _lookups_per_eviction(4000), _lookups_per_eviction(32000)
    assert large <= small * 1.1 + 1 and large < 20, (small, large)


def test_the_native_table_prototype_answers_as_the_table_does():
    """benchmarks/bench_meta_native.py (the measurement behind docs/design.md's "Capacity of one
    MetaService"): its native map answers every Exist byte for byte as the MetaService's handler does
    (pending and absent keys among them; the script fails otherwise), in under 250 bytes per object."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler: the prototype is built by the benchmark")
    bench = os.path.join(os.path.dirname(BENCH), "bench_meta_native.py")
    out = subprocess.run([sys.executable, bench, "--objects", "5000", "--pending", "50", "--sizes", "1,16,300",
                          "--batches", "20", "--rounds", "1", "--cc", cc], check=True, capture_output=True, text=True,
                         timeout=240).stdout
    total = float(re.search(r"total ([\d.]+) B", out).group(1))   # type: ignore[union-attr]
    assert total < 250 and len(re.findall(r"^\s+(?:1|16|300) ", out, re.M)) == 3, out
