#!/usr/bin/env python3
"""Disk-tier throughput against the raw speed of the same disk, measured in the same run.

A MetaService and, in this process, a provider with a disk tier on ``--dir`` (``write_through``) and
a pure client. Each round:

* **raw**: the same number of bytes written to one file of ``--dir`` with ``O_DIRECT`` (4 MiB
  aligned writes, then ``fsync``) and read back with ``O_DIRECT``, by one thread, and read by
  ``--raw-threads`` threads at once (what a deeper queue, such as io_uring's, would give);
* **put to disk**: ``--objects`` objects of ``--size`` bytes are put (into DRAM), and the time is taken
  until the provider's disk writer has written every record (the tier's write throughput: copy out
  of the segment, checksum, direct write, rename);
* **get from disk**: every object is made disk-only (``evict``), then read back by the client
  (through the provider's data server, as another host would) and by the provider itself (its own
  records, no socket), each verified byte for byte against what was put;
* **eviction to disk**: ``on_evict`` with a DRAM segment a quarter of the data, puts as fast as they
  go, then paced at half the tier's measured write rate (``paced_``): the put rate (eviction and
  background copies included) and the share of objects the pool still holds afterwards (the rest
  were evicted before their copy: puts never wait for the disk), every one read back byte-exact.

    python benchmarks/bench_disk.py --dir /var/tmp/bench-disk        # 3 rounds of 128 x 4 MiB
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np

from memcache_core import DistributedObjectStore
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for

MIB = 1 << 20
CHUNK = 4 * MIB


def raw_speed(directory: str, total: int, threads: int) -> dict[str, float]:
    """MB/s of O_DIRECT sequential write (+fsync) and read of ``total`` bytes in one file."""
    path = os.path.join(directory, "raw-speed.bin")
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    flags = getattr(os, "O_DIRECT", 0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    t = time.perf_counter()
    for off in range(0, total, CHUNK):
        os.pwrite(fd, buf, off)
    os.fsync(fd)
    write_s = time.perf_counter() - t
    os.close(fd)
    out = {"raw_write_mbs": total / write_s / 1e6, "raw_read_mbs": _raw_read(path, total, 1) / 1e6,
           f"raw_read_{threads}t_mbs": _raw_read(path, total, threads) / 1e6}
    os.unlink(path)
    return out


def _raw_read(path: str, total: int, threads: int) -> float:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    offsets = list(range(0, total, CHUNK))

    def run(part: list[int]) -> None:
        b = mmap.mmap(-1, CHUNK)
        for off in part:
            os.preadv(fd, [b], off)

    t = time.perf_counter()
    ts = [threading.Thread(target=run, args=(offsets[i::threads],)) for i in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    dt = time.perf_counter() - t
    os.close(fd)
    return total / dt


def tier_round(ms: MetaServiceProcess, directory: str, n: int, size: int, rnd: int) -> dict[str, float]:
    disk = os.path.join(directory, f"tier-{rnd}")
    total = n * size
    prov = DistributedObjectStore()
    assert prov.setup(ms.local_config(dram_size=int(total * 1.3) + 64 * MIB, disk_path=disk,
                                      disk_size=total * 2, disk_write_policy="write_through")) == 0
    assert prov.init(0, True) == 0
    client = DistributedObjectStore()
    assert client.setup(ms.local_config(dram_size=0)) == 0 and client.init(0, False) == 0
    data = np.random.default_rng(rnd).integers(0, 256, total, dtype=np.uint8)
    out = np.zeros_like(data)
    for s in (prov, client):
        assert s.register_buffer(data.ctypes.data, data.nbytes) == 0
        assert s.register_buffer(out.ctypes.data, out.nbytes) == 0
    keys = [f"r{rnd}-{i}" for i in range(n)]
    ptrs = [data.ctypes.data + i * size for i in range(n)]
    svc = prov._svc   # the benchmark reads the tier's own counters
    tier = svc.disk if svc is not None else None
    assert tier is not None
    t = time.perf_counter()
    assert prov.batch_put_from(keys, ptrs, [size] * n) == [0] * n
    put_s = time.perf_counter() - t
    wait_for(lambda: tier.store.counters.writes >= n, 600, "every record written")
    to_disk_s = time.perf_counter() - t
    wait_for(lambda: client.evict(keys) == [0] * n, 60, "objects on disk only")
    res = {"put_dram_mbs": total / put_s / 1e6, "put_to_disk_mbs": total / to_disk_s / 1e6}
    for name, reader in (("get_disk_tcp_mbs", client), ("get_disk_local_mbs", prov)):
        out[:] = 0
        optrs = [out.ctypes.data + i * size for i in range(n)]
        t = time.perf_counter()
        codes = reader.batch_get_into(keys, optrs, [size] * n)
        dt = time.perf_counter() - t
        if codes != [0] * n or not np.array_equal(out, data):
            raise SystemExit(f"{name}: wrong bytes or misses: {sorted(set(codes))}")
        res[name] = total / dt / 1e6
        assert client.evict(keys) == [0] * n   # reads may have promoted some: disk only again
    client.close()
    prov.close()
    return res


def evict_round(ms: MetaServiceProcess, directory: str, n: int, size: int, rnd: int,
                rate: float = 0.0) -> dict[str, float]:
    """on_evict with a DRAM segment a quarter of the data: the puts run at full speed (or ``rate``
    bytes/s), eviction keeps what was copied; returns the put rate and the share of objects the pool
    still holds (all read back byte-exact)."""
    total = n * size
    prov = DistributedObjectStore()
    assert prov.setup(ms.local_config(dram_size=total // 4, disk_path=os.path.join(directory, f"evict-{rnd}"),
                                      disk_size=total * 2)) == 0
    assert prov.init(0, True) == 0
    data = np.random.default_rng(rnd + 100).integers(0, 256, total, dtype=np.uint8)
    out = np.zeros_like(data)
    for b in (data, out):
        assert prov.register_buffer(b.ctypes.data, b.nbytes) == 0
    keys = [f"e{rnd}-{i}" for i in range(n)]
    t = time.perf_counter()
    for i in range(0, n, 8):
        assert prov.batch_put_from(keys[i:i + 8], [data.ctypes.data + j * size for j in range(i, min(n, i + 8))],
                                   [size] * len(keys[i:i + 8])) == [0] * len(keys[i:i + 8])
        if rate:
            time.sleep(max(0.0, t + (i + 8) * size / rate - time.perf_counter()))
    put_s = time.perf_counter() - t
    svc = prov._svc
    assert svc is not None and svc.disk is not None
    store = svc.disk.store
    wait_for(lambda: store.queued_bytes == 0, 600, "the writer idle")
    codes = prov.batch_get_into(keys, [out.ctypes.data + i * size for i in range(n)], [size] * n)
    kept = [i for i, c in enumerate(codes) if c == 0]
    if any(c not in (0, -3007) for c in codes) or any(
            not np.array_equal(out[i * size:(i + 1) * size], data[i * size:(i + 1) * size]) for i in kept):
        raise SystemExit(f"on_evict: wrong bytes or errors: {sorted(set(codes))}")
    prov.close()
    return {"put_evict_mbs": total / put_s / 1e6, "kept_pct": 100.0 * len(kept) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="", help="directory on the disk to measure (default: a temporary one "
                                                "under /var/tmp)")
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--size", type=int, default=4 * MIB)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--raw-threads", type=int, default=4)
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="memcache-bench-disk-", dir="/var/tmp")
    os.makedirs(base, exist_ok=True)
    try:
        run(args, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


def run(args: argparse.Namespace, base: str) -> None:
    rows = []
    with running_meta_service(log_level="warning") as ms:
        for rnd in range(args.rounds):
            with tempfile.TemporaryDirectory(dir=base) as d:
                row = raw_speed(d, args.objects * args.size, args.raw_threads)
                row.update(tier_round(ms, d, args.objects, args.size, rnd))
                row.update(evict_round(ms, d, args.objects, args.size, rnd))
                paced = evict_round(ms, d, args.objects, args.size, rnd + 1000, row["put_to_disk_mbs"] * 1e6 / 2)
                row.update({"paced_put_evict_mbs": paced["put_evict_mbs"], "paced_kept_pct": paced["kept_pct"]})
            rows.append(row)
            print(json.dumps({k: round(v) for k, v in row.items()}), flush=True)
    summary = {k: round(statistics.median(r[k] for r in rows)) for k in rows[0]}
    print("median MB/s:", json.dumps(summary))


if __name__ == "__main__":
    main()
