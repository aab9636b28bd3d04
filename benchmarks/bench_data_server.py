"""The data server's CPU per 4 KiB read, in isolation: a ``DataServer`` in a process of its own (its
``data_server_loop`` native or python), one ``TcpClient`` in this process reading the same 4 KiB over
and over; the server process's CPU time (user + system, from /proc) per read, the client's, and the
round trip. The loops run alternately, ``--runs`` times each.

    python benchmarks/bench_data_server.py [--runs 4] [--reads 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

SECRET = b"bench-data-server-secret-0000000"
SID = 5


def serve(loop: str, addr: Any, stop: Any) -> None:
    from memcache_core.local.segment import create_segment
    from memcache_core.transfer.tcp_server import DataServer
    seg = create_segment(8 << 20)
    server = DataServer(seg, "127.0.0.1", 0, secret=SECRET, loop=loop)
    server.serve_segment(SID)
    addr.put(server.addr)
    stop.wait()
    server.close()
    seg.close()


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(loop: str, reads: int) -> tuple[float, float, float]:
    """(server CPU µs, client CPU µs, round trip µs) per read."""
    from memcache_core.transfer.tcp import TcpClient
    ctx = mp.get_context("spawn")
    addr_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(loop, addr_q, stop))
    proc.start()
    assert proc.pid is not None
    addr = addr_q.get(timeout=30)
    client = TcpClient(10.0, secret=SECRET)
    out = np.zeros(4096, np.uint8)
    ops = [(4096, [(out.ctypes.data, out.nbytes)])]
    try:
        for _ in range(500):   # warm-up
            client.read(addr, ops, segment_id=SID)
        time.sleep(0.1)        # the native loop's counts returned
        c0, t0, p0 = cpu_s(proc.pid), time.perf_counter(), time.process_time()
        for _ in range(reads):
            client.read(addr, ops, segment_id=SID)
        t1, p1 = time.perf_counter(), time.process_time()
        time.sleep(0.1)
        c1 = cpu_s(proc.pid)
    finally:
        client.close()
        stop.set()
        proc.join(30)
    return (c1 - c0) / reads * 1e6, (p1 - p0) / reads * 1e6, (t1 - t0) / reads * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="runs of each loop, alternating")
    ap.add_argument("--reads", type=int, default=20000, help="4 KiB reads per run")
    args = ap.parse_args()
    for _ in range(args.runs):
        for loop in ("native", "python"):
            server, client, trip = run(loop, args.reads)
            print(f"{loop:7s} server cpu {server:5.1f} us/read  client cpu {client:5.1f} us/read  "
                  f"round trip {trip:5.1f} us  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
