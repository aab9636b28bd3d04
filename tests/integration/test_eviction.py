"""Eviction under pressure while other processes read: every read is byte-exact or a miss."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from memcache_core.testing import running_meta_service, wait_for
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp"])
def test_eviction_under_pressure_never_returns_wrong_bytes(protocol):
    """Scenario: two writers put 4x the pool's capacity while two readers keep reading recent and
    old keys. Puts never hang; old keys are evicted (LRU); zero mismatches in every read."""
    with running_meta_service(evict_threshold_high=80, evict_threshold_low=60, lease_ttl_ms=500,
                              heartbeat_timeout_ms=5000) as ms:
        cfg = {"protocol": protocol, "dram_size": "24MB"}
        writers = [StoreProcess(ms, **cfg) for _ in range(2)]
        readers = [StoreProcess(ms, **cfg) for _ in range(2)]
        layout = [256 << 10, 64 << 10]           # 320 KiB objects; pool of 96 MiB holds ~300
        written: list[str] = []
        lock = threading.Lock()
        failures: list[str] = []
        stop = threading.Event()
        reads = {"hits": 0, "misses": 0}

        def write(w: StoreProcess, wid: int) -> None:
            for batch in range(75):       # 75 batches x 8 keys x 320 KiB x 2 writers = 375 MiB
                keys = [f"w{wid}-{batch}-{i}" for i in range(8)]
                t = time.monotonic()
                codes = w("put", keys=keys, layout=layout)["codes"]
                if time.monotonic() - t > 10:
                    failures.append("a put took more than 10 s")
                if any(c not in (0, -3016, -3013) for c in codes):
                    failures.append(f"unexpected put codes {codes}")
                with lock:
                    written.extend(k for k, c in zip(keys, codes, strict=False) if c == 0)

        def read(r: StoreProcess) -> None:
            n = 0
            while not stop.is_set():
                with lock:
                    pool = list(written)
                if len(pool) < 16:
                    time.sleep(0.01)
                    continue
                n += 1
                keys = pool[-8:] + pool[(n * 7) % len(pool)::max(1, len(pool) // 8)][:8]
                got = r("get", keys=keys, layout=layout)
                if got["mismatches"]:
                    failures.append(f"mismatched bytes for {got['mismatches']}")
                for c in got["codes"]:
                    if c == 0:
                        reads["hits"] += 1
                    elif c in (-3007, -3101, -3110):   # gone; or, on a loaded machine, a read that
                        reads["misses"] += 1           # outlived its 500 ms lease: a miss, never bytes
                    else:
                        failures.append(f"unexpected get code {c}")

        try:
            rt = [threading.Thread(target=read, args=(r,)) for r in readers]
            wt = [threading.Thread(target=write, args=(w, i)) for i, w in enumerate(writers)]
            for t in rt + wt:
                t.start()
            for t in wt:
                t.join(timeout=240)
            stop.set()
            for t in rt:
                t.join(timeout=60)
            assert failures == []
            summary = ms.http("/metrics/summary")
            assert summary["evictions"] > 0
            assert reads["hits"] > 100 and reads["misses"] > 0
            # leased objects may hold a segment above its high-water mark for a moment; once the
            # leases end, the periodic check brings every segment down again
            wait_for(lambda: all(s["used_bytes"] <= 0.8 * s["capacity_bytes"]
                                 for s in ms.http("/api/v1/capacity/usage")["segments"]), 10,
                     "every segment back under its low-water mark")
            # the oldest keys are gone, and what survives is mostly recent. Eviction is LRU per segment,
            # not across the pool (a put that finds its writer's segment full goes to another segment
            # with room before anything is evicted, so the segments that took the latest overflow are
            # trimmed too), and the readers' gets refresh old keys: which of the last keys survive
            # depends on the machine's load (8 to 22 of the last 32 in quiet runs, none in one loaded
            # run). Asserted: the survivors are the newer keys, by their median position.
            alive = readers[0]("exist", keys=written)["codes"]
            survivors = [i for i, c in enumerate(alive) if c == 1]
            assert survivors, "eviction left nothing in a pool trimmed to its low-water mark"
            assert statistics.median(survivors) > len(written) / 2, (len(written), survivors)
            assert readers[0]("exist", keys=["w0-0-0", "w1-0-0"])["codes"] == [0, 0]
        finally:
            for proc in writers + readers:
                proc.stop()
