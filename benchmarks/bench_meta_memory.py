#!/usr/bin/env python3
"""Bytes per object in the MetaService's object table.

Builds an ``ObjectTable`` the way the MetaService does (``Alloc`` and ``Commit`` requests decoded
from msgpack, so keys and integers are the objects a real service holds), fills it with
``--objects`` committed objects of ``--key-len``-character keys (a shared namespace prefix and a
64-hex-digit page hash, like the SGLang and vLLM keys), then reads each once with a lease (a read
object carries its lease time). Prints the memory held per object after the puts and after the
reads, measured in a fresh child process per method:

* ``tracemalloc``: bytes of Python allocations the table holds (exact; the key's own ~140 bytes
  included);
* ``rss``: growth of the process's resident set (what the machine pays, allocator slack included).

Every object is checked afterwards (present, its size, generation, checksum and location), so a
layout that loses or mixes up fields fails the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from memcache_core import protocol as p
from memcache_core.layout import footprint
from memcache_core.meta.table import ObjectTable

BATCH = 1000
SIZE = 4 * 1024
PREFIX = "1.Llama-3.1-8B-9c2a."   # a shared namespace, as the integrations build keys (20 characters)


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _keys(first: int, n: int, key_len: int, rng: random.Random) -> list[str]:
    tail = key_len - len(PREFIX) - 64
    if tail < 2:
        raise SystemExit(f"--key-len must be at least {len(PREFIX) + 66}")
    return [f"{PREFIX}{rng.getrandbits(256):064x}.{(first + i) % 10 ** (tail - 1):0{tail - 1}d}"
            for i in range(n)]


def _segments(table: ObjectTable, count: int, objects: int) -> list[int]:
    per = footprint(SIZE) * (objects // count + BATCH) * 10 // 9   # under the 90% eviction mark
    ids = []
    for i in range(count):
        sid = random.Random(i).getrandbits(62) or 1
        table.add_segment(p.SegmentInfo(sid, per, f"host{i}", f"/dev/shm/memcache-{i}-ab", f"127.0.0.1:{9000 + i}"))
        ids.append(sid)
    return ids


def _fill(table: ObjectTable, ids: list[int], objects: int, key_len: int, replicas: int) -> list[str]:
    """Put ``objects`` objects through decoded Alloc and Commit requests, a batch at a time."""
    rng, keys = random.Random(1), []
    enc = p.request_encoder
    for first in range(0, objects, BATCH):
        n = min(BATCH, objects - first)
        cid = ids[(first // BATCH) % len(ids)]
        alloc = p.request_decoder.decode(enc.encode(p.Alloc(cid, b"t" * 16, _keys(first, n, key_len, rng),
                                                            [SIZE] * n, replicas)))
        assert isinstance(alloc, p.Alloc)
        order = ids[ids.index(cid):] + ids[:ids.index(cid)]
        gens = [table.alloc(cid, k, s, alloc.replicas, order, 0.0)[1] for k, s in zip(alloc.keys, alloc.sizes, strict=True)]
        sums = [rng.getrandbits(64) for _ in range(n)]
        commit = p.request_decoder.decode(enc.encode(p.Commit(cid, b"t" * 16, alloc.keys, gens, sums)))
        assert isinstance(commit, p.Commit)
        for k, g, c in zip(commit.keys, commit.generations, commit.checksums, strict=True):
            if table.commit(cid, k, g, 0.0, c) != 0:
                raise SystemExit(f"commit of {k!r} failed")
        keys += alloc.keys
    return keys


def _read(table: ObjectTable, keys: list[str]) -> None:
    for first in range(0, len(keys), BATCH):
        lookup = p.request_decoder.decode(p.request_encoder.encode(p.Lookup(keys[first:first + BATCH])))
        assert isinstance(lookup, p.Lookup)
        for k in lookup.keys:
            if table.lookup(k, 1.0, True) is None:
                raise SystemExit(f"{k!r} is missing")


def _check(table: ObjectTable, keys: list[str], ids: list[int], replicas: int) -> None:
    """Every object is there with the fields it was put with; offsets are distinct per segment."""
    seen: set[tuple[int, int]] = set()
    for k in keys:
        o = table.lookup(k, 2.0, False)
        if o is None or o.size != SIZE or not o.committed or len(o.locations) != min(replicas, len(ids)):
            raise SystemExit(f"{k!r}: wrong object {o!r}")
        for loc in o.locations:
            if loc.segment_id not in ids or (loc.segment_id, loc.offset) in seen:
                raise SystemExit(f"{k!r}: bad location {loc!r}")
            seen.add((loc.segment_id, loc.offset))
    if table.pending or len(table.objects) != len(keys):
        raise SystemExit(f"{len(table.objects)} objects in the table, {table.pending} pending; wanted {len(keys)}")


def measure(method: str, objects: int, key_len: int, segments: int, replicas: int) -> dict[str, Any]:
    gc.collect()
    if method == "tracemalloc":
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0] if method == "tracemalloc" else _rss()
    used = lambda: (tracemalloc.get_traced_memory()[0] if method == "tracemalloc" else _rss()) - base  # noqa: E731
    t = time.perf_counter()
    table = ObjectTable(90, 80, 10.0, 120.0, 1 << 40)
    ids = _segments(table, segments, objects * replicas)
    keys = _fill(table, ids, objects, key_len, replicas)
    fill_s = time.perf_counter() - t
    gc.collect()
    # the list of keys is the benchmark's, not the table's: leave out its 8 bytes per key
    put = used() - sys.getsizeof(keys)
    _read(table, keys)
    gc.collect()
    read = used() - sys.getsizeof(keys)
    _check(table, keys, ids, replicas)
    return {"method": method, "objects": objects, "key_len": len(keys[0]), "segments": segments,
            "replicas": replicas, "bytes_per_object_put": round(put / objects, 1),
            "bytes_per_object_read": round(read / objects, 1), "fill_s": round(fill_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--key-len", type=int, default=90)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--method", choices=("tracemalloc", "rss", "both"), default="both")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.method, args.objects, args.key_len, args.segments, args.replicas)))
        return 0
    for method in (("tracemalloc", "rss") if args.method == "both" else (args.method,)):
        cmd = [sys.executable, __file__, "--child", "--method", method, "--objects", str(args.objects),
               "--key-len", str(args.key_len), "--segments", str(args.segments), "--replicas", str(args.replicas)]
        r = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)
        print(f"{r['method']:11} {r['objects']:>9,} objects, {r['key_len']}-character keys, {r['segments']} segments, "
              f"{r['replicas']} replica(s): {r['bytes_per_object_put']:6.1f} bytes/object after put, "
              f"{r['bytes_per_object_read']:6.1f} after one leased read  (fill {r['fill_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
