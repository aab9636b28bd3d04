#!/usr/bin/env python3
"""Drain throughput against memcpy of the same bytes, measured in the same run.

A MetaService, two standalone providers (``memcache local-service``, the drain's targets) and, in
this process, a source LocalService. Each round the source fills its segment with ``--objects``
objects of ``--size`` bytes (placed in its own segment), then closes with ``drain_timeout_ms``: its
drain copies every object to the providers and commits it there. The drain's time is the
MetaService's (its first ``DrainNext`` to the answer that ends it: planning, copies, commits); the
reference is a single-thread ``ctypes.memmove`` of the same objects between two warm private
buffers, timed right after. After every round a pure client reads every object back from its new
place and compares it byte for byte; a mismatch, a miss or a dropped object aborts the run.

    python benchmarks/bench_drain.py                      # 5 rounds of 64 x 4 MiB, host_shm
    python benchmarks/bench_drain.py --protocol host_tcp  # through the providers' data servers
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from memcache_core import DistributedObjectStore, ReplicateConfig
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for

MIB = 1 << 20


def start_provider(meta: MetaServiceProcess, directory: str, i: int, protocol: str, size: int,
                   **extra: object) -> subprocess.Popen:
    """``extra``: more LocalConfig keys."""
    path = os.path.join(directory, f"provider-{i}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
                   "protocol": protocol, "dram_size": size, "hcom_url": "tcp://127.0.0.1:0",
                   "log_level": "warning", **extra}, f)
    return subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "local-service", "--config_path", path])


def fill(store: DistributedObjectStore, data: np.ndarray, keys: list[str], size: int) -> None:
    own = ReplicateConfig(preferredLocalServiceIDs=[store.get_local_service_id()])
    base = data.ctypes.data
    codes = store.batch_put_from(keys, [base + i * size for i in range(len(keys))], [size] * len(keys),
                                 replicateConfig=own)
    if codes != [0] * len(keys):
        raise SystemExit(f"fill failed: {sorted(set(codes))}")


def verify(client: DistributedObjectStore, data: np.ndarray, keys: list[str], size: int) -> None:
    out = np.zeros_like(data)
    assert client.register_buffer(out.ctypes.data, out.nbytes) == 0
    codes = client.batch_get_into(keys, [out.ctypes.data + i * size for i in range(len(keys))], [size] * len(keys))
    client.unregister_buffer(out.ctypes.data, out.nbytes)
    if codes != [0] * len(keys) or not np.array_equal(out, data):
        raise SystemExit(f"verification failed: codes {sorted(set(codes))}, equal {np.array_equal(out, data)}")


def memcpy_seconds(src: np.ndarray, dst: np.ndarray, n: int, size: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        ctypes.memmove(dst.ctypes.data + i * size, src.ctypes.data + i * size, size)
    return time.perf_counter() - t


def one_round(meta: MetaServiceProcess, args: argparse.Namespace, data: np.ndarray, client: DistributedObjectStore,
              r: int) -> float:
    keys = [f"drain-bench-{r}-{i}" for i in range(args.objects)]
    src = DistributedObjectStore()
    cfg = meta.local_config(protocol=args.protocol, dram_size=int(args.objects * (args.size + 4096) * 1.25),
                            drain_timeout_ms=60000, client_timeout_seconds=30)
    assert src.setup(cfg) == 0 and src.init(0, True) == 0
    sid = src.get_local_service_id()
    assert src.register_buffer(data.ctypes.data, data.nbytes) == 0
    data[::4096] = r                       # a fresh stamp per round: stale bytes would not compare equal
    fill(src, data, keys, args.size)
    src.close()                            # drains, then leaves
    state = meta.http(f"/drain/{sid}")
    if (state["moved_objects"], state["dropped_objects"]) != (args.objects, 0):
        raise SystemExit(f"drain did not move everything: {state}")
    verify(client, data, keys, args.size)
    client.remove_batch(keys)             # the space comes back when the verification's leases end
    wait_for(lambda: meta.http("/api/v1/capacity/usage")["used_bytes"] == 0, 30, "the targets to empty")
    return float(state["elapsed_s"])


def arguments(doc: str | None) -> argparse.Namespace:
    """The options bench_drain and bench_repair share."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", default="host_shm", choices=["host_shm", "host_tcp"])
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--size", type=int, default=4 * MIB, help="bytes per object")
    ap.add_argument("--rounds", type=int, default=5)
    return ap.parse_args()


def buffers(total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The objects' bytes (random), and two private buffers for the memcpy reference."""
    data = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    return data, data.copy(), np.zeros_like(data)


def main() -> int:
    args = arguments(__doc__)
    total = args.objects * args.size
    data, scratch_src, scratch_dst = buffers(total)
    with running_meta_service(lease_ttl_ms=500) as meta, tempfile.TemporaryDirectory() as d:
        provs = [start_provider(meta, d, i, args.protocol, int(total * 1.5)) for i in range(2)]
        try:
            wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 2, 30, "two providers")
            client = DistributedObjectStore()
            assert client.setup(meta.local_config(protocol=args.protocol)) == 0 and client.init(0, False) == 0
            drains, copies = [], []
            for r in range(args.rounds):
                drains.append(one_round(meta, args, data, client, r))
                copies.append(memcpy_seconds(scratch_src, scratch_dst, args.objects, args.size))
            client.close()
        finally:
            for prov in provs:
                prov.terminate()
                prov.wait(30)
    report("drain", args, drains, copies)
    return 0


def report(what: str, args: argparse.Namespace, times: list[float], copies: list[float]) -> None:
    """Each round's time beside its memcpy, then the medians as throughput and their ratio."""
    total = args.objects * args.size
    print(f"rounds ({what} ms / memcpy ms): "
          + "  ".join(f"{a * 1000:.0f}/{b * 1000:.1f}" for a, b in zip(times, copies, strict=True)))
    t_s, m_s = statistics.median(times), statistics.median(copies)
    print(f"{what} {args.protocol} {args.objects} x {args.size / MIB:g} MiB ({total / 1e9:.3f} GB), "
          f"median of {args.rounds}: {total / t_s / 1e9:.2f} GB/s ({t_s * 1000:.1f} ms)  "
          f"memcpy {total / m_s / 1e9:.2f} GB/s ({m_s * 1000:.1f} ms)  x{m_s / t_s:.2f}")


if __name__ == "__main__":
    sys.exit(main())
