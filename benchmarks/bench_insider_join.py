#!/usr/bin/env python3
"""An insider's re-join with a huge report list, against an honest member's latency.

A MetaService process and an honest LocalService in this process (one object). An insider (a
client holding the pool secret) joins with a segment announced as 4 TiB and reports ``--objects``
objects: the first ``protocol.MAX_KEYS`` in its ``Join`` (``more``), the rest in ``Report``
requests of the same bound. Meanwhile a thread calls the honest member's ``is_exist`` back to back.
Prints the time of the whole report, the longest single request, the honest calls' p50 and worst,
any answer other than 1, whether the honest member kept its id (never declared dead), and the
MetaService's resident memory before and after (the objects stay in its table, counted against the
insider's ``member_max_objects``, ``--quota``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import threading
import time

from memcache_core import DistributedObjectStore
from memcache_core import protocol as p
from memcache_core.rpc import expect
from memcache_core.testing import running_meta_service


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--quota", type=int, default=0, help="member_max_objects (0: the default)")
    args = ap.parse_args()
    extra = {"member_max_objects": args.quota} if args.quota else {}
    with running_meta_service(heartbeat_timeout_ms=10_000, **extra) as meta:
        store = DistributedObjectStore()
        assert store.setup(meta.local_config(heartbeat_interval_ms=200)) == 0 and store.init(0, True) == 0
        member = store.get_local_service_id()
        assert store.put("honest", b"h" * 512) == 0
        pid = meta.pid
        assert pid is not None
        rss0 = _rss_mib(pid)
        rpc = meta.rpc(60.0)
        seg = p.SegmentInfo(0, 4 << 40, "insider", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(6)}",
                            "127.0.0.1:9")
        k, n = p.MAX_KEYS, args.objects
        reports = [p.ObjectReport(f"r{i}", i * 4096, 1024, 1 + i, 0) for i in range(n)]
        lat: list[float] = []
        bad: list[int] = []
        done = threading.Event()

        def honest() -> None:
            while not done.is_set():
                t = time.perf_counter()
                r = store.is_exist("honest")
                lat.append(time.perf_counter() - t)
                if r != 1:
                    bad.append(r)

        th = threading.Thread(target=honest)
        th.start()
        took: list[float] = []
        parts = max(1, -(-n // k))
        t0 = time.perf_counter()
        try:
            t = time.perf_counter()
            j = expect(rpc.call(p.Join(0, "insider", os.getpid(), seg, reports[:k], more=parts > 1)), p.Joined)
            took.append(time.perf_counter() - t)
            for i in range(1, parts):
                t = time.perf_counter()
                expect(rpc.call(p.Report(j.client_id, j.token, reports[i * k:(i + 1) * k], last=i == parts - 1)), p.Ok)
                took.append(time.perf_counter() - t)
            total = time.perf_counter() - t0
        finally:
            done.set()
            th.join()
        lat.sort()
        print(f"{n:,} reported objects in {parts} requests: {total:.1f} s in all, longest request "
              f"{max(took):.2f} s")
        print(f"honest is_exist meanwhile: {len(lat)} calls, p50 {lat[len(lat) // 2] * 1e3:.1f} ms, worst "
              f"{lat[-1] * 1e3:.0f} ms, answers other than 1: {bad[:5]} ({len(bad)}); kept its member id: "
              f"{store.get_local_service_id() == member}")
        print(f"MetaService resident memory {rss0} -> {_rss_mib(pid)} MiB; keys in its table "
              f"{len(meta.http('/get_all_keys')['keys']):,}")
        rpc.close()
        store.close()


if __name__ == "__main__":
    main()
