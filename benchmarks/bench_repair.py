#!/usr/bin/env python3
"""Re-replication throughput against memcpy of the same bytes, measured in the same run.

A MetaService and, each round, three standalone providers (``memcache local-service``). A pure
client puts ``--objects`` objects of ``--size`` bytes with replicaNum 2 on providers A and B, then A
is killed with SIGKILL. The repair's time runs from the moment the MetaService declares A dead (every
object counted under-replicated) to the moment none is (B learnt of the copies on its next
heartbeat, copied each to C and the MetaService added the copies), polled every 5 ms on the admin
port; the reference is a single-thread
``ctypes.memmove`` of the same objects between two warm private buffers, timed right after. B is
then killed too and the client reads every object back from C, the copies the repair made, and
compares them byte for byte; a mismatch or a miss aborts the run.

    python benchmarks/bench_repair.py                      # 5 rounds of 64 x 4 MiB, host_shm
    python benchmarks/bench_repair.py --protocol host_tcp  # through C's data server
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
from bench_drain import arguments, buffers, memcpy_seconds, report, start_provider, verify

from memcache_core import DistributedObjectStore, ReplicateConfig
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for

HEARTBEAT_TIMEOUT_MS = 1500      # a dead provider is noticed quickly (its heartbeats: every 300 ms)


def segment_ids(meta: MetaServiceProcess) -> set[int]:
    return {s["segment_id"] for s in meta.http("/get_all_segments")["segments"]}


def joined(meta: MetaServiceProcess, before: set[int]) -> int:
    """The segment id of the one provider that joins after ``before`` (waited for)."""
    wait_for(lambda: len(segment_ids(meta) - before) == 1, 30, "a provider to join")
    return (segment_ids(meta) - before).pop()


def one_round(meta: MetaServiceProcess, args: argparse.Namespace, data: np.ndarray, d: str, r: int) -> float:
    keys = [f"repair-bench-{r}-{i}" for i in range(args.objects)]
    total = args.objects * args.size
    procs, ids = [], []
    try:
        for i in range(3):
            before = segment_ids(meta)
            procs.append(start_provider(meta, d, 3 * r + i, args.protocol, int(total * 1.5),
                                        heartbeat_interval_ms=HEARTBEAT_TIMEOUT_MS // 5))
            ids.append(joined(meta, before))
        client = DistributedObjectStore()
        assert client.setup(meta.local_config(protocol=args.protocol, client_timeout_seconds=30)) == 0
        assert client.init(0, False) == 0
        try:
            assert client.register_buffer(data.ctypes.data, data.nbytes) == 0
            data[::4096] = r                   # a fresh stamp per round: stale bytes would not compare equal
            two = ReplicateConfig(2, preferredLocalServiceIDs=ids[:2])
            codes = client.batch_put_from(keys, [data.ctypes.data + i * args.size for i in range(args.objects)],
                                          [args.size] * args.objects, replicateConfig=two)
            if codes != [0] * args.objects:
                raise SystemExit(f"put failed: {sorted(set(codes))}")
            repaired = meta.metric("repaired_objects_total")
            procs[0].kill()
            wait_for(lambda: ids[0] not in segment_ids(meta), 30, "A to be declared dead", interval_s=0.005)
            t0 = time.perf_counter()
            wait_for(lambda: meta.metric("objects_under_replicated") == 0, 120, "the repair", interval_s=0.005)
            seconds = time.perf_counter() - t0
            if meta.metric("repaired_objects_total") - repaired != args.objects:
                raise SystemExit("the repair did not copy every object exactly once")
            procs[1].kill()
            wait_for(lambda: ids[1] not in segment_ids(meta), 30, "B to be declared dead")
            verify(client, data, keys, args.size)
            client.remove_batch(keys)
        finally:
            client.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    wait_for(lambda: not segment_ids(meta) & set(ids), 30, "the round's providers to leave")
    return seconds


def main() -> int:
    args = arguments(__doc__)
    total = args.objects * args.size
    data, scratch_src, scratch_dst = buffers(total)
    with running_meta_service(lease_ttl_ms=500, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS) as meta, \
            tempfile.TemporaryDirectory() as d:
        repairs, copies = [], []
        for r in range(args.rounds):
            repairs.append(one_round(meta, args, data, d, r))
            copies.append(memcpy_seconds(scratch_src, scratch_dst, args.objects, args.size))
    report("repair", args, repairs, copies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
