"""A real MemCache pool on this machine: one MetaService, three LocalService processes.

Rank 0 writes KV blocks shaped like DeepSeek-R1's (122 pieces, 8,784 KiB each); rank 1 reads them
through shared memory and rank 2 through TCP, byte-exact; then rank 0 is killed with SIGKILL (its
blocks turn into misses, the rest of the pool carries on) and the MetaService is restarted (the
survivors re-join and the table comes back whole); last, rank 0 starts again on the same disk path
and its blocks, kept by its disk tier, are read byte-exact again.

    python examples/demo_pool.py [--blocks 16]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Literal

import numpy as np

LAYOUT = [128 << 10] * 61 + [16 << 10] * 61      # 61 layers x (K 128 KiB + V 16 KiB)
BLOCK = sum(LAYOUT)


def block_bytes(key: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def rank_main(rank: int, protocol: Literal["host_shm", "host_tcp"], meta_url: str, disk: str, conn) -> None:  # runs in a child process
    import logging
    logging.basicConfig(level=logging.WARNING, format=f"  [rank {rank} log] %(message)s")
    from memcache_core import DistributedObjectStore, LocalConfig
    store = DistributedObjectStore()
    cfg = LocalConfig(meta_service_url=meta_url, protocol=protocol, dram_size="256MB",
                      heartbeat_interval_ms=200, client_timeout_seconds=5,
                      disk_path=disk, disk_size="1GB" if disk else "0", disk_write_policy="write_through")
    assert store.setup(cfg) == 0 and store.init(rank, True) == 0
    buf = np.zeros(BLOCK * 16, np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    conn.send(("ready", store.get_local_service_id()))
    while True:
        op, keys = conn.recv()
        ptrs = [[buf.ctypes.data + i * BLOCK + sum(LAYOUT[:j]) for j in range(len(LAYOUT))]
                for i in range(len(keys))]
        sizes = [LAYOUT] * len(keys)
        if op == "put":
            for i, k in enumerate(keys):
                buf[i * BLOCK:(i + 1) * BLOCK] = block_bytes(k)
            t = time.perf_counter()
            codes = store.batch_put_from_layers(keys, ptrs, sizes)
            conn.send((codes, time.perf_counter() - t, 0))
        elif op == "get":
            buf[: len(keys) * BLOCK] = 0
            t = time.perf_counter()
            codes = store.batch_get_into_layers(keys, ptrs, sizes)
            dt = time.perf_counter() - t
            bad = sum(1 for i, (k, c) in enumerate(zip(keys, codes, strict=True)) if c == 0
                      and not np.array_equal(buf[i * BLOCK:(i + 1) * BLOCK], block_bytes(k)))
            conn.send((codes, dt, bad))
        elif op == "exist":
            conn.send((store.batch_is_exist(keys), 0, 0))
        else:
            store.close()
            conn.send(("closed", 0, 0))
            return


class Rank:
    def __init__(self, ctx, rank: int, protocol: str, meta_url: str, disk: str = "") -> None:
        self.rank, self.protocol = rank, protocol
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(rank, protocol, meta_url, disk, child), daemon=True)
        self.proc.start()
        _, self.id = self.conn.recv()

    def __call__(self, op: str, keys: list[str]):
        self.conn.send((op, keys))
        return self.conn.recv()


def wait_on_disk(ms, keys: list[str]) -> None:
    """Until every key has a disk copy (the provider writes them in the background)."""
    deadline = time.monotonic() + 60
    def answer() -> list[dict]:
        got = ms.http("/batch_query_keys?keys=" + ",".join(keys))
        return got.get("keys", [got])     # one key: the answer is that key's record itself

    while not all(k.get("disk") is not None for k in answer()):
        assert time.monotonic() < deadline, "the disk tier did not take the blocks within 60 s"
        time.sleep(0.1)


def memcache_command() -> str:
    """The ``memcache`` command of the environment running this demo: its full path, for it may not be
    on PATH (the demo runs from a virtual environment that is not activated)."""
    beside = os.path.join(os.path.dirname(sys.executable), "memcache")
    return beside if os.path.exists(beside) else shutil.which("memcache") or f"{sys.executable} -m memcache_core.cli"


def where_the_command_is() -> str:
    cmd = memcache_command()
    activate = os.path.join(os.path.dirname(sys.executable), "activate")
    return (f"the memcache command: {cmd}"
            + (f"\n  (or put it on PATH: source {activate})" if os.path.exists(activate) else ""))


def hold(ms, seconds: float) -> None:
    cmd = memcache_command()
    print(f"\nstatus page: {ms.metrics_url}/status (user: any, password: the admin token below)\n"
          f"  admin token: {cmd} token\n"
          f"  in the terminal: {cmd} status --url {ms.metrics_url} --watch\n"
          f"holding the pool for {seconds:g} s (Ctrl-C ends it)")
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16, help="KV blocks per rank (at most 16)")
    ap.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                    help="keep the pool up this long at the end (Ctrl-C ends it): open the status page")
    args = ap.parse_args()
    n = max(1, min(args.blocks, 16))
    from memcache_core.testing import running_meta_service
    ctx = mp.get_context("spawn")
    with running_meta_service(heartbeat_timeout_ms=1500) as ms, tempfile.TemporaryDirectory() as disk:
        print(f"MetaService pid {ms.pid}: control {ms.meta_service_url}, admin {ms.metrics_url}")
        ranks = [Rank(ctx, 0, "host_shm", ms.meta_service_url, disk), Rank(ctx, 1, "host_shm", ms.meta_service_url),
                 Rank(ctx, 2, "host_tcp", ms.meta_service_url)]
        for r in ranks:
            print(f"  rank {r.rank}: LocalService {r.id} ({r.protocol}), 256 MB in the pool, pid {r.proc.pid}"
                  + (", a 1 GB disk tier (write_through)" if r.rank == 0 else ""))
        usage = ms.http("/api/v1/capacity/usage")
        print(f"pool: {len(usage['segments'])} segments, {usage['total_bytes'] >> 20} MB")

        mine = [f"req-A/block-{i}" for i in range(n)]
        theirs = [f"req-B/block-{i}" for i in range(n)]
        mb = n * BLOCK / 1e6
        codes, dt, _ = ranks[0]("put", mine)
        print(f"\nrank 0 put {n} blocks of 122 pieces ({mb:.0f} MB) in {dt * 1e3:.1f} ms: {mb / 1e3 / dt:.2f} GB/s, "
              f"codes {set(codes)}")
        codes, dt, _ = ranks[1]("put", theirs)
        print(f"rank 1 put {n} blocks in {dt * 1e3:.1f} ms, codes {set(codes)}")
        for r in ranks[1:]:
            codes, dt, bad = r("get", mine)
            print(f"rank {r.rank} read rank 0's blocks over {r.protocol}: {dt * 1e3:.1f} ms, "
                  f"{mb / 1e3 / dt:.2f} GB/s, {codes.count(0)}/{n} hits, {bad} mismatched")
            assert codes == [0] * n and bad == 0

        wait_on_disk(ms, mine)
        print(f"rank 0's blocks are on its disk tier too ({n} records, header and checksum each)")

        print("\nkill -9 rank 0 (its segment, holding its blocks, dies with it)")
        os.kill(ranks[0].proc.pid, signal.SIGKILL)
        t = time.monotonic()
        while ranks[1]("exist", mine[:1])[0] != [0]:
            time.sleep(0.1)
        print(f"  after {time.monotonic() - t:.1f}s the MetaService declared it dead: its keys are misses")
        gone, _, bad0 = ranks[2]("get", mine)
        codes, _, bad = ranks[2]("get", theirs)
        print(f"  rank 2 reads: rank 0's blocks {gone.count(-3007)}/{n} misses (-3007), "
              f"rank 1's blocks {codes.count(0)}/{n} hits, {bad0 + bad} mismatched")
        assert codes == [0] * n and bad0 == bad == 0

        print("\nrank 0 starts again on the same disk path")
        ranks[0] = Rank(ctx, 0, "host_shm", ms.meta_service_url, disk)
        codes, _, bad = ranks[2]("get", mine)
        print(f"  it found its records and reported them: rank 2 reads rank 0's blocks {codes.count(0)}/{n} hits "
              f"(from disk), {bad} mismatched")
        assert codes == [0] * n and bad == 0

        print("\nrestart the MetaService (it keeps no state on disk)")
        time.sleep(0.5)
        ms.kill()
        ms.start()
        t = time.monotonic()
        # each rank re-joins on its own: the keys come back with their holders' re-joins, and a rank reads
        # again once its own re-join has answered (until then its calls fail fast: the MetaService was down)
        while not (set(mine + theirs) <= set(ms.http("/get_all_keys")["keys"])
                   and len(ms.http("/api/v1/capacity/usage")["segments"]) == len(ranks)):
            time.sleep(0.1)
        print(f"  {len(ms.http('/get_all_keys')['keys'])} keys back in {time.monotonic() - t:.1f}s, "
              "reported by the LocalServices that hold them (rank 1's segment, rank 0's disk tier), "
              f"{len(ranks)} ranks re-joined")
        codes, _, bad = ranks[2]("get", theirs)
        codes0, _, bad0 = ranks[2]("get", mine)
        print(f"  rank 2 reads rank 1's blocks again: {codes.count(0)}/{n} hits, rank 0's {codes0.count(0)}/{n}, "
              f"{bad + bad0} mismatched")
        assert codes == codes0 == [0] * n and bad == bad0 == 0
        if args.hold > 0:
            hold(ms, args.hold)
        for r in ranks:
            r("close", [])
        print("\ndemo finished: every byte read was the byte written.")
    print(where_the_command_is())


if __name__ == "__main__":
    main()
