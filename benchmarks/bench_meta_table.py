#!/usr/bin/env python3
"""The MetaService's object table at scale, in-process: fill, eviction, and request handling.

Fills the table of a ``MetaServiceCore`` (no sockets) with ``--objects`` committed 4 KiB objects
(90-character keys, as ``bench_meta_memory.py``'s) over ``--segments`` segments sized so that they
just fit under the 90% high-water mark, then times:

* ``fill``: the puts (alloc and commit per object);
* ``evict``: ``--objects / 4`` more puts, each evicting what it needs: with ``--low 90`` (equal to
  the high mark, which the table allows though the config does not) every put evicts about one
  object, the hardest case for an LRU list; ``--low 80`` evicts in batches down to the low mark.
  The least recently used quarter must be gone and the rest there, or the run fails;
* ``handle``: ``MetaServiceCore.handle`` of decoded ``Exist`` and leased ``Lookup`` requests of 1
  and 1,000 keys (best of 5 repeats), on the full table.

It uses the table's public calls only, so the same script times another tree with ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
import timeit

from memcache_core import protocol as p
from memcache_core.config import MetaConfig
from memcache_core.layout import footprint
from memcache_core.meta import service
from memcache_core.meta.allocator import aligned
from memcache_core.meta.table import ObjectTable

SIZE = 4096
CLOCK = itertools.count()
PREFIX = "1.Llama-3.1-8B-9c2a."


def core_with_segments(objects: int, segments: int, low: float) -> tuple[service.MetaServiceCore, list[int]]:
    core = service.MetaServiceCore(MetaConfig())
    core.table = ObjectTable(90, low, 10.0, 120.0, 1 << 40)
    per = -(-objects // segments) * aligned(footprint(SIZE)) * 10 // 9 + 4096
    ids = [random.Random(i).getrandbits(62) or 1 for i in range(segments)]
    for i, sid in enumerate(ids):
        core.table.add_segment(p.SegmentInfo(sid, per, f"host{i}", f"/dev/shm/memcache-{i}-ab", "127.0.0.1:9"))
    return core, ids


def put_all(t: ObjectTable, keys: list[str], ids: list[int], rng: random.Random) -> None:
    """Put the keys in turn over the segments, on a clock that advances 20 µs a put (eviction compares
    objects across segments by their time of use: on a clock that stood still all would be as old)."""
    for i, k in enumerate(keys):
        order = ids[i % len(ids):] + ids[:i % len(ids)]
        now = next(CLOCK) * 20e-6
        code, gen, _ = t.alloc(1, k, SIZE, 1, order, now)
        if code != 0 or t.commit(1, k, gen, now, rng.getrandbits(64)) != 0:
            raise SystemExit(f"put of {k!r} failed ({code})")


def _handle(core: service.MetaServiceCore, keys: list[str]) -> list[tuple[str, float]]:
    out = []
    for n in (1, 1000):
        for name, req in (("Exist", p.Exist(keys[:n])), ("Lookup", p.Lookup(keys[:n], lease=True))):
            dec = p.request_decoder.decode(p.request_encoder.encode(req))
            number = 20000 if n == 1 else 50
            best = min(timeit.repeat(lambda: core.handle(dec), number=number, repeat=5)) / number  # noqa: B023
            out.append((f"{name}({n})", best * 1e6))
    return out


def _check_lru(t: ObjectTable, keys: list[str], more: list[str], segments: int, evictions: int) -> None:
    """Key i of the fill went to segment i % segments; in each, the objects gone must be the oldest
    ones (the last 1,000 keys were read since, and the new puts are the most recent)."""
    gone = [k not in t.objects for k in keys[:-1000]]
    for s in range(segments):
        mine = gone[s::segments]
        if any(mine[mine.index(False):] if False in mine else ()):
            raise SystemExit(f"segment {s}: an object was evicted while an older one stayed")
    if sum(gone) != evictions or evictions < len(more) * 9 // 10 or \
            not all(k in t.objects for k in keys[-1000:] + more):
        raise SystemExit(f"eviction was not least-recently-used: {evictions} evictions, {sum(gone)} objects gone")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--low", type=float, default=90.0, help="low-water mark, percent (90: one eviction step per put)")
    args = ap.parse_args(argv)
    rng = random.Random(1)
    keys = [f"{PREFIX}{rng.getrandbits(256):064x}.{i % 1000:03d}" for i in range(args.objects)]
    more = [f"{PREFIX}{rng.getrandbits(256):064x}.new" for _ in range(args.objects // 4)]
    core, ids = core_with_segments(args.objects, args.segments, args.low)
    t = core.table
    start = time.perf_counter()
    put_all(t, keys, ids, rng)
    fill = time.perf_counter() - start
    if t.counters.evictions:
        raise SystemExit(f"{t.counters.evictions} evictions during the fill: segments too small")
    handle = _handle(core, keys[-1000:])   # (the leased Lookups make these 1,000 the most recent)
    start = time.perf_counter()
    put_all(t, more, ids, rng)
    evict = time.perf_counter() - start
    n = t.counters.evictions
    _check_lru(t, keys, more, len(ids), n)
    print(f"{args.objects:,} objects, {args.segments} segments: fill {fill:.2f} s ({fill / args.objects * 1e6:.2f} us/put); "
          f"{len(more):,} more puts evicting {n:,} (low mark {args.low:g}%): {evict:.2f} s "
          f"({evict / n * 1e6:.2f} us per eviction, with its put)")
    print("handle: " + ", ".join(f"{name} {us:.2f} us" for name, us in handle), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
