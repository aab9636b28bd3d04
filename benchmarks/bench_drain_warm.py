#!/usr/bin/env python3
"""The share of a leaving engine's hot objects its drain keeps on a warm pool, with the drain's time
beside memcpy of the same bytes, measured in the same run.

Each round: a fresh MetaService and two standalone providers (``memcache local-service``) of
``--provider-mb`` MiB, filled by a pure client to ``--warm`` of their size with objects of ``--size``
bytes (the high-water mark is 90%: a warm pool sits at 80-90%); then, in this process, an engine
(a LocalService with a segment of its own) puts ``--objects`` objects into its segment and reads
them back (the hottest objects of the pool), and closes with ``drain_timeout_ms``. Its drain moves
what it can; the share kept is the engine's objects a pure client then reads back, byte-exact (a
mismatch aborts the run). Also counted: the providers' colder objects pushed out to make room.
The reference is a single-thread ``ctypes.memmove`` of the engine's objects between two warm
private buffers, timed right after.

    python benchmarks/bench_drain_warm.py                 # 3 rounds: 2 x 64 MiB providers at 82%, 48 x 1 MiB
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import numpy as np
from bench_drain import MIB, memcpy_seconds, start_provider

from memcache_core import DistributedObjectStore, ReplicateConfig
from memcache_core.layout import footprint
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for


def store(meta: MetaServiceProcess, init_bm: bool, **cfg: object) -> DistributedObjectStore:
    s = DistributedObjectStore()
    assert s.setup(meta.local_config(client_timeout_seconds=30, **cfg)) == 0
    assert s.init(0, init_bm) == 0
    return s


def put_all(s: DistributedObjectStore, data: np.ndarray, keys: list[str], size: int, where: int) -> None:
    codes = s.batch_put_from(keys, [data.ctypes.data + i * size for i in range(len(keys))], [size] * len(keys),
                             replicateConfig=ReplicateConfig(preferredLocalServiceIDs=[where]))
    if codes != [0] * len(keys):
        raise SystemExit(f"put failed: {sorted(set(codes))}")


def read_back(s: DistributedObjectStore, data: np.ndarray, keys: list[str], size: int) -> int:
    """How many of ``keys`` read back byte-exact (a miss counts as not kept; wrong bytes abort)."""
    out = np.zeros_like(data)
    assert s.register_buffer(out.ctypes.data, out.nbytes) == 0
    codes = s.batch_get_into(keys, [out.ctypes.data + i * size for i in range(len(keys))], [size] * len(keys))
    s.unregister_buffer(out.ctypes.data, out.nbytes)
    for i, c in enumerate(codes):
        if c == 0 and not np.array_equal(out[i * size:(i + 1) * size], data[i * size:(i + 1) * size]):
            raise SystemExit(f"{keys[i]}: wrong bytes after the drain")
        if c not in (0, -3007):
            raise SystemExit(f"{keys[i]}: code {c} (expected a hit or a miss)")
    return codes.count(0)


def one_round(args: argparse.Namespace, hot: np.ndarray, cold: np.ndarray, d: str, r: int) -> dict[str, float]:
    per_provider = int(args.provider_mb * MIB * args.warm) // footprint(args.size)
    with running_meta_service() as meta:
        provs = [start_provider(meta, d, 2 * r + i, "host_shm", args.provider_mb * MIB) for i in range(2)]
        try:
            wait_for(lambda: len(meta.http("/get_all_segments")["segments"]) == 2, 30, "two providers")
            ids = [s["segment_id"] for s in meta.http("/get_all_segments")["segments"]]
            client = store(meta, False)
            assert client.register_buffer(cold.ctypes.data, cold.nbytes) == 0
            cold_keys = {sid: [f"cold-{sid}-{i}" for i in range(per_provider)] for sid in ids}
            for sid, keys in cold_keys.items():
                put_all(client, cold, keys, args.size, sid)
            engine = store(meta, True, dram_size=args.objects * (args.size + 4096) * 2, drain_timeout_ms=60000)
            assert engine.register_buffer(hot.ctypes.data, hot.nbytes) == 0
            keys = [f"hot-{r}-{i}" for i in range(args.objects)]
            put_all(engine, hot, keys, args.size, engine.get_local_service_id())
            if read_back(engine, hot, keys, args.size) != args.objects:   # read: the hottest of the pool
                raise SystemExit("the engine could not read its own objects")
            eid = engine.get_local_service_id()
            engine.close()                                     # drains, then leaves
            state = meta.http(f"/drain/{eid}")
            kept = read_back(client, hot, keys, args.size)
            left = sum(client.batch_is_exist(k).count(1) for k in cold_keys.values())
            client.close()
        finally:
            for prov in provs:
                prov.terminate()
                prov.wait(30)
    return {"kept": kept / args.objects, "pushed_out": 2 * per_provider - left, "cold": 2 * per_provider,
            "drain_s": float(state["elapsed_s"]), "moved": state["moved_objects"],
            "memcpy_s": memcpy_seconds(hot, np.zeros_like(hot), args.objects, args.size)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=48, help="the engine's hot objects")
    ap.add_argument("--size", type=int, default=MIB, help="bytes per object")
    ap.add_argument("--provider-mb", type=int, default=64)
    ap.add_argument("--warm", type=float, default=0.82, help="how full the providers are before (of their size)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(7)
    hot = rng.integers(0, 256, args.objects * args.size, dtype=np.uint8)
    cold = rng.integers(0, 256, int(args.provider_mb * MIB * args.warm) + args.size, dtype=np.uint8)
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            rounds.append(one_round(args, hot, cold, d, r))
    for x in rounds:
        print(f"kept {x['kept']:.0%} of {args.objects} hot objects ({x['moved']} moved), "
              f"{x['pushed_out']} of {x['cold']} colder objects pushed out; "
              f"drain {x['drain_s'] * 1000:.0f} ms, memcpy {x['memcpy_s'] * 1000:.1f} ms")
    print(f"median of {args.rounds}: kept {statistics.median(x['kept'] for x in rounds):.0%} of the leaving "
          f"engine's hot objects (2 providers of {args.provider_mb} MiB at {args.warm:.0%}, "
          f"{args.objects} x {args.size / MIB:g} MiB); drain {statistics.median(x['drain_s'] for x in rounds) * 1000:.0f} ms, "
          f"memcpy {statistics.median(x['memcpy_s'] for x in rounds) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
