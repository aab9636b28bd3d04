#!/usr/bin/env python3
"""Shared-memory copy rates through the real store: copy threads, and fresh segments with and without pre-fault.

A MetaService, a writer LocalService process (1 GiB segment) and one pure-client reader process per
``--loops`` value (``shm_copy_loop``: the native loop or the pure-Python one) and ``--threads`` value
(``shm_copy_threads``), all on ``host_shm``. Per layout (one contiguous 8,784 KiB
piece per object, or 122 pieces: 61 x 128 KiB + 61 x 16 KiB scattered layer-major over the batch, as
in bench_store.py) and batch, the writer stores the batch once; each repetition every reader reads it
(the readers' order rotates per repetition) and, right after, times a single-thread ``memmove`` of
the same bytes between two warm private buffers in the same process ("copy": the time the get spent in
the transfer engine, against the same memcpy; "rpc": its time in control-plane calls, the ``Lookup``;
the rest is the argument checks; the pointer and size lists are built before the clock starts; "piece by
piece": one single-thread memmove per piece of the same layout, against the same memcpy: what a
piece-wise copy costs by itself). Every get is compared byte for byte with the writer's data (the
destination is cleared before each get).

Cold pool: a fresh writer process per run puts ``--cold-mib`` of contiguous objects into its own
never-touched segment, with ``segment_prefault`` off and on (on: after the background pre-fault has
finished, and once more right after start, while it may still run), timed beside a memcpy of the same
bytes in that process.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_store import OBJ_BYTES, SEED, BenchError, page_aligned, piece_memcpy_s, pieces_of  # noqa: E402
from bench_store_worker import Proc as StoreProc  # noqa: E402
from bench_store_worker import serve  # noqa: E402

SEGMENT = 1 << 30


def _store(spec: dict[str, Any], segment: int, **keys: Any) -> Any:
    from memcache_core import DistributedObjectStore, LocalConfig
    cfg = LocalConfig(meta_service_url=spec["meta_service_url"], config_store_url=spec["config_store_url"],
                      protocol="host_shm", dram_size=segment, log_level="warning", hcom_url="tcp://127.0.0.1:0",
                      checksum=spec["checksum"], **keys)
    store = DistributedObjectStore()
    if store.setup(cfg) != 0 or store.init(0, init_bm=segment > 0) != 0:
        raise BenchError("LocalService did not start")
    return store


def _layers(pieces: list[list[tuple[int, int]]]) -> tuple[list[list[int]], list[list[int]]]:
    return [[p for p, _ in ps] for ps in pieces], [[s for _, s in ps] for ps in pieces]


class Worker:
    """One process: a store, a data buffer, the expected image and a scratch buffer for memcpy."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.store = _store(spec, spec["segment"], **spec["keys"])
        n = spec["max_batch"] * OBJ_BYTES
        self.expected = page_aligned(n, np.random.default_rng(SEED).bytes(n))
        self.data = page_aligned(n, self.expected.tobytes())
        self.scratch = page_aligned(n, bytes(n))
        if self.store.register_buffer(self.data.ctypes.data, n) != 0:
            raise BenchError("register_buffer failed")
        self.copy_s = 0.0
        engine = self.store._service().engine
        read = engine.read

        def timed_read(ops: Any) -> None:   # the copy's share of a get (the rest: lookup, checks)
            t = time.perf_counter()
            read(ops)
            self.copy_s += time.perf_counter() - t
        engine.read = timed_read
        svc = self.store._service()
        call = svc.rpc.call
        self.rpc_s = 0.0

        def timed_call(*a: Any, **k: Any) -> Any:   # less a copy run while the reply was on the way
            t, copied = time.perf_counter(), self.copy_s
            try:
                return call(*a, **k)
            finally:
                self.rpc_s += time.perf_counter() - t - (self.copy_s - copied)
        svc.rpc.call = timed_call

    def hello(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.store.close()

    def _pieces(self, layout: str, batch: int) -> list[list[tuple[int, int]]]:
        return [pieces_of(layout, self.data.ctypes.data, batch, k) for k in range(batch)]

    def put(self, layout: str, batch: int, prefix: str) -> dict[str, Any]:
        keys = [f"{prefix}/{k}" for k in range(batch)]
        ptrs, sizes = _layers(self._pieces(layout, batch))   # the caller's lists, built before the clock
        t = time.perf_counter()
        codes = self.store.batch_put_from_layers(keys, ptrs, sizes)
        dt = time.perf_counter() - t
        if any(c != 0 for c in codes):
            return {"error": f"put {prefix}: codes {sorted(set(codes))}"}
        return {"s": dt, "memcpy_s": self._memcpy(batch * OBJ_BYTES)}

    def get(self, layout: str, batch: int, prefix: str) -> dict[str, Any]:
        keys, n = [f"{prefix}/{k}" for k in range(batch)], batch * OBJ_BYTES
        self.data[:n] = 0
        self.copy_s = 0.0
        self.rpc_s = 0.0
        ptrs, sizes = _layers(self._pieces(layout, batch))
        t = time.perf_counter()
        codes = self.store.batch_get_into_layers(keys, ptrs, sizes)
        dt = time.perf_counter() - t
        if any(c != 0 for c in codes):
            return {"error": f"get {prefix}: codes {sorted(set(codes))}"}
        mc = self._memcpy(n)
        pieces = piece_memcpy_s(self._pieces(layout, batch), self.scratch.ctypes.data, gather=True)
        if not np.array_equal(self.data[:n], self.expected[:n]):
            bad = int(np.flatnonzero(self.data[:n] != self.expected[:n])[0])
            return {"error": f"get {prefix}: bytes differ from what was written (first at offset {bad})"}
        return {"s": dt, "memcpy_s": mc, "copy_s": self.copy_s, "pieces_s": pieces, "rpc_s": self.rpc_s}

    def _memcpy(self, n: int) -> float:
        t = time.perf_counter()
        ctypes.memmove(self.scratch.ctypes.data, self.expected.ctypes.data, n)
        return time.perf_counter() - t

    def prefaulted(self, timeout_s: float) -> dict[str, Any]:
        """Wait until the segment's background pre-fault has finished."""
        pf = self.store._service().prefault
        if pf is None or not pf.done.wait(timeout_s):
            return {"error": "pre-fault is off or did not finish"}
        return {}

    def cold_put(self, count: int, prefix: str) -> dict[str, Any]:
        """Put ``count`` contiguous objects (a batch at a time) into this process's fresh segment, then
        remove them and put them again into the same, now warm, space."""
        out: dict[str, Any] = {}
        for phase in ("cold", "warm"):
            step, total, mc = self.spec["max_batch"], 0.0, 0.0
            for first in range(0, count, step):
                r = self.put("contiguous", min(step, count - first), f"{prefix}/{first}")
                if "error" in r:
                    return r
                total, mc = total + r["s"], mc + r["memcpy_s"]
            self.store.remove_batch([f"{prefix}/{first}/{k}" for first in range(0, count, step)
                                     for k in range(min(step, count - first))])
            out[phase] = {"s": total, "memcpy_s": mc}
        return out


def _worker_main(conn: Any, spec: dict[str, Any]) -> None:
    serve(conn, Worker, spec)


def Proc(spec: dict[str, Any]) -> StoreProc:  # noqa: N802 - reads as the class it builds
    return StoreProc(spec, _worker_main)


def _row(label: str, rs: list[dict[str, Any]], nbytes: int) -> str:
    t, mc = statistics.median(r["s"] for r in rs), statistics.median(r["memcpy_s"] for r in rs)
    ratios = sorted(r["memcpy_s"] / r["s"] for r in rs)
    line = (f"{label:51} {nbytes / t / 1e9:6.2f} GB/s  memcpy {nbytes / mc / 1e9:6.2f} GB/s  "
            f"x{statistics.median(ratios):.2f} (x{ratios[0]:.2f}-x{ratios[-1]:.2f})  {t * 1e3:7.2f} ms")
    if "copy_s" in rs[0]:
        line += (f"  copy x{statistics.median(r['memcpy_s'] / r['copy_s'] for r in rs):.2f} "
                 f"{statistics.median(r['copy_s'] for r in rs) * 1e3:.2f} ms  "
                 f"piece by piece x{statistics.median(r['memcpy_s'] / r['pieces_s'] for r in rs):.2f}"
                 f"  rpc {statistics.median(r['rpc_s'] for r in rs) * 1e3:.2f} ms")
    return line


def gets(spec: dict[str, Any], args: argparse.Namespace) -> None:
    writer = Proc({**spec, "segment": SEGMENT, "keys": {}})
    readers = []
    try:
        for loop in args.loops:
            for n in args.threads:
                for hints in args.hints:
                    keys: dict[str, Any] = {"shm_copy_threads": n}
                    if loop != "default":   # default: leave the keys out (older code that has no such key)
                        keys["shm_copy_loop"] = loop
                    if hints == "off":
                        keys["location_hints"] = 0
                    readers.append(((n, loop, hints), Proc({**spec, "segment": 0, "keys": keys})))
        for layout in args.layouts:
            for batch in args.batches:
                prefix = f"{layout}/b{batch}"
                writer.call("put", layout=layout, batch=batch, prefix=prefix)
                rows: dict[tuple[int, str, str], list[dict[str, Any]]] = {n: [] for n, _ in readers}
                for rep in range(args.reps + 1):
                    order = readers[rep % len(readers):] + readers[:rep % len(readers)]
                    for n, r in order:
                        res = r.call("get", layout=layout, batch=batch, prefix=prefix)
                        if rep:   # the first repetition maps the writer's pages: not counted
                            rows[n].append(res)
                for (n, loop, hints), rs in rows.items():
                    label = f"get {layout:10} batch {batch:2} threads {n} {loop:6} hints {hints:3}"
                    print(_row(label, rs, batch * OBJ_BYTES), flush=True)
    finally:
        for _, r in readers:
            r.close()
        writer.close()


def cold_puts(spec: dict[str, Any], args: argparse.Namespace) -> None:
    count = args.cold_mib * (1 << 20) // OBJ_BYTES
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on, finished": [], "on, at once": []}
    warm: list[dict[str, Any]] = []
    for i in range(args.cold_runs):
        for label in runs:
            keys = {"segment_prefault": "off" if label == "off" else "on"}
            w = Proc({**spec, "segment": SEGMENT, "keys": keys})
            try:
                if label == "on, finished":
                    w.call("prefaulted", timeout_s=120)
                r = w.call("cold_put", count=count, prefix=f"cold/{i}/{label}")
                runs[label].append(r["cold"])
                warm.append(r["warm"])
            finally:
                w.close()
    for label, rs in runs.items():
        print(_row(f"cold put, pre-fault {label}", rs, count * OBJ_BYTES), flush=True)
    print(_row("put again into the same space", warm, count * OBJ_BYTES), flush=True)


def per_piece(spec: dict[str, Any], loops: list[str]) -> None:
    """The engine's time per piece: one object of 2,000 pieces of 512 B (not touching) and one of 61
    of 16 KiB, read back from this process's own segment, with checksums on and off, per loop."""
    for loop, checksum in ((loop, checksum) for loop in loops for checksum in (True, False)):
        store = _store({**spec, "checksum": checksum}, 256 << 20, shm_copy_loop=loop)
        engine, times = store._service().engine, list[float]()
        read = engine.read

        def timed(ops: Any, read: Any = read, times: list[float] = times) -> None:
            t = time.perf_counter()
            read(ops)
            times.append(time.perf_counter() - t)
        for size, n in ((512, 2000), (16384, 61)):
            buf = page_aligned(2 * size * n, np.random.default_rng(SEED).bytes(2 * size * n))
            ptrs, sizes = [[buf.ctypes.data + 2 * size * i for i in range(n)]], [[size] * n]
            key = f"pieces/{size}/{checksum}/{loop}"
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0 or \
                    store.batch_put_from_layers([key], ptrs, sizes) != [0]:
                raise BenchError("per-piece put failed")
            times.clear()
            engine.read = timed
            for _ in range(40):
                if store.batch_get_into_layers([key], ptrs, sizes) != [0]:
                    raise BenchError("per-piece get failed")
            engine.read = read
            t = statistics.median(times[5:])
            print(f"engine read, {loop:6} loop, checksums {'on ' if checksum else 'off'}, {n:5} pieces of {size:5} B: "
                  f"{t * 1e6:6.0f} us, {t / n * 1e6:.2f} us per piece", flush=True)
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="shm_copy_threads values of the readers (default 1,2)")
    ap.add_argument("--loops", default="native,python",
                    help="shm_copy_loop values of the readers (default native,python; 'default': not set)")
    ap.add_argument("--hints", default="on",
                    help="location_hints of the readers: on (the default 16,384), off (0), or on,off")
    ap.add_argument("--batches", default="1,8", help="objects per get (default 1,8)")
    ap.add_argument("--layouts", default="contiguous,layered")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions per figure (default 9)")
    ap.add_argument("--checksum", choices=("on", "off"), default="on", help="payload checksums (default on)")
    ap.add_argument("--cold-mib", type=int, default=512, help="MiB put into a fresh segment per cold run")
    ap.add_argument("--cold-runs", type=int, default=3, help="fresh writers per cold figure (default 3)")
    ap.add_argument("--skip", choices=("gets", "cold"), help="leave one part out")
    ap.add_argument("--per-piece", action="store_true", help="only the engine's time per piece")
    args = ap.parse_args(argv)
    args.threads = [int(x) for x in args.threads.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.layouts = args.layouts.split(",")
    args.loops = args.loops.split(",")
    args.hints = args.hints.split(",")
    from memcache_core.testing import running_meta_service
    print(f"{os.cpu_count()} CPUs; medians of {args.reps} repetitions; xR = median of (memcpy time / op time), "
          f"(min-max); checksums {args.checksum}", flush=True)
    with running_meta_service(log_level="warning", lease_ttl_ms=2000) as meta:
        spec = {"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
                "max_batch": max(args.batches), "checksum": args.checksum == "on"}
        try:
            if args.per_piece:
                per_piece(spec, args.loops)
                return 0
            if args.skip != "gets":
                gets(spec, args)
            if args.skip != "cold":
                cold_puts(spec, args)
        except BenchError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
