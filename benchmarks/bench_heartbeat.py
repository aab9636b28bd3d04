#!/usr/bin/env python3
"""Where a heartbeat's MetaService CPU goes: the serving path of one heartbeat, in this process.

A ``MetaServiceCore`` behind a real ``FrameServer`` (auth on: every frame's MAC checked and sealed)
and ``--members`` members (256) joined over real loopback connections, each with a segment, as
``bench_meta_load.py``'s members are. Then one member at a time sends a ``Heartbeat``, and one
``FrameServer.poll`` serves it (epoll, recv, the MAC, decode, dispatch, the member's record, the
reply, its MAC, send); the serving thread's CPU time of that poll is the heartbeat's cost:

* ``hot``: heartbeats back to back (caches warm: the floor);
* ``cold``: each after a ``--gap-ms`` sleep, as on the wire, where 256 members a second leave the
  MetaService ~4 ms between heartbeats (other processes take the caches in between);
* ``answer``: the part of each spent in ``meta.server.answer`` (decode, handle, metrics, encode);
  the rest is the frame server and the kernel (recv, send, epoll);
* ``Python calls``: function calls per heartbeat, counted by cProfile over the hot rounds
  (``--profile`` prints the functions).

Every reply is checked (the member known). Thread CPU time, so the figures do not count other
processes; on a crowded host the cold figure rises (benchmarks/README.md, ``bench_meta_load.py``).

    python benchmarks/bench_heartbeat.py
    python benchmarks/bench_heartbeat.py --profile --rounds 5000
    python benchmarks/bench_heartbeat.py --frame-loop python   # (or native; auto: native where built)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

from memcache_core import protocol as p
from memcache_core.auth import Session, client_handshake
from memcache_core.config import MetaConfig
from memcache_core.meta import server as meta_server
from memcache_core.meta.service import MetaServiceCore
from memcache_core.rpc import FrameServer, seal_frame, take_frame

SECRET = os.urandom(32)


class Member:
    """One joined member on its own authenticated connection (blocking)."""

    def __init__(self, addr: tuple[str, int], i: int) -> None:
        self.sock = socket.create_connection(addr, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.session: Session = client_handshake(self.sock, SECRET)
        self.inbuf = bytearray()
        self.rid = 0
        seg = p.SegmentInfo(0, 1 << 30, f"bench-{i}", f"/memcache-{os.getpid()}-{os.urandom(8).hex()}",
                            "127.0.0.1:9")
        self.send(p.Join(0, f"bench-{i}", os.getpid(), seg))
        joined = self.reply()
        if not isinstance(joined, p.Joined):
            raise SystemExit(f"join failed: {joined!r}")
        self.beat = p.request_encoder.encode(p.Heartbeat(joined.client_id, joined.token))

    def send(self, req: p.Request | bytes) -> None:
        self.rid += 1
        body = req if isinstance(req, bytes) else p.request_encoder.encode(req)
        self.sock.sendall(seal_frame(self.rid, body, self.session))

    def reply(self) -> p.Reply:
        while (frame := take_frame(self.inbuf, self.session)) is None:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise SystemExit("the server closed a connection")
            self.inbuf += chunk
        return p.reply_decoder.decode(frame[1])


def serve_rounds(fs: FrameServer, members: list[Member], rounds: int, gap_s: float,
                 prof: cProfile.Profile | None = None) -> list[float]:
    """The serving thread's CPU seconds for each heartbeat, one member after another."""
    spent = []
    for k in range(rounds):
        m = members[k % len(members)]
        m.send(m.beat)
        if gap_s:
            time.sleep(gap_s)   # the gap between two members' heartbeats on the wire: nothing to wait for
        t0 = time.thread_time()
        if prof is not None:
            prof.enable()
        while not fs.poll(1.0):
            pass
        if prof is not None:
            prof.disable()
        spent.append(time.thread_time() - t0)
        r = m.reply()
        if not isinstance(r, p.HeartbeatReply) or not r.known:
            raise SystemExit(f"heartbeat not known: {r!r}")
    return spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2000, help="heartbeats served back to back (hot)")
    ap.add_argument("--cold-rounds", type=int, default=500, help="heartbeats served each after a gap")
    ap.add_argument("--gap-ms", type=float, default=4.0, help="the gap before each cold heartbeat")
    ap.add_argument("--frame-loop", choices=("auto", "native", "python"), default="auto",
                    help="the FrameServer's frame loop (docs/configuration.md, frame_loop)")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions of the hot rounds")
    args = ap.parse_args(argv)
    core = MetaServiceCore(MetaConfig())
    in_answer = [0.0]

    def timed_answer(body: bytes) -> bytes:
        t0 = time.thread_time()
        try:
            return meta_server.answer(core, body)
        finally:
            in_answer[0] += time.thread_time() - t0

    handler: Callable[[bytes], bytes] = timed_answer
    fs = FrameServer([("127.0.0.1", 0)], handler, secret=SECRET, frame_loop=args.frame_loop)
    stop = threading.Event()

    def joining() -> None:   # the members' handshakes and joins need the server polled meanwhile
        while not stop.is_set():
            fs.poll(0.02)
    t = threading.Thread(target=joining, daemon=True)
    t.start()
    try:
        members = [Member(fs.listeners[0].getsockname(), i) for i in range(args.members)]
    finally:
        stop.set()
        t.join()
    try:
        serve_rounds(fs, members, min(args.rounds, 500), 0.0)   # warm-up
        rows = []
        for name, rounds, gap in (("hot", args.rounds, 0.0), ("cold", args.cold_rounds, args.gap_ms / 1e3)):
            in_answer[0] = 0.0
            spent = serve_rounds(fs, members, rounds, gap)
            rows.append((name, statistics.median(spent) * 1e6, sum(spent) / rounds * 1e6, in_answer[0] / rounds * 1e6))
        prof = cProfile.Profile()
        serve_rounds(fs, members, args.rounds, 0.0, prof)
        st = pstats.Stats(prof)
        calls = st.total_calls / args.rounds   # type: ignore[attr-defined]
        print(f"{'heartbeat':>9} {'median us':>10} {'mean us':>8} {'answer us':>10}")
        for name, med, mean, ans in rows:
            print(f"{name:>9} {med:>10.1f} {mean:>8.1f} {ans:>10.1f}")
        print(f"Python calls per heartbeat (cProfile, hot): {calls:.1f}; {args.members} members; "
              f"frame loop: {'native' if fs.native else 'python'}")
        if args.profile:
            st.sort_stats("tottime").print_stats(40)
    finally:
        for m in members:
            m.sock.close()
        fs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
