#!/usr/bin/env python3
"""Fuzz a real MetaService process over authenticated sockets; print its peak RSS and whether it survived.

Many connections (``--connections``) pass the pool handshake and then send random frames: random
bytes, valid requests with extreme integers, long strings and long lists, and valid frames with
bytes flipped, truncated or duplicated. A peer that gets disconnected (bad framing) reconnects. Some
connections never read their replies. Meanwhile an honest member joins, allocates, commits and looks
its keys up; every answer it gets must be right (a key the fuzzers removed may be a miss, never a
wrong size or generation). The MetaService's RSS is sampled from ``/proc``.

    python benchmarks/fuzz_meta.py --minutes 10

Exit status 0 when the MetaService survived, stayed healthy and the honest member saw no wrong answer.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import threading
import time

import msgspec

from memcache_core import protocol as p
from memcache_core.auth import NO_SESSION, Session, client_handshake, load_secret
from memcache_core.rpc import RpcClient, expect, seal_frame
from memcache_core.testing import running_meta_service

EXTREME_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]


def rss_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process in KiB, from /proc/<pid>/status."""
    cur = peak = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1])
    return cur, peak


def rand_int(rng: random.Random) -> int:
    return rng.choice(EXTREME_INTS) if rng.random() < 0.6 else rng.randint(-(2**64), 2**64)


def rand_str(rng: random.Random) -> str:
    n = rng.choice([0, 1, 8, 255, 256, 257, 4096, 70_000])
    return "".join(chr(rng.randint(1, 0x2FF)) for _ in range(min(n, 512))) * max(1, n // 512)


def rand_value(rng: random.Random, depth: int = 0) -> object:
    k = rng.randrange(7 if depth < 2 else 4)
    if k == 0:
        return rand_int(rng)
    if k == 1:
        return rand_str(rng)
    if k == 2:
        return rng.randbytes(rng.choice([0, 16, 1000]))
    if k == 3:
        return None
    if k == 4:
        return [rand_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3, 50]))]
    if k == 5:
        return {rand_str(rng)[:8]: rand_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.random() * 1e300


def rand_request(rng: random.Random) -> bytes:
    """A request-shaped msgpack map: a real tag with random field values (often invalid)."""
    tag = rng.choice(["Join", "Leave", "Heartbeat", "Alloc", "Commit", "Abort", "Lookup", "Exist",
                      "Validate", "Remove", "RemoveAll", "RemovePrefix", "Corrupt", "GetSegments",
                      "ConfigPut", "ConfigGet", "Nope"])
    fields = ["client_id", "token", "keys", "sizes", "generations", "checksums", "replicas", "preferred",
              "segment", "objects", "host_id", "pid", "key", "value", "prefix", "lease", "segment_ids",
              "journal_ack"]
    msg: dict[str, object] = {"type": tag}
    for f in rng.sample(fields, rng.randrange(len(fields))):
        if f in ("keys", "sizes", "generations", "checksums", "preferred", "segment_ids"):
            n = rng.choice([0, 1, 2, 100, 5000])
            msg[f] = [rand_int(rng) if f != "keys" else rand_str(rng)[:300] for _ in range(n)]
        elif f == "segment":
            msg[f] = {"segment_id": rand_int(rng), "size": rand_int(rng), "host_id": rand_str(rng),
                      "shm_path": rng.choice(["/etc/passwd", "/dev/shm/memcache-1-ab", rand_str(rng)]),
                      "data_addr": rng.choice(["0.0.0.0:1", "127.0.0.1:99999", "x"])}
        elif f == "objects":
            msg[f] = [[rand_str(rng)[:20], rand_int(rng), rand_int(rng), rand_int(rng), rand_int(rng)]
                      for _ in range(rng.choice([0, 1, 100]))]
        else:
            msg[f] = rand_value(rng)
    try:
        return msgspec.msgpack.encode(msg)
    except (OverflowError, TypeError):
        return msgspec.msgpack.encode({"type": tag})


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            b[rng.randrange(len(b) + 1):0] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and b:
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 64)]
    return bytes(b)


class Fuzzer(threading.Thread):
    def __init__(self, addr: tuple[str, int], secret: bytes, seed: int, stop: threading.Event,
                 reads_replies: bool) -> None:
        super().__init__(daemon=True)
        self.addr, self.secret, self.rng, self.stop = addr, secret, random.Random(seed), stop
        self.reads = reads_replies
        self.frames = self.reconnects = self.errors = 0
        self.session: Session = NO_SESSION

    def _connect(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=5)
        self.session = client_handshake(s, self.secret)
        s.settimeout(0.01)
        self.reconnects += 1
        return s

    def run(self) -> None:
        rng = self.rng
        s: socket.socket | None = None
        while not self.stop.is_set():
            try:
                if s is None:
                    s = self._connect()
                k = rng.random()
                if k < 0.15:
                    frame = rng.randbytes(rng.randint(0, 64))          # raw bytes: framing itself
                else:
                    body = rand_request(rng) if k < 0.6 else mutate(rng, rand_request(rng))
                    frame = seal_frame(rng.getrandbits(64), body, self.session)
                s.sendall(frame)
                self.frames += 1
                if self.reads:
                    try:
                        while s.recv(1 << 16):
                            pass
                    except TimeoutError:
                        pass
            except (OSError, ConnectionError):
                self.errors += 1
                if s is not None:
                    s.close()
                s = None
                time.sleep(0.01)
        if s is not None:
            s.close()


class Honest(threading.Thread):
    """A member doing the put/get cycle through the normal client; checks every answer."""

    def __init__(self, url: str, secret: bytes, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.secret, self.stop = url, secret, stop
        self.ops = self.wrong = self.failed = 0
        self.last_error = ""

    def run(self) -> None:
        c = RpcClient(self.url, 10.0, 0, self.secret)
        seg = p.SegmentInfo(0, 64 << 20, "fuzz-host", f"/dev/shm/memcache-{os.getpid()}-f00d", "127.0.0.1:9")
        joined: p.Joined | None = None
        i = 0
        while not self.stop.is_set():
            try:
                if joined is None:
                    joined = expect(c.call(p.Join(0, "fuzz-host", os.getpid(), seg), probe=True), p.Joined)
                i += 1
                key = f"honest-{i}"
                size = 4096 + i % 1000
                a = expect(c.call(p.Alloc(joined.client_id, joined.token, [key], [size])), p.AllocReply)
                r = a.results[0]
                if r.code != 0:
                    self.failed += 1
                    joined = None if r.code == -3017 else joined
                    continue
                codes = expect(c.call(p.Commit(joined.client_id, joined.token, [key], [r.generation])), p.Codes)
                f = expect(c.call(p.Lookup([key]), idempotent=True), p.LookupReply).results[0]
                if codes.codes[0] == 0 and f is not None and (f.size != size or f.generation != r.generation):
                    self.wrong += 1
                    self.last_error = f"{key}: size {f.size} gen {f.generation}, wanted {size} {r.generation}"
                if i % 50 == 0:
                    c.call(p.Remove([f"honest-{j}" for j in range(i - 50, i)]))
                self.ops += 1
            except Exception as e:  # noqa: BLE001 - counted and reported; re-join on a NotAMember
                self.failed += 1
                self.last_error = f"{type(e).__name__}: {e}"
                joined = None
                time.sleep(0.05)
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--connections", type=int, default=16, help="fuzzing connections (a quarter never read)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    print(f"seed {seed}, {args.connections} connections, {args.minutes:g} minutes", flush=True)
    with running_meta_service(heartbeat_timeout_ms=60000) as ms:
        secret = load_secret(ms.config.get("auth_secret_path", ""))
        host, port = ms.meta_service_url.removeprefix("tcp://").rsplit(":", 1)
        chost, cport = ms.config_store_url.removeprefix("tcp://").rsplit(":", 1)
        stop = threading.Event()
        fuzzers = [Fuzzer((host, int(port)) if i % 2 else (chost, int(cport)), secret, seed + i, stop,
                          reads_replies=i % 4 != 3) for i in range(args.connections)]
        honest = Honest(ms.meta_service_url, secret, stop)
        for t in [*fuzzers, honest]:
            t.start()
        assert ms.pid is not None
        start_rss = rss_kib(ms.pid)[0]
        end = time.monotonic() + args.minutes * 60
        survived, peak, cur = True, 0, 0
        next_report = time.monotonic() + 30
        while time.monotonic() < end:
            time.sleep(1)
            if ms.proc is None or ms.proc.poll() is not None:
                survived = False
                break
            cur, peak = rss_kib(ms.pid)
            if time.monotonic() >= next_report:
                next_report += 30
                print(f"  t={args.minutes * 60 - (end - time.monotonic()):5.0f}s rss {cur / 1024:.1f} MiB "
                      f"peak {peak / 1024:.1f} MiB frames {sum(f.frames for f in fuzzers)} "
                      f"honest ops {honest.ops}", flush=True)
        stop.set()
        for t in [*fuzzers, honest]:
            t.join(10)
        settled = 0
        if survived:   # what stays once every fuzzing connection is gone: leaked, not merely buffered
            time.sleep(3)
            settled = rss_kib(ms.pid)[0]
        healthy = survived and ms.healthy()
        frames = sum(f.frames for f in fuzzers)
        reconnects = sum(f.reconnects for f in fuzzers)
        print(f"MetaService survived: {survived}, healthy at the end: {healthy}")
        print(f"RSS at start {start_rss / 1024:.1f} MiB, at the end {cur / 1024:.1f} MiB, "
              f"peak {peak / 1024:.1f} MiB, 3 s after the fuzzers disconnected {settled / 1024:.1f} MiB")
        print(f"fuzz frames {frames}, connections made {reconnects}")
        print(f"honest member: {honest.ops} put/lookup cycles, {honest.wrong} wrong answers, "
              f"{honest.failed} failed calls{'; last: ' + honest.last_error if honest.last_error else ''}")
        if not survived:
            print(ms.log_tail())
        return 0 if healthy and honest.wrong == 0 and honest.ops > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
