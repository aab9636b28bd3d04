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

With ``--disk``, the run compares instead, side by side in the same rounds, removes from two other
members: one without a disk tier and one with a ``write_through`` disk tier, whose owner also deletes
each removed object's disk record before it acknowledges. For each batch size of ``--batches`` it
times ``remove`` (one key) or ``remove_batch`` of that many keys held by each (the disk member's keys wait until their
records are written, so that every remove deletes a record) and prints the medians' ratio.

Every call must answer 0 for every key, or the run fails. The wait is bounded by the owner's
heartbeat: about half an interval on average (it clears the headers on the heartbeat after the
remove and acknowledges them at once on another), at most one interval plus two round trips
without a disk tier (with one, large batches were seen to take two intervals: benchmarks/README.md).
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
import tempfile
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20, help="removes of each kind per round")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="the owner's heartbeat_interval_ms")
    ap.add_argument("--disk", action="store_true",
                    help="compare removes from a member with a write_through disk tier and one without")
    ap.add_argument("--batches", default="1,16,256", help="with --disk: the batch sizes, comma-separated")
    args = ap.parse_args(argv)
    from memcache_core.testing import running_meta_service

    with running_meta_service(log_level="warning") as ms:
        if args.disk:
            with tempfile.TemporaryDirectory(prefix="bench-remove-disk-") as disk:
                lat = with_disk(ms, args, [int(b) for b in args.batches.split(",")], disk)
        else:
            lat = without_disk(ms, args)
    print(f"owner heartbeat_interval_ms {args.heartbeat_ms}")
    for name, secs in lat.items():
        secs.sort()
        print(f"{name:30} p50 {statistics.median(secs) * 1e3:8.2f} ms   p99 "
              f"{secs[int(len(secs) * 0.99)] * 1e3:8.2f} ms   max {secs[-1] * 1e3:8.2f} ms   (n={len(secs)})")
    for name, secs in lat.items():
        if name.endswith(" with disk"):
            plain = lat[name.replace(" with disk", " without disk")]
            print(f"{name.replace(' with disk', ''):30} p50 with disk / without: "
                  f"{statistics.median(secs) / statistics.median(plain):.2f}")
    return 0


def stores(ms: Any, configs: list[Any]) -> list[Any]:
    from memcache_core import DistributedObjectStore
    made = []
    for cfg in configs:
        s = DistributedObjectStore()
        made.append(s)
        if s.setup(cfg) != 0 or s.init(0) != 0:
            for m in made:
                m.close()
            raise SystemExit("LocalService did not start")
    return made


def timed_remove(store: Any, keys: list[str], heartbeat_ms: int) -> float:
    """Seconds ``remove``/``remove_batch`` of ``keys`` took, after a random part of a heartbeat."""
    time.sleep(random.uniform(0, heartbeat_ms / 1000.0))
    t = time.perf_counter()
    codes = [store.remove(keys[0])] if len(keys) == 1 else store.remove_batch(keys)
    took = time.perf_counter() - t
    if codes != [0] * len(keys):
        raise SystemExit(f"remove of {keys[0]}...: {codes[:5]}")
    return took


def without_disk(ms: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    from memcache_core import ReplicateConfig
    from memcache_core import protocol as p
    from memcache_core.rpc import expect

    kinds = [("raw Remove rpc", 1, False), ("remove other", 1, False), ("remove_batch(100) other", 100, False),
             ("remove own", 1, True)]
    lat: dict[str, list[float]] = {name: [] for name, *_ in kinds}
    store, owner = stores(ms, [ms.local_config(dram_size="64MB", log_level="warning",
                                               heartbeat_interval_ms=args.heartbeat_ms)] * 2)
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
                    if name != "raw Remove rpc":
                        lat[name].append(timed_remove(store, keys, args.heartbeat_ms))
                        continue
                    time.sleep(random.uniform(0, args.heartbeat_ms / 1000.0))
                    t = time.perf_counter()
                    codes = expect(rpc.call(p.Remove(keys)), p.Codes).codes
                    lat[name].append(time.perf_counter() - t)
                    if codes != [0] * batch:
                        raise SystemExit(f"{name}: {codes[:5]}")
    finally:
        store.close()
        owner.close()
    return lat


def with_disk(ms: Any, args: argparse.Namespace, batches: list[int], disk: str) -> dict[str, list[float]]:
    """Removes of batches held by a member without a disk tier and by one with a write_through
    disk tier, alternated call by call so that both see the same load."""
    from memcache_core import ReplicateConfig

    common = {"dram_size": "64MB", "log_level": "warning", "heartbeat_interval_ms": args.heartbeat_ms}
    remover, plain, tiered = stores(ms, [
        ms.local_config(**common), ms.local_config(**common),
        ms.local_config(**common, disk_path=disk, disk_size="256MB", disk_write_policy="write_through")])
    lat: dict[str, list[float]] = {}
    payload = os.urandom(4096)
    seq = 0
    try:
        for _ in range(args.rounds):
            for batch in batches:
                for _ in range(args.n):
                    for tier, owner in (("without disk", plain), ("with disk", tiered)):
                        keys = [f"bench-remove/{seq}/{i}" for i in range(batch)]
                        seq += 1
                        where = ReplicateConfig(1, [owner.get_local_service_id()])
                        if remover.put_batch(keys, [payload] * batch, where) != 0:
                            raise SystemExit(f"put of {keys[0]} failed")
                        if owner is tiered:
                            on_disk(remover, keys)
                        lat.setdefault(f"{batch:3} key{'s' if batch > 1 else ''} {tier}", []).append(
                            timed_remove(remover, keys, args.heartbeat_ms))
    finally:
        for s in (remover, plain, tiered):
            s.close()
    return lat


def on_disk(store: Any, keys: list[str], timeout_s: float = 30.0) -> None:
    """Wait until every key's object has its disk record (the write_through copy is made in the
    background)."""
    deadline = time.monotonic() + timeout_s
    while not all("DISK" in i.type_list() for i in store.batch_get_key_info(keys)):
        if time.monotonic() > deadline:
            raise SystemExit(f"no disk record of {keys[0]}... within {timeout_s} s")
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
