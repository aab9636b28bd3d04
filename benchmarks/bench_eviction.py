#!/usr/bin/env python3
"""Which keys eviction keeps pool-wide, and what a put costs, under each placement policy, in-process.

An ``ObjectTable`` with ``--segments`` segments (each of a writer, ids 1..N) of ``--per-segment``
4 KiB objects under the 90% high-water mark (low mark 80%). All writers put in turn until the pool
has taken its capacity in objects; then the last writer goes idle and the others go on in turn for
``--rounds`` times the capacity more. Each put is an ``alloc`` in the policy's order
(``placement.order``, the writer's own segment first under ``local_first``) and a ``commit``, on a
clock that advances 20 µs a put (a MetaService's pace).

For each policy it prints:

* ``kept``: of the last H keys written (H = the objects the pool holds at the end), the share still
  in the pool; beside it the same share for one pool-wide LRU list of H objects fed the same puts
  (the reference, simulated in the same run);
* ``local``: the share of the idle phase's puts that landed in the writer's own segment;
* ``put``: the thread CPU time of one put (alloc + commit) during the idle phase, when puts evict:
  the median over blocks of 1,000 puts, beside the median for the fill's puts (none evicts).

Only the table's public calls are used, so the same script measures another tree through
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time

from memcache_core import protocol as p
from memcache_core.layout import footprint
from memcache_core.meta import placement
from memcache_core.meta.allocator import aligned
from memcache_core.meta.table import ObjectTable

SIZE = 4096
BLOCK = 1000


def run(policy: str, segments: int, per_segment: int, rounds: int, seed: int) -> dict[str, float]:
    t = ObjectTable(90, 80, 1.0, 120.0, 1 << 40)
    size = per_segment * aligned(footprint(SIZE)) * 10 // 9 + 4096
    for sid in range(1, segments + 1):
        t.add_segment(p.SegmentInfo(sid, size, f"host{sid}", f"/dev/shm/memcache-{sid}-ab", "127.0.0.1:9"))
    rng = random.Random(seed)
    written: list[str] = []
    clock = [0.0]
    local = [0]

    def put(writer: int) -> None:
        key = f"w{writer}-{len(written)}"
        clock[0] += 20e-6
        now = clock[0]
        code, gen, locs = t.alloc(writer, key, SIZE, 1, placement.order(policy, t.segments, writer, rng), now)
        if code != 0 or t.commit(writer, key, gen, now) != 0:
            raise SystemExit(f"{policy}: put of {key!r} failed ({code})")
        local[0] += locs[0].segment_id == writer
        written.append(key)

    def timed(writers: list[int], n: int) -> list[float]:
        per_put = []
        for start in range(0, n, BLOCK):
            t0 = time.thread_time()
            for i in range(start, min(n, start + BLOCK)):
                put(writers[i % len(writers)])
            per_put.append((time.thread_time() - t0) / (min(n, start + BLOCK) - start))
        return per_put

    capacity = segments * per_segment
    fill = timed(list(range(1, segments + 1)), capacity)
    if t.counters.evictions:
        raise SystemExit(f"{policy}: {t.counters.evictions} evictions during the fill")
    local[0] = 0
    busy = timed(list(range(1, segments)), rounds * capacity)
    held = sum(1 for o in t.objects.values() if o.committed)
    last = written[-held:]
    reference: collections.OrderedDict[str, None] = collections.OrderedDict()
    for k in written:   # one LRU list for the pool, of the same number of objects
        reference[k] = None
        if len(reference) > held:
            reference.popitem(last=False)
    return {"held": held, "kept": sum(k in t.objects for k in last) / held,
            "reference": sum(k in reference for k in last) / held, "local": local[0] / (rounds * capacity),
            "put": statistics.median(busy) * 1e6, "fill": statistics.median(fill) * 1e6,
            "evictions": t.counters.evictions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--per-segment", type=int, default=5000, help="4 KiB objects a segment holds at its high mark")
    ap.add_argument("--rounds", type=int, default=3, help="the idle phase puts this many times the pool's capacity")
    ap.add_argument("--policy", choices=("local_first", "spread", "random"), action="append")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    for policy in args.policy or ("local_first", "spread", "random"):
        r = run(policy, args.segments, args.per_segment, args.rounds, args.seed)
        print(f"{policy:11s} kept {r['kept']:6.1%} of the last {r['held']:,} keys (one pool-wide LRU: "
              f"{r['reference']:.1%})  local {r['local']:5.1%}  put {r['put']:.2f} us (fill, no eviction: "
              f"{r['fill']:.2f} us)  evictions {r['evictions']:,}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
