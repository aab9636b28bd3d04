#!/usr/bin/env python3
"""What a fence rotation costs the other writers of a segment (docs/design.md, "Cleanup of
half-written objects").

    python benchmarks/bench_fence_rotation.py                      # 20 s per phase, host_shm
    python benchmarks/bench_fence_rotation.py --protocol host_tcp --seconds 30 --every 2

A MetaService (``pending_timeout_ms`` ``--pending-ms``, default 1000) and one standalone provider
(``memcache local-service``, its defaults: a heartbeat a second, ``fence_wait_ms`` 3 s) with a segment of
``--segment`` bytes; ``--writers`` pure clients in this process, each on a thread of its own, put
objects of ``--size`` bytes into it one at a time, in a loop (eviction makes room). Two phases:

1. no reclaim: the cost of the mechanism when nothing is reclaimed (nothing changed);
2. reclaims: every ``--every`` seconds one more client allocates an object in the segment and never
   copies nor commits it (an abandoned put, as a frozen writer leaves one); the MetaService reclaims
   it after ``pending_timeout_ms`` and the provider rotates its fence, which fails the other writers'
   puts whose copy starts after the rotation with -3101 (never acknowledged: the caller puts again).

Prints per phase the puts, the failed ones by code, put latency p50 / p99 / max, the fence rotations
(``memcache_fence_rotations_total``) and the most bytes kept out of use at once (``memcache_fenced_bytes``).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import threading
import time

import numpy as np
from bench_drain import start_provider

from memcache_core import DistributedObjectStore
from memcache_core import protocol as p
from memcache_core.rpc import expect
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for

MIB = 1 << 20


def client(meta: MetaServiceProcess, protocol: str) -> DistributedObjectStore:
    store = DistributedObjectStore()
    conf = meta.local_config(protocol=protocol, client_timeout_seconds=10, log_level="error")
    assert store.setup(conf) == 0 and store.init(0, init_bm=False) == 0
    return store


def run_phase(meta: MetaServiceProcess, writers: list[DistributedObjectStore], size: int, seconds: float,
              abandon: DistributedObjectStore | None, every: float) -> dict:
    stop = threading.Event()
    lat: list[float] = []
    codes: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()
    rotations0 = meta.metric("fence_rotations_total")

    def write(i: int, w: DistributedObjectStore) -> None:
        data = np.full(size, i + 1, np.uint8)
        assert w.register_buffer(data.ctypes.data, data.nbytes) == 0
        n = 0
        while not stop.is_set():
            key = f"w{i}-{n}"
            n += 1
            t = time.perf_counter()
            rc = w.put_from(key, data.ctypes.data, size)
            dt = time.perf_counter() - t
            with lock:
                codes[rc] += 1
                if rc == 0:
                    lat.append(dt)

    threads = [threading.Thread(target=write, args=(i, w)) for i, w in enumerate(writers)]
    for th in threads:
        th.start()
    fenced_max, abandoned = 0.0, 0
    end = time.monotonic() + seconds
    next_abandon = time.monotonic() + every
    while time.monotonic() < end:
        if abandon is not None and time.monotonic() >= next_abandon:
            svc = abandon._service()   # an abandoned put: allocated, never copied nor committed
            s = svc.session
            expect(svc.rpc.call(p.Alloc(s.client_id, s.token, [f"abandoned-{abandoned}"], [size])), p.AllocReply)
            abandoned += 1
            next_abandon += every
        fenced_max = max(fenced_max, meta.metric("fenced_bytes"))
        time.sleep(0.05)
    stop.set()
    for th in threads:
        th.join()
    lat.sort()
    return {"puts": sum(codes.values()), "failed": {c: k for c, k in sorted(codes.items()) if c != 0},
            "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
            "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else 0.0,
            "max_ms": 1000 * lat[-1] if lat else 0.0, "abandoned": abandoned,
            "rotations": meta.metric("fence_rotations_total") - rotations0, "fenced_max": fenced_max}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", default="host_shm", choices=["host_shm", "host_tcp"])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--every", type=float, default=3.0, help="seconds between abandoned puts (phase 2)")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--size", type=int, default=MIB)
    ap.add_argument("--segment", default="256MB")
    ap.add_argument("--pending-ms", type=int, default=1000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="memcache-bench-") as d, \
            running_meta_service(pending_timeout_ms=a.pending_ms) as meta:
        provider = start_provider(meta, d, 0, a.protocol, a.segment)
        try:
            wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 1, 30, "the provider to join")
            writers = [client(meta, a.protocol) for _ in range(a.writers)]
            abandon = client(meta, a.protocol)
            print(f"{a.writers} writers, puts of {a.size // 1024} KiB one at a time into one provider ({a.protocol}, "
                  f"heartbeat 1 s), pending_timeout_ms {a.pending_ms}, {a.seconds:g} s per phase")
            for name, ab in (("no reclaim", None), (f"an abandoned put every {a.every:g} s", abandon)):
                r = run_phase(meta, writers, a.size, a.seconds, ab, a.every)
                failed = ", ".join(f"{k} x {c}" for c, k in r["failed"].items()) or "none"
                print(f"{name:34s} puts {r['puts']:6d}  failed {failed:14s}  p50 {r['p50_ms']:6.2f} ms  "
                      f"p99 {r['p99_ms']:7.2f} ms  max {r['max_ms']:8.2f} ms  abandoned {r['abandoned']:3d}  "
                      f"rotations {r['rotations']:3.0f}  fenced max {r['fenced_max'] / MIB:5.1f} MiB")
            for w in [*writers, abandon]:
                w.close()
        finally:
            provider.terminate()
            provider.wait()


if __name__ == "__main__":
    main()
