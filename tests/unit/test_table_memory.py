"""What keeps the object table small (benchmarks/bench_meta_memory.py measures it): one string per key
whatever request carried it, one int per distinct size, one lease-end float per read request, objects
and locations outside the garbage collector."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

from memcache_core import protocol as p
from memcache_core.meta.table import MAX_SHARED_SIZES, ObjectTable

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_meta_memory.py")


def _decoded(req: p.Request) -> p.Request:
    """The request as the MetaService sees it: fresh strings and ints from msgpack."""
    return p.request_decoder.decode(p.request_encoder.encode(req))


def _table() -> ObjectTable:
    t = ObjectTable(90, 80, 10.0, 120.0, 1 << 40)
    t.add_segment(p.SegmentInfo(7, 1 << 30, "h", "/dev/shm/memcache-1-ab", "127.0.0.1:9"))
    return t


def test_a_committed_object_holds_one_copy_of_its_key_and_shares_its_size():
    t = _table()
    keys = [f"ns.{i:064x}" for i in range(3)]
    alloc = _decoded(p.Alloc(7, b"", keys, [4096, 4096, 8192]))
    assert isinstance(alloc, p.Alloc)
    gens = [t.alloc(7, k, s, 1, [7], 0.0)[1] for k, s in zip(alloc.keys, alloc.sizes, strict=True)]
    commit = _decoded(p.Commit(7, b"", keys, gens, [11, 12, 13]))
    assert isinstance(commit, p.Commit)
    for k, g, c in zip(commit.keys, commit.generations, commit.checksums, strict=True):
        assert t.commit(7, k, g, 0.0, c) == 0
    lru = t.segments[7].lru
    objs = [t.objects[k] for k in keys]
    assert [o.size for o in objs] == [4096, 4096, 8192] and [o.checksum for o in objs] == [11, 12, 13]
    for o, k in zip(objs, lru, strict=True):
        assert k is o.key and next(k2 for k2 in t.objects if k2 == k) is o.key   # one string, not the Commit's
    assert objs[0].size is objs[1].size
    assert not gc.is_tracked(objs[0]) and not gc.is_tracked(objs[0].locations[0])


def test_sizes_beyond_the_shared_set_are_kept_as_given():
    t = _table()
    for i in range(MAX_SHARED_SIZES + 3):
        assert t.alloc(7, f"k{i}", 100 + i, 1, [7], 0.0)[0] == 0
    assert len(t._sizes) == MAX_SHARED_SIZES
    assert [t.objects[f"k{i}"].size for i in range(MAX_SHARED_SIZES + 3)] == [100 + i for i in range(MAX_SHARED_SIZES + 3)]


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
    """benchmarks/bench_meta_memory.py at 5,000 objects (it checks every object it put): ~540 bytes each
    here, 90-character keys included; the table before these savings took ~790."""
    out = subprocess.run([sys.executable, BENCH, "--objects", "5000", "--method", "tracemalloc"], check=True,
                         capture_output=True, text=True, timeout=240).stdout
    after_put, after_read = (float(x) for x in re.findall(r"([\d.]+) (?:bytes/object after put|after one)", out))
    assert after_put < 600 and after_read < 600, out
