#!/usr/bin/env python3
"""What an acknowledged remove costs: ``remove`` waits until the owner of each removed object has
cleared its header (docs/design.md, "Failure of the MetaService"), so that no MetaService crash
after it returns can bring the object back.

A MetaService process and two LocalServices in this process (64 MB segments) with the given
``heartbeat_interval_ms``: the remover, and another member that owns the objects of the ``other``
figures. In rounds, it puts fresh 4 KiB objects and times:

* ``raw Remove rpc``: the control-plane ``Remove`` alone (what ``remove`` cost before it waited:
  the objects leave the table, the owner hears of it on its next heartbeat);
* ``remove other``: the store's call of one key held by the other member, which also waits for
  that owner's confirmation; ``remove_batch(100) other``: one hundred keys, one wait;
* ``remove own``: one key in the remover's own segment (it heartbeats at once to confirm).

Every call must answer 0 for every key, or the run fails. The wait is bounded by the owner's
heartbeat: about half an interval on average (it clears the headers on the heartbeat after the
remove and acknowledges them at once on another), at most one interval plus two round trips.
Before each call the run waits a random part of the interval, so that removes fall at any phase of
the owner's heartbeat, as an application's do (a loop of back-to-back removes would lock onto the
heartbeat and always wait a whole interval).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20, help="removes of each kind per round")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="the owner's heartbeat_interval_ms")
    args = ap.parse_args(argv)
    from memcache_core import DistributedObjectStore, ReplicateConfig
    from memcache_core import protocol as p
    from memcache_core.rpc import expect
    from memcache_core.testing import running_meta_service

    kinds = [("raw Remove rpc", 1, False), ("remove other", 1, False), ("remove_batch(100) other", 100, False),
             ("remove own", 1, True)]
    lat: dict[str, list[float]] = {name: [] for name, *_ in kinds}
    with running_meta_service(log_level="warning") as ms:
        store, owner = DistributedObjectStore(), DistributedObjectStore()
        cfg = ms.local_config(dram_size="64MB", log_level="warning", heartbeat_interval_ms=args.heartbeat_ms)
        for s in (store, owner):
            if s.setup(cfg) != 0 or s.init(0) != 0:
                raise SystemExit("LocalService did not start")
        rpc = store._service().rpc
        payload = os.urandom(4096)
        seq = 0
        try:
            for _ in range(args.rounds):
                for name, batch, own in kinds:
                    where = ReplicateConfig(1, [(store if own else owner).get_local_service_id()])
                    for _ in range(args.n):
                        keys = [f"bench-remove/{seq}/{i}" for i in range(batch)]
                        seq += 1
                        if store.put_batch(keys, [payload] * batch, where) != 0:
                            raise SystemExit(f"put of {keys[0]} failed")
                        time.sleep(random.uniform(0, args.heartbeat_ms / 1000.0))
                        t = time.perf_counter()
                        if name == "raw Remove rpc":
                            codes = expect(rpc.call(p.Remove(keys)), p.Codes).codes
                        elif batch == 1:
                            codes = [store.remove(keys[0])]
                        else:
                            codes = store.remove_batch(keys)
                        lat[name].append(time.perf_counter() - t)
                        if codes != [0] * batch:
                            raise SystemExit(f"{name}: {codes[:5]}")
        finally:
            store.close()
            owner.close()
    print(f"owner heartbeat_interval_ms {args.heartbeat_ms}")
    for name, secs in lat.items():
        secs.sort()
        print(f"{name:24} p50 {statistics.median(secs) * 1e3:8.2f} ms   p99 "
              f"{secs[int(len(secs) * 0.99)] * 1e3:8.2f} ms   max {secs[-1] * 1e3:8.2f} ms   (n={len(secs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
