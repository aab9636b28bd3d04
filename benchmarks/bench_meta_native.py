#!/usr/bin/env python3
"""What native memory would buy the MetaService's table (issue 26 §2, §4): a measuring prototype
against the Python table, answer for answer.

``native_table_probe.c`` (beside this script; built here with the system C compiler, never part of
the package) holds the key -> object map in native memory: per object an 80-byte record with the
fields the Python object has (meta/objects.py), the key in an arena, an open-addressing index of
slots of a record number and 32 bits of the hash, keys hashed with SipHash-1-3 under a random key. It answers an ``Exist``
straight from the request's msgpack bytes with the encoded reply, building no Python object per key,
its keys' look-ups in groups of 16 whose memory reads are prefetched together.

The script fills a ``MetaServiceCore``'s table as ``bench_meta_table.py`` does (``--objects``
committed objects, 88-character keys; ``--pending`` more allocated and not committed), copies every
object into the native map, and then, over ``--batches`` encoded ``Exist`` requests of each size in
``--sizes`` (a random prefix of stored keys, one pending key, the rest absent), checks that the
native reply is byte for byte the Python one (``meta/server.answer``, the MetaService's handler) and
times both in alternating rounds (thread CPU time, median of ``--rounds``):

* ``python answer``: decode, ``handle``, the request's metrics and outcomes, encode: what the
  MetaService runs per request today, without the frame server around it;
* ``python handle``: ``handle`` alone on the decoded request (the look-ups);
* ``native``: the prototype, request bytes to reply bytes.

And the native map's bytes per object (its three parts, exact) beside the growth of this process's
resident memory while it was filled. The Python table's bytes per object are
``bench_meta_memory.py``'s figure.

    python benchmarks/bench_meta_native.py                  # 1M objects, batches of 1 and 264 keys
    python benchmarks/bench_meta_native.py --objects 200000 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import importlib.util
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_meta_table import PREFIX, SIZE, core_with_segments, put_all  # noqa: E402

from memcache_core import protocol as p  # noqa: E402
from memcache_core.meta.objects import PendingObj  # noqa: E402
from memcache_core.meta.server import answer  # noqa: E402

M64 = (1 << 64) - 1


def build(cc: str, workdir: str) -> ModuleType:
    """Compile native_table_probe.c into ``workdir`` and import it."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_table_probe.c")
    out = os.path.join(workdir, "native_table_probe" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", src, "-o", out],
                   check=True)
    loader = importlib.machinery.ExtensionFileLoader("native_table_probe", out)
    spec = importlib.util.spec_from_file_location("native_table_probe", out, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bodies(rng: random.Random, stored: list[str], pending: list[str], size: int, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        hits = rng.randrange(size + 1)
        keys = rng.sample(stored, hits) + [f"{PREFIX}{rng.getrandbits(256):064x}.absent" for _ in range(size - hits)]
        if pending and size > 1:
            keys[rng.randrange(size)] = rng.choice(pending)
        out.append(p.request_encoder.encode(p.Exist(keys)))
    return out


def per_call(fn: Callable[[Any], object], items: Sequence[Any]) -> float:
    """Thread CPU seconds per call of ``fn`` over ``items``."""
    t0 = time.thread_time()
    for item in items:
        fn(item)
    return (time.thread_time() - t0) / len(items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--pending", type=int, default=1000)
    ap.add_argument("--sizes", default="1,264", help="keys per Exist, comma-separated")
    ap.add_argument("--batches", type=int, default=200, help="requests of each size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args(argv)
    if shutil.which(args.cc) is None:
        raise SystemExit(f"no C compiler {args.cc!r} (--cc): the prototype is built here")
    rng = random.Random(1)
    keys = [f"{PREFIX}{rng.getrandbits(256):064x}.{i % 1000:03d}" for i in range(args.objects)]
    pending = [f"{PREFIX}{rng.getrandbits(256):064x}.pending" for _ in range(args.pending)]
    core, ids = core_with_segments(args.objects + args.pending, 4, 90.0)
    t = core.table
    put_all(t, keys, ids, rng)
    for k in pending:
        if t.alloc(1, k, SIZE, 1, ids, 0.0)[0] != 0:
            raise SystemExit(f"alloc of {k!r} failed")
    with tempfile.TemporaryDirectory() as workdir:
        native = build(args.cc, workdir)
        before = rss_bytes()
        native.init(len(t.objects), rng.getrandbits(64), rng.getrandbits(64))
        start = time.perf_counter()
        for k, obj in t.objects.items():
            native.insert(k.encode(), *[(obj.packed >> (64 * i)) & M64 for i in range(5)], type(obj) is not PendingObj)
        fill = time.perf_counter() - start
        grown = rss_bytes() - before
        parts = native.nbytes()
        n = len(t.objects)
        print(f"{n:,} objects ({args.pending:,} of them pending); native map filled in {fill:.2f} s; per object: "
              f"record {parts[0] / n:.0f} B, index {parts[1] / n:.1f} B, key arena {parts[2] / n:.1f} B, "
              f"total {sum(parts) / n:.1f} B; resident memory grew {grown / n:.1f} B per object")
        print(f"{'keys':>5} {'python answer us':>17} {'python handle us':>17} {'native us':>10} "
              f"{'native/answer':>14} {'answer keys/CPU-s':>18} {'native keys/CPU-s':>18}")
        for size in (int(s) for s in args.sizes.split(",")):
            reqs = bodies(rng, keys, pending, size, args.batches)
            decoded = [p.request_decoder.decode(b) for b in reqs]
            for body in reqs:
                want = answer(core, body)
                if native.exist_reply(body) != want:
                    raise SystemExit(f"the native reply differs from the Python one for a request of {size} keys")
            times: dict[str, list[float]] = {"answer": [], "handle": [], "native": []}
            for _ in range(args.rounds):   # alternating, so that the machine's load moves all three alike
                times["answer"].append(per_call(functools.partial(answer, core), reqs))
                times["handle"].append(per_call(core.handle, decoded))
                times["native"].append(per_call(native.exist_reply, reqs))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{size:>5} {med['answer'] * 1e6:>17.2f} {med['handle'] * 1e6:>17.2f} {med['native'] * 1e6:>10.2f} "
                  f"{med['native'] / med['answer']:>14.3f} {size / med['answer']:>18,.0f} "
                  f"{size / med['native']:>18,.0f}", flush=True)
        native.drop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
