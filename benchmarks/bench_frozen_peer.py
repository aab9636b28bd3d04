#!/usr/bin/env python3
"""Read latency while one of two replica holders is frozen (SIGSTOP), and what the progress deadline
costs when nothing is wrong.

    python benchmarks/bench_frozen_peer.py                  # 30 s freeze, defaults (read_deadline_ms 1000)
    python benchmarks/bench_frozen_peer.py --freeze 10 --objects 256 --batch 32

A MetaService with its defaults (``heartbeat_timeout_ms`` 10 s) and two standalone providers
(``memcache local-service``, ``host_tcp``); a pure client in this process puts ``--objects`` objects
of ``--size`` bytes with replicaNum 2, so each provider holds a copy of every object. Then:

1. no fault: gets of ``--batch`` random keys for ``--seconds``, alternating between a client with the
   progress deadline (the default) and one with ``read_deadline_ms: 0`` (every read waits up to the
   client timeout, as before the deadline existed): the cost of the mechanism;
2. freeze: the provider the table lists first for the first key is stopped with SIGSTOP for
   ``--freeze`` seconds (declared dead after 10 s, as a long pause would be) while the client with
   the deadline keeps reading; SIGCONT at the end, always.

Every get is checked byte for byte; a miss or a wrong byte aborts the run. Prints p50 / p99 / max per
phase and the memcpy reference of one batch, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np
from bench_drain import start_provider

from memcache_core import DistributedObjectStore, ReplicateConfig
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for

KIB = 1 << 10


class Reader:
    """A pure client with one registered buffer of ``batch`` objects."""

    def __init__(self, meta: MetaServiceProcess, batch: int, size: int, **cfg: object) -> None:
        self.store = DistributedObjectStore()
        conf = meta.local_config(protocol="host_tcp", client_timeout_seconds=60, log_level="error", **cfg)
        assert self.store.setup(conf) == 0 and self.store.init(0, init_bm=False) == 0
        self.size = size
        self.buf = np.zeros(batch * size, dtype=np.uint8)
        assert self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes) == 0

    def get(self, data: np.ndarray, idx: list[int]) -> float:
        """Seconds one batched get of objects ``idx`` took; aborts on a miss or a wrong byte."""
        base, n = self.buf.ctypes.data, self.size
        self.buf[:] = 0
        t = time.perf_counter()
        codes = self.store.batch_get_into([f"frozen-bench-{i}" for i in idx],
                                          [base + j * n for j in range(len(idx))], [n] * len(idx))
        dt = time.perf_counter() - t
        if codes != [0] * len(idx):
            raise SystemExit(f"a get failed: codes {sorted(set(codes))}")
        for j, i in enumerate(idx):
            if not np.array_equal(self.buf[j * n:(j + 1) * n], data[i * n:(i + 1) * n]):
                raise SystemExit(f"wrong bytes for object {i}")
        return dt


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def figures(label: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (f"{label:<34} gets {len(ms):>6}  p50 {statistics.median(ms):8.2f} ms  p99 {p99:8.2f} ms  "
            f"max {ms[-1]:8.2f} ms")


def memcpy_ms(size: int, batch: int) -> float:
    src = np.ones(size * batch, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, src.nbytes)
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--size", type=int, default=256 * KIB, help="bytes per object")
    ap.add_argument("--batch", type=int, default=8, help="objects per get")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the no-fault phase")
    ap.add_argument("--freeze", type=float, default=30.0, help="how long one holder stays frozen")
    args = ap.parse_args()
    rng = random.Random(1)
    data = np.random.default_rng(7).integers(0, 256, args.objects * args.size, dtype=np.uint8)
    with running_meta_service() as meta, tempfile.TemporaryDirectory() as d:
        provs = [start_provider(meta, d, i, "host_tcp", args.objects * args.size * 2) for i in range(2)]
        try:
            wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 2, 30, "two providers")
            fast = Reader(meta, args.batch, args.size)
            plain = Reader(meta, args.batch, args.size, read_deadline_ms=0)
            writer = Reader(meta, args.objects, args.size)
            writer.buf[:] = data
            codes = writer.store.batch_put_from(
                [f"frozen-bench-{i}" for i in range(args.objects)],
                [writer.buf.ctypes.data + i * args.size for i in range(args.objects)], [args.size] * args.objects,
                replicateConfig=ReplicateConfig(2))
            if codes != [0] * args.objects:
                raise SystemExit(f"puts failed: {sorted(set(codes))}")
            lat: dict[str, list[float]] = {"with the deadline": [], "read_deadline_ms 0": []}
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                idx = rng.sample(range(args.objects), args.batch)
                lat["with the deadline"].append(fast.get(data, idx))
                lat["read_deadline_ms 0"].append(plain.get(data, idx))
            first = meta.http("/query_key?key=frozen-bench-0")["locations"][0]["segment"]
            pid = next(s["pid"] for s in meta.http("/get_all_segments")["segments"] if s["segment_id"] == first)
            frozen_lat: list[float] = []
            with frozen(pid):
                end = time.monotonic() + args.freeze
                while time.monotonic() < end:
                    frozen_lat.append(fast.get(data, rng.sample(range(args.objects), args.batch)))
            print(f"{args.objects} objects x {args.size // KIB} KiB, replicaNum 2 on 2 providers (host_tcp), "
                  f"gets of {args.batch}; memcpy of one batch {memcpy_ms(args.size, args.batch):.2f} ms")
            for label, s in lat.items():
                print(figures(f"no fault, {label}", s))
            print(figures(f"one holder frozen {args.freeze:g} s", frozen_lat))
            for r in (fast, plain, writer):
                r.store.close()
        finally:
            for p in provs:
                p.terminate()
            for p in provs:
                p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
