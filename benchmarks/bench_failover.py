#!/usr/bin/env python3
"""Failover time of the HA MetaService: ``kill -9`` of the leader -> the first successful put.

    "$(bash .ci/core_env.sh | tail -1)/bin/python" benchmarks/bench_failover.py [--rounds 5] [--ttl 2]

Starts a throwaway etcd and three MetaServices (``ha_enable``, lease TTL ``--ttl`` seconds) and one
LocalService in this process that follows the leader (``--url etcd``: ``etcd://.../<cluster>``, or
``--url list``: the three URLs tried in turn) and puts a 64 KiB object every millisecond or so.
Each round kills the leader with SIGKILL and times until a put succeeds again (checked byte-exact
by a get) and until an object put before the kill is read again (byte-exact), then restarts the
killed MetaService as a standby. Prints each round and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memcache_core import DistributedObjectStore, LocalConfig  # noqa: E402
from memcache_core.testing import MetaServiceProcess, wait_for  # noqa: E402
from memcache_core.testing_etcd import EtcdProcess  # noqa: E402


def leader(metas: list[MetaServiceProcess]) -> MetaServiceProcess | None:
    for m in metas:
        try:
            if m.proc is not None and m.http("/leader")["role"] == "leader":
                return m
        except OSError:
            pass
    return None


def one_round(store: DistributedObjectStore, metas: list[MetaServiceProcess], n: int) -> tuple[float, float]:
    """(kill -> first successful put, kill -> first hit on an object put before the kill), seconds."""
    lead = leader(metas)
    assert lead is not None
    payload = os.urandom(64 << 10)
    assert store.put(f"before-{n}", payload) == 0
    t0 = time.monotonic()
    lead.kill()
    put_s = get_s = 0.0
    i = 0
    while not (put_s and get_s):
        if not get_s and store.get(f"before-{n}") == payload:
            get_s = time.monotonic() - t0
        if not put_s and store.put(f"after-{n}-{i}", payload) == 0:
            put_s = time.monotonic() - t0
            assert store.get(f"after-{n}-{i}") == payload, "wrong bytes after failover"
        i += 1
        if time.monotonic() - t0 > 60:
            raise RuntimeError("no successful put and get within 60 s of the kill")
        time.sleep(0.001)
    lead.start()   # back as a standby for the next round
    wait_for(lambda: leader(metas) is not None, 30, "a leader")
    return put_s, get_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttl", type=int, default=2, help="leader lease TTL in seconds")
    ap.add_argument("--url", choices=("etcd", "list"), default="etcd")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="memcache-failover-") as d:
        etcd = EtcdProcess(d).start()
        metas = [MetaServiceProcess(d, ha_enable=True, ha_etcd_endpoints=etcd.endpoint, ha_cluster_id="bench",
                                    ha_lease_ttl_ms=args.ttl * 1000, lease_ttl_ms=2000) for _ in range(3)]
        store = DistributedObjectStore()
        try:
            for m in metas:
                m.start()
            wait_for(lambda: leader(metas) is not None, 30, "a leader")
            url = (f"etcd://127.0.0.1:{etcd.port}/bench" if args.url == "etcd"
                   else ",".join(m.meta_service_url for m in metas))
            cfg = LocalConfig(meta_service_url=url, protocol="host_shm", dram_size="256MB",
                              client_timeout_seconds=2, heartbeat_interval_ms=200)
            assert store.setup(cfg) == 0 and store.init(0, True) == 0
            puts, gets = [], []
            for n in range(args.rounds):
                put_s, get_s = one_round(store, metas, n)
                puts.append(put_s)
                gets.append(get_s)
                print(f"round {n}: kill -9 of the leader -> first successful put {put_s:.2f} s, "
                      f"first hit on an older object {get_s:.2f} s", flush=True)
            print(f"failover (lease TTL {args.ttl} s, read lease 2 s, client {args.url}, heartbeat 200 ms), median "
                  f"of {len(puts)} rounds: kill -> first successful put {statistics.median(puts):.2f} s "
                  f"(min {min(puts):.2f}, max {max(puts):.2f}); kill -> first hit {statistics.median(gets):.2f} s")
        finally:
            store.close()
            for m in metas:
                m.stop()
            etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
