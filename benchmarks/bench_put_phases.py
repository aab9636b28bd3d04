#!/usr/bin/env python3
"""Where the time of one large local put goes: its phases, timed in-process, beside memcpy.

A MetaService process and a LocalService in this process (a 256 MB segment, ``host_shm``, the
defaults otherwise: checksums on, the native copy loop where it was built). Each repetition puts one
new ``--mib``-sized object (``bench_store.py``'s 8,784 KiB by default) from a page-aligned buffer
into the writer's own segment with ``batch_put_from_layers``, after refreshing the buffer from a
reference copy as ``bench_store.py`` does, then times a single-thread memcpy of the same bytes
(the reference of ``bench_store.py``'s ``xR``) and removes the key. The put's phases are timed by
wrapping the LocalService's control-plane client and transfer engine for the run:

* ``alloc`` / ``commit``: the ``Alloc`` and ``Commit`` calls, send to reply (``alloc`` includes any
  work overlapped with its round trip);
* ``copy``: ``TransferEngine.write`` (copy, checksum and header);
* ``rest``: the put's time outside those (argument checks, building the ops, the owner check; for a
  put through the allocation arena, its copy too: it has no ``Alloc``, and its ``ArenaCommit`` is
  counted as ``commit``);
* ``faults``: minor page faults during the put (0: the segment's space is warm).

Medians over ``--reps`` (after two warm-up puts); ``x memcpy`` is the median of the per-repetition
ratios memcpy time / put time, as ``bench_store.py`` computes it; ``copy x`` the same for the copy
phase alone. ``--loop python`` runs the
pure-Python copy loop (``shm_copy_loop``), ``--checksum off`` without checksums; ``--slices 64,32``
times only the native loop's copy and checksum in those slice sizes (``slices``); ``--arena-mib`` and
``--small-put-kib`` set ``arena_bytes`` and ``small_put_max_bytes`` (an object within both takes the
one-round-trip arena put), ``--rpc-spin-us`` / ``--poll-spin-us`` the client's and the
MetaService's polling. With ``PYTHONPATH`` set, the ``memcache_core`` found there is measured (for
before/after pairs).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

KIB = 1024


def page_aligned(n: int) -> np.ndarray:
    raw = np.empty(n + 4096, np.uint8)
    return raw[(-raw.ctypes.data) % 4096:][:n]


def wrap(times: dict[str, float], name: str, fn: Any) -> Any:
    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times[name] += time.perf_counter() - t
    return timed


def slices(n: int, kibs: list[int], reps: int) -> None:
    """The native loop alone: one object written into shared memory (at a payload's offset) and read
    back, copied and hashed in each slice size, beside memcpy. As in a put, the source was written
    just before (refreshed from a reference copy) and the thread waited ~0.3 ms (a round trip)."""
    from array import array

    from memcache_core.transfer import native
    loop = native.load()
    if loop is None:
        raise SystemExit("the native copy loop is not built here")
    ref, src, scratch = page_aligned(n), page_aligned(n), page_aligned(n)
    ref[:] = np.frombuffer(np.random.default_rng(7).bytes(n), np.uint8)
    shm = mmap.mmap(-1, n + (1 << 20))   # shared and anonymous: shmem pages, as a segment's
    seg = ctypes.addressof(ctypes.c_char.from_buffer(shm)) + 4096 + 320   # a payload's offset
    ctypes.memmove(seg, ref.ctypes.data, n)
    digest = native.HASH | native.RESET | native.DIGEST
    times: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps + 1):
        for k in kibs[rep % len(kibs):] + kibs[:rep % len(kibs)]:
            for name, flags in (("put", 0), ("get", native.READ)):
                ctypes.memmove(src.ctypes.data, ref.ctypes.data, n)
                time.sleep(0.0003)
                rows = array("Q", (seg, 0, 1, 0, native.ALL, native.COPY | digest | flags, 0))
                t = time.perf_counter()
                loop.run(array("Q", (src.ctypes.data, n)), rows, k * KIB)
                dt = time.perf_counter() - t
                t = time.perf_counter()
                ctypes.memmove(scratch.ctypes.data, ref.ctypes.data, n)
                if rep:
                    times[f"{name} {k} KiB"].append((time.perf_counter() - t) / dt)
    print(f"copy and checksum of {n >> 10} KiB, x memcpy (median of {reps}): "
          + "  ".join(f"{k} x{statistics.median(v):.2f}" for k, v in times.items()))
    shm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--kib", type=int, default=8784, help="object size in KiB")
    ap.add_argument("--loop", choices=("auto", "native", "python"), default="auto")
    ap.add_argument("--checksum", choices=("on", "off"), default="on")
    ap.add_argument("--copy-threads", type=int, default=0, help="shm_copy_threads (0: automatic)")
    ap.add_argument("--arena-mib", type=int, default=4, help="the MetaService's arena_bytes, in MiB")
    ap.add_argument("--rpc-spin-us", type=int, default=None, help="rpc_spin_us (default: the config's)")
    ap.add_argument("--poll-spin-us", type=int, default=None, help="the MetaService's poll_spin_us")
    ap.add_argument("--small-put-kib", type=int, default=64, help="small_put_max_bytes, in KiB")
    ap.add_argument("--slices", default="", help="only the native loop's copy and checksum, in these slice "
                    "sizes (KiB, e.g. 64,32), alternately; no pool")
    args = ap.parse_args(argv)
    if not os.environ.get("PYTHONPATH"):   # else the checkout named there (before/after comparisons)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.slices:
        slices(args.kib * KIB, [int(k) for k in args.slices.split(",")], args.reps)
        return 0
    from memcache_core import DistributedObjectStore
    from memcache_core.testing import running_meta_service

    n = args.kib * KIB
    ref, src, scratch = page_aligned(n), page_aligned(n), page_aligned(n)
    ref[:] = np.frombuffer(np.random.default_rng(7).bytes(n), np.uint8)
    meta = {"poll_spin_us": args.poll_spin_us} if args.poll_spin_us is not None else {}
    local = {"rpc_spin_us": args.rpc_spin_us} if args.rpc_spin_us is not None else {}
    with running_meta_service(log_level="warning", arena_bytes=args.arena_mib << 20, **meta) as ms:
        store = DistributedObjectStore()
        cfg = ms.local_config(dram_size="256MB", log_level="warning", shm_copy_loop=args.loop,
                              checksum=args.checksum == "on", shm_copy_threads=args.copy_threads,
                              small_put_max_bytes=args.small_put_kib * KIB, **local)
        if store.setup(cfg) != 0 or store.init(0) != 0:
            raise SystemExit("LocalService did not start")
        store.register_buffer(src.ctypes.data, n)
        svc = store._service()
        times: dict[str, float] = defaultdict(float)
        call = svc.rpc.call

        def rpc_call(req: Any, **kw: Any) -> Any:
            name = type(req).__name__.lower()
            t = time.perf_counter()
            try:
                return call(req, **kw)
            finally:
                times[name] += time.perf_counter() - t

        svc.rpc.call = rpc_call   # type: ignore[method-assign]
        assert svc.engine is not None
        svc.engine.write = wrap(times, "copy", svc.engine.write)   # type: ignore[method-assign]
        rows: list[dict[str, float]] = []
        try:
            for rep in range(args.reps + 2):
                ctypes.memmove(src.ctypes.data, ref.ctypes.data, n)
                key = f"phases/{rep}"
                times.clear()
                f, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                codes = store.batch_put_from_layers([key], [[src.ctypes.data]], [[n]])
                total, f = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
                if codes != [0]:
                    raise SystemExit(f"put failed: {codes}")
                t = time.perf_counter()
                ctypes.memmove(scratch.ctypes.data, ref.ctypes.data, n)
                mc = time.perf_counter() - t
                row = {"put": total, "memcpy": mc, "alloc": times["alloc"], "copy": times["copy"],
                       "commit": times["commit"] + times["arenacommit"], "faults": f}
                row["rest"] = total - row["alloc"] - row["copy"] - row["commit"]
                if rep >= 2:
                    rows.append(row)
                store.remove(key)
        finally:
            store.close()
    med = {k: statistics.median(r[k] for r in rows) * (1 if k == "faults" else 1e3) for k in rows[0]}
    ratio = statistics.median(r["memcpy"] / r["put"] for r in rows)
    copy_ratio = statistics.median(r["memcpy"] / r["copy"] for r in rows if r["copy"]) if med["copy"] else 0.0
    print(f"put {args.kib} KiB, loop {args.loop}, checksum {args.checksum}, {len(rows)} reps (ms, medians): "
          + "  ".join(f"{k} {v:.3f}" for k, v in med.items()) + f"  x memcpy {ratio:.2f}  (copy x{copy_ratio:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
