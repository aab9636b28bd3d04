#!/usr/bin/env python3
"""Reading objects held on a disk tier: straight from disk, or promoted into DRAM first.

    python benchmarks/bench_disk_promotion.py --disk DIR [--objects 24] [--size-mib 2] [--reps 5]

One LocalService with a DRAM segment and a disk tier in DIR (``write_through``), in this process,
as an SGLang server holding its own pages is. Each repetition puts ``--objects`` objects, and for
each way of reading them evicts all of them to disk (the tier call ``evict``, waiting for their
records) and times reading them back into registered memory with one ``batch_get_into_layers``:

* ``disk``: read straight from the disk tier;
* ``prefetch, then read``: ``prefetch`` (promotion into DRAM), then the read from DRAM;
* ``read beside prefetch``: ``prefetch`` started on another thread just before the read, which
  then races the promotion of its own objects: what the SGLang backend's ``disk_prefetch`` does
  when the read follows ``batch_exists`` at once (the thread lives across repetitions, as the
  backend's does: a new thread would open its own MetaService connection and time that too);
* ``promoted, read waits``: the same, but the read first waits for the promotion;
* ``DRAM``: the objects read again, from DRAM (the floor).

Every read is checked byte for byte. Prints the median time and GB/s of each, and the raw
sequential read speed of DIR (one file as large as the objects, direct I/O where it is taken).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_ttft import raw_read_seconds  # noqa: E402

from memcache_core.local.store import open_store  # noqa: E402
from memcache_core.testing import running_meta_service  # noqa: E402

MODES = ("disk", "prefetch, then read", "read beside prefetch", "promoted, read waits")


def evict_all(store: object, keys: list[str]) -> None:
    deadline = time.monotonic() + 120
    while any(c != 0 for c in store.evict(keys)):  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("objects never reached the disk tier")
        time.sleep(0.05)


def timed_read(store: object, mode: str, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
               helper: ThreadPoolExecutor) -> float:
    t0 = time.perf_counter()
    promotion: Future | None = None
    if mode == "prefetch, then read":
        store.prefetch(keys)  # type: ignore[attr-defined]
    elif mode in ("read beside prefetch", "promoted, read waits"):
        promotion = helper.submit(store.prefetch, keys)  # type: ignore[attr-defined]
        if mode == "promoted, read waits":
            promotion.result()
    codes = store.batch_get_into_layers(keys, ptrs, sizes)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - t0
    if promotion is not None:
        promotion.result()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{mode}: read failed with codes {sorted(set(codes))}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--disk", required=True, metavar="DIR", help="directory of the disk tier (a real disk)")
    ap.add_argument("--objects", type=int, default=24)
    ap.add_argument("--size-mib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    size, n = args.size_mib << 20, args.objects
    buf = np.zeros(n * size, dtype=np.uint8)
    ptrs = [[buf.ctypes.data + i * size] for i in range(n)]
    sizes = [[size]] * n
    times: dict[str, list[float]] = {m: [] for m in (*MODES, "DRAM")}
    with running_meta_service() as meta:
        cfg = meta.local_config(dram_size=max(1 << 30, 4 * n * size * args.reps), disk_path=str(Path(args.disk) / "tier"),
                                disk_size=4 * n * size * args.reps, disk_write_policy="write_through")
        store = open_store(cfg, 0, True)
        helper = ThreadPoolExecutor(max_workers=1)
        try:
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
            for rep in range(args.reps):
                keys = [f"bench-promotion-{rep}-{i}" for i in range(n)]
                buf[:] = rep + 1
                if any(c != 0 for c in store.batch_put_from_layers(keys, ptrs, sizes)):
                    raise RuntimeError("put failed")
                for mode in MODES:
                    evict_all(store, keys)
                    buf[:] = 0
                    times[mode].append(timed_read(store, mode, keys, ptrs, sizes, helper))
                    if not (buf == rep + 1).all():
                        raise RuntimeError(f"{mode}: the bytes read differ from those written")
                times["DRAM"].append(timed_read(store, "DRAM", keys, ptrs, sizes, helper))
        finally:
            helper.shutdown()
            store.close()
    total = n * size
    print(f"{n} objects of {args.size_mib} MiB, {args.reps} repetitions, disk tier in {args.disk}")
    for mode, values in times.items():
        med = statistics.median(values)
        print(f"{mode:22s} median {med * 1e3:8.1f} ms  {total / med / 1e9:6.2f} GB/s   "
              f"({', '.join(f'{v * 1e3:.0f}' for v in values)} ms)")
    secs = raw_read_seconds(Path(args.disk), total)
    print(f"reference: one {total >> 20} MiB file read sequentially in {args.disk}: {secs * 1e3:.1f} ms "
          f"({total / secs / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
