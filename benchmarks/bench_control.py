#!/usr/bin/env python3
"""Control-plane latency: ``is_exist`` and ``batch_is_exist(1000)`` beside what bounds them.

A MetaService process (auth on, the pool's default) and a LocalService in this process (a 64 MB
segment, like ``bench_store.py``'s reader) holding 1,000 4 KiB objects with ``bench_store.py``'s
keys. In rounds, so that the machine's load moves every figure alike, it times:

* ``harness``: the timing loop itself around a call that does nothing;
* ``socket echo``: one 40-byte round trip between this process and a Python echo process over
  loopback TCP (blocking sockets, no framing, no auth): the floor of any Python RPC here;
* ``noop rpc``: ``ConfigGet`` of a missing key through the control plane (framing, auth'd
  connection, decode, dispatch, encode; no table work);
* ``is_exist``, ``batch_is_exist(1000)``: the store's calls, as ``bench_store.py`` times them;
* ``put 4KiB``, ``put_batch(64 x 4KiB)``: puts of new keys from a LocalService holding a 256 MB
  segment, two-phase (``small_put_max_bytes`` 0: ``Alloc``, copy, ``Commit``) and through its
  allocation arena (the default: copy, one ``ArenaCommit``), alternately in each round; the
  MetaService's request counters give the round trips each batch took.

Every ``is_exist`` must answer 1, every batch all ones and every put 0, or the run fails. ``--profile`` prints
where the client's time goes (cProfile over the is_exist calls); ``--parts`` times the
MetaService's own steps for one Exist in-process (decode, handle, outcome counting, encode).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import hashlib
import hmac
import itertools
import os
import pstats
import re
import socket
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable

KEYS = [f"memcache/host_shm/small/{i}" for i in range(1000)]
ECHO = ("import socket,sys\n"
        "s=socket.socket();s.bind(('127.0.0.1',0));s.listen(1);print(s.getsockname()[1],flush=True)\n"
        "c,_=s.accept();c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
        "while (d:=c.recv(65536)):\n c.sendall(d)\n")


def timed(fn: Callable[[], object], n: int, check: Callable[[object], bool]) -> list[int]:
    lat = []
    for _ in range(n):
        t = time.perf_counter_ns()
        r = fn()
        lat.append(time.perf_counter_ns() - t)
        if not check(r):
            raise SystemExit(f"wrong answer: {r!r}")
    return lat


PUT_OPS = ("alloc", "commit", "arena_commit", "abort")


def round_trips(metrics: str) -> float:
    """Put-related requests the MetaService answered so far (from its ``/metrics``)."""
    return sum(float(m.group(1)) for op in PUT_OPS
               for m in [re.search(rf'^memcache_request_seconds_count\{{op="{op}"\}} (\S+)$', metrics, re.M)] if m)


def echo_client() -> tuple[subprocess.Popen[str], socket.socket]:
    proc = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return proc, s


def parts() -> None:
    """The MetaService's steps for one Exist of one key, in-process, best of 5."""
    from memcache_core import protocol as p
    from memcache_core.auth import Session
    from memcache_core.config import MetaConfig
    from memcache_core.meta import server, service, stats
    from memcache_core.meta.objects import new_obj
    from memcache_core.rpc import FRAME_HEAD, take_frame
    core = service.MetaServiceCore(MetaConfig())
    sender, receiver = (Session(b"k" * 32, b"s" * 32, b"c" * 32, client) for client in (True, False))
    for k in KEYS:
        core.table.objects[k] = new_obj(k, 4096, 1, [p.Location(1, 0)])
    for n_keys in (1, 1000):
        body = p.request_encoder.encode(p.Exist(KEYS[:n_keys]))
        req = p.request_decoder.decode(body)
        reply = core.handle(req)
        frame = FRAME_HEAD.pack(len(body), 7) + body
        tag = sender.seal(frame)
        steps: list[tuple[str, Callable[[], object]]] = [
            ("take_frame", lambda: take_frame(bytearray(frame))),   # noqa: B023
            ("seal: the frame's MAC (blake2b)", lambda: sender.seal(frame)),   # noqa: B023
            ("check: the frame's MAC (blake2b)", lambda: receiver.check(tag, frame)),   # noqa: B023
            ("HMAC-SHA256 of the frame (not used)",
             lambda: hmac.new(b"k" * 32, frame, hashlib.sha256).digest()),   # noqa: B023
            ("decode request", lambda: p.request_decoder.decode(body)),   # noqa: B023
            ("handle", lambda: core.handle(req)),   # noqa: B023
            ("count outcomes", lambda: stats.count_outcomes(core.outcomes, req, reply)),   # noqa: B023
            ("encode reply", lambda: p.request_encoder.encode(reply)),   # noqa: B023
            ("decode reply (client)", lambda: p.reply_decoder.decode(p.request_encoder.encode(reply))),  # noqa: B023
            ("_answer: all of the handler", lambda: server.answer(core, body)),   # noqa: B023
        ]
        n = 20000 if n_keys == 1 else 200
        for name, fn in steps:
            best = min(timeit.repeat(fn, number=n, repeat=5)) / n
            print(f"Exist({n_keys:4}) {name:30} {best * 1e6:8.2f} us", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000, help="calls per round of each single-key figure")
    ap.add_argument("--batch-n", type=int, default=100, help="batch_is_exist(1000) calls per round")
    ap.add_argument("--profile", action="store_true", help="cProfile the client's is_exist calls")
    ap.add_argument("--parts", action="store_true", help="time the MetaService's steps in-process and exit")
    args = ap.parse_args(argv)
    if args.parts:
        parts()
        return 0
    from memcache_core import DistributedObjectStore
    from memcache_core import protocol as p
    from memcache_core.testing import running_meta_service
    with running_meta_service(log_level="warning") as ms:
        store = DistributedObjectStore()
        if store.setup(ms.local_config(dram_size="64MB", log_level="warning")) != 0 or store.init(0) != 0:
            raise SystemExit("LocalService did not start")
        writers = {}
        for name, limit in (("two-phase", 0), ("arena", 64 << 10)):
            w = DistributedObjectStore()
            if w.setup(ms.local_config(dram_size="256MB", log_level="warning", small_put_max_bytes=limit)) != 0 \
                    or w.init(0) != 0:
                raise SystemExit("LocalService did not start")
            writers[name] = w
        value, fresh = os.urandom(4096), itertools.count()
        batch_trips: dict[str, list[float]] = {name: [] for name in writers}

        def put_one(w: DistributedObjectStore) -> int:
            return w.put(f"put/{next(fresh)}", value)

        def put_batch(name: str) -> int:
            before = round_trips(ms.http("/metrics"))
            keys = [f"batch/{next(fresh)}" for _ in range(64)]
            t = time.perf_counter_ns()
            codes = writers[name].put_batch(keys, [value] * 64)
            batch_ns.append(time.perf_counter_ns() - t)
            batch_trips[name].append(round_trips(ms.http("/metrics")) - before)
            return codes
        batch_ns: list[int] = []
        proc, echo = echo_client()
        try:
            for k in KEYS:
                if store.put(k, os.urandom(4096)) != 0:
                    raise SystemExit(f"put {k} failed")
            rpc = store._service().rpc
            msg = b"x" * 40

            def echo_once() -> bytes:
                echo.sendall(msg)
                return echo.recv(64)
            ops: list[tuple[str, Callable[[], object], Callable[[object], bool], int]] = [
                ("harness", lambda: None, lambda r: True, args.n),
                ("socket echo", echo_once, lambda r: r == msg, args.n),
                ("noop rpc", lambda: rpc.call(p.ConfigGet("absent")), lambda r: isinstance(r, p.Value), args.n),
                ("is_exist", lambda: store.is_exist(KEYS[7]), lambda r: r == 1, args.n),
                ("batch_is_exist(1000)", lambda: store.batch_is_exist(KEYS), lambda r: r == [1] * 1000, args.batch_n),
            ]
            for name, w in writers.items():
                ops.append((f"put 4KiB, {name}", functools.partial(put_one, w), lambda r: r == 0, args.n))
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                timed(ops[3][1], args.n * args.rounds, ops[3][2])
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
                return 0
            lat: dict[str, list[int]] = {name: [] for name, *_ in ops}
            for _ in range(args.rounds):
                for name, fn, check, n in ops:
                    lat[name] += timed(fn, n, check)
                for name in writers:   # timed here (the counters are read outside the timing)
                    for _ in range(args.batch_n):
                        if (code := put_batch(name)) != 0:
                            raise SystemExit(f"put_batch ({name}) failed with {code}")
                    lat.setdefault(f"put_batch(64 x 4KiB), {name}", []).extend(batch_ns)
                    batch_ns.clear()
        finally:
            echo.close()
            proc.wait(10)
            store.close()
            for w in writers.values():
                w.close()
    for name, ns in lat.items():
        ns.sort()
        print(f"{name:22} p50 {statistics.median(ns) / 1e3:8.2f} us   p99 {ns[int(len(ns) * 0.99)] / 1e3:8.2f} us"
              f"   (n={len(ns)})")
    for name, trips in batch_trips.items():
        print(f"put_batch(64 x 4KiB), {name}: {statistics.mean(trips):.2f} round trips per batch (mean), "
              f"{max(trips):.0f} at most, {trips[0]:.0f} for the first batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
