#!/usr/bin/env python3
"""How much one MetaService process serves: a real MetaService under the load of a simulated fleet.

A MetaService process (auth on, the pool's default) and, in other processes, over the real
authenticated control plane:

* ``--members`` members (256) that join with a segment like LocalServices, put ``--objects``
  committed objects into their segments (two-phase: Alloc, then Commit), and heartbeat every
  ``--heartbeat-ms`` (each on its own connection, acknowledging the journal it is sent);
* ``--generators`` request generators, each joined as a member with a segment of its own (and
  heartbeating), each keeping ``--connections`` connections busy with the fleet's mix, pipelined
  (up to ``--window`` requests in flight per connection) so that the clients are not the bottleneck:

  | kind | request |
  |---|---|
  | ``exist`` | ``Exist`` of 16-512 keys (``batch_is_exist``): a prefix of stored keys, then absent ones |
  | ``probe`` | ``Exist`` of one stored key (``is_exist``) |
  | ``lookup`` | leased ``Lookup`` of 1-32 stored keys (a get's first step) |
  | ``put`` | ``Alloc`` of 1-8 new objects of 64 KiB-8 MiB, then, on its reply, their ``Commit`` |
  | ``remove`` | ``Remove`` of the oldest objects this generator put (the table keeps its size) |

Every answer is checked (an exist's count of found keys, a lookup's hits, every put, commit and
remove succeeding, every heartbeat known); one wrong answer fails the run.

Phases, each measured over ``--seconds``: ``idle`` (no client), ``heartbeats`` (the members only),
``exist`` (batched exist only, as fast as it is answered), ``probe`` (single-key exist only),
``probe sync`` (the same with one call in flight per connection, as a rank's synchronous ``is_exist``
sends it: no pipelining to amortise the server's system calls over), ``lookup`` and ``put+remove``
(each kind alone: the CPU cost of one call of each kind is the inverse of its requests per CPU-second),
``mix``
(the mix, as fast as it is answered: saturation), then the mix offered open-loop at each fraction of
the saturation rate in ``--levels`` (the latency-against-load curve; 0.5 always among them, its
``is_exist`` p50/p99 printed on a line of its own: issue 26 quotes it there). The MetaService's CPU time is
read from ``/proc/<pid>/stat`` at both ends of each phase, so throughput is quoted **per
MetaService CPU-second** and does not depend on how many cores the machine had free (each row also
carries the host's 1-minute load average: on a crowded host every figure is worse). Latencies are
from a request's send to its reply, in the generator.

    python benchmarks/bench_meta_load.py --json load.json --plot load.png
    python benchmarks/bench_meta_load.py --quick      # a few seconds: 16 members, short phases

Exit status 1 on a wrong answer or an error reply.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import random
import selectors
import socket
import statistics
import sys
import time
from typing import Any

from memcache_core import protocol as p
from memcache_core.auth import client_handshake, load_secret
from memcache_core.rpc import FRAME_HEAD, seal_frame, take_frame

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
KINDS = ("exist", "probe", "lookup", "put", "remove")
DEFAULT_MIX = "exist=8,probe=4,lookup=4,put=1,remove=1"
# the phases of one kind alone, as fast as they are answered: (mix, requests in flight per connection; 0: --window)
ALONE = {"exist": ("exist=1", 0), "probe": ("probe=1", 0),
         "probe sync": ("probe=1", 1),     # one call in flight per connection, as a rank's is_exist sends it
         "lookup": ("lookup=1", 0), "put+remove": ("put=1,remove=1", 0)}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def stored_key(i: int) -> str:
    """The ``i``-th stored key: 90 characters, like an engine's page key (model, hash, page)."""
    return f"llama-3.1-8b/{hashlib.sha256(b'%d' % i).hexdigest()}/{i:012d}"


def absent_key(i: int) -> str:
    return f"llama-3.1-8b/{hashlib.sha256(b'absent%d' % i).hexdigest()}/{i:012d}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


# ---- one connection, blocking (set-up) and pipelined (load) ---------------------------------------

class Conn:
    """An authenticated control-plane connection; requests in flight are answered in order."""

    def __init__(self, addr: tuple[str, int], secret: bytes | None) -> None:
        self.sock = socket.create_connection(addr, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.session = client_handshake(self.sock, secret)   # every frame carries its MAC
        self.inbuf = bytearray()
        self.out = bytearray()
        self.rid = 0
        self.answered = 0   # the id of the last reply: the MetaService answers a connection in order
        self.inflight: collections.deque[tuple[str, int, Any]] = collections.deque()
        self.cid = 0
        self.token = b""
        self.ack = 0

    def queue(self, kind: str, body: bytes, info: Any = None) -> None:
        self.rid += 1
        self.out += seal_frame(self.rid, body, self.session)
        self.inflight.append((kind, time.perf_counter_ns(), info))

    def flush(self) -> None:
        if self.out:
            try:
                n = self.sock.send(self.out)
            except BlockingIOError:
                return
            del self.out[:n]

    def replies(self) -> list[bytes]:
        """Reply bodies received now (non-blocking); raises when the MetaService closed the connection."""
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return []
        if not chunk:
            raise SystemExit("the MetaService closed a connection")
        self.inbuf += chunk
        bodies = []
        while (frame := take_frame(self.inbuf, self.session)) is not None:
            bodies.append(self._in_order(*frame))
        return bodies

    def _in_order(self, rid: int, body: bytes) -> bytes:
        self.answered += 1
        if rid != self.answered:
            raise SystemExit(f"reply {rid} where {self.answered} was due")
        return body

    def _whole_frame(self) -> bool:
        """A whole reply (with its MAC) is buffered; checked without taking it (that would use up the
        session's sequence number)."""
        if len(self.inbuf) < FRAME_HEAD.size:
            return False
        n, _ = FRAME_HEAD.unpack_from(self.inbuf)
        return len(self.inbuf) >= FRAME_HEAD.size + n + self.session.size

    def call(self, req: p.Request) -> p.Reply:
        """One request, waiting for its reply (set-up only: the socket is blocking until ``pipelined``)."""
        self.queue("call", p.request_encoder.encode(req))
        self.sock.sendall(self.out)
        self.out.clear()
        while not self._whole_frame():
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise SystemExit("the MetaService closed a connection")
            self.inbuf += chunk
        frame = take_frame(self.inbuf, self.session)
        assert frame is not None
        self.inflight.popleft()
        reply = p.reply_decoder.decode(self._in_order(*frame))
        if isinstance(reply, p.Error):
            raise SystemExit(f"{type(req).__name__} failed: {reply.message}")
        return reply

    def join(self, name: str, segment_bytes: int) -> None:
        """Join as a member contributing a segment (the MetaService never touches its bytes)."""
        seg = p.SegmentInfo(0, segment_bytes, f"bench-{name}", f"/memcache-{os.getpid()}-{os.urandom(8).hex()}",
                            "127.0.0.1:9")
        joined = self.call(p.Join(0, f"bench-{name}", os.getpid(), seg))
        assert isinstance(joined, p.Joined)
        self.cid, self.token = joined.client_id, joined.token

    def heartbeat(self) -> None:
        self.queue("heartbeat", p.request_encoder.encode(p.Heartbeat(self.cid, self.token, self.ack)))

    def heard(self, r: p.Reply) -> None:
        if not isinstance(r, p.HeartbeatReply) or not r.known:
            raise SystemExit(f"member {self.cid}: heartbeat not known: {r!r}")
        if r.journal:
            self.ack = max(self.ack, r.journal[-1].seq)

    def put(self, keys: list[str], sizes: list[int]) -> None:
        """A blocking two-phase put (set-up)."""
        got = self.call(p.Alloc(self.cid, self.token, keys, sizes))
        assert isinstance(got, p.AllocReply)
        bad = [r.code for r in got.results if r.code != 0]
        if bad:
            raise SystemExit(f"set-up put failed with codes {bad[:5]}")
        codes = self.call(p.Commit(self.cid, self.token, keys, [r.generation for r in got.results]))
        assert isinstance(codes, p.Codes) and not any(codes.codes), codes

    def pipelined(self, sel: selectors.BaseSelector) -> None:
        self.sock.setblocking(False)
        sel.register(self.sock, selectors.EVENT_READ, self)


# ---- the members: join, fill, heartbeat -------------------------------------------------------------

def members_main(addr: tuple[str, int], secret: bytes | None, n: int, objects: int, heartbeat_s: float,
                 ready: Any, stop: Any, result: Any) -> None:
    try:
        conns = [Conn(addr, secret) for _ in range(n)]
        for i, c in enumerate(conns):
            c.join(f"member{i}", 256 * GIB)
        batch, beaten = 512, time.monotonic()
        for start in range(0, objects, batch):
            keys = [stored_key(i) for i in range(start, min(objects, start + batch))]
            conns[(start // batch) % n].put(keys, [256 * KIB] * len(keys))
            if time.monotonic() - beaten > heartbeat_s:   # a long fill on a busy host: stay members
                for c in conns:
                    c.heard(c.call(p.Heartbeat(c.cid, c.token, c.ack)))
                beaten = time.monotonic()
        sel = selectors.DefaultSelector()
        for c in conns:
            c.pipelined(sel)
        ready.set()
        beats = 0
        t0 = time.monotonic()
        due = [t0 + heartbeat_s * i / n for i in range(n)]   # spread over the interval, like independent ranks
        while not stop.is_set():
            now = time.monotonic()
            for i, c in enumerate(conns):
                if now >= due[i]:
                    c.heartbeat()
                    c.flush()
                    due[i] += heartbeat_s
                    beats += 1
            for key, _ in sel.select(max(0.0, min(min(due) - time.monotonic(), 0.05))):
                c = key.data
                for body in c.replies():
                    c.inflight.popleft()
                    c.heard(p.reply_decoder.decode(body))
        result.put({"heartbeats": beats})
    except BaseException as e:
        result.put({"error": f"members: {e!r}"})
        raise


# ---- a request generator ----------------------------------------------------------------------------

class Frames:
    """Pre-encoded requests of the read kinds over the stored keys, with the answer each must get."""

    def __init__(self, objects: int, rng: random.Random, count: int = 256) -> None:
        self.exist: list[tuple[bytes, int, int]] = []     # (body, keys, keys found)
        for _ in range(count):
            n = rng.randint(16, min(512, objects))
            hits = rng.randint(0, n)
            start = rng.randrange(objects - hits + 1)
            keys = [stored_key(start + i) for i in range(hits)] + [absent_key(rng.randrange(1 << 30))
                                                                   for _ in range(n - hits)]
            self.exist.append((p.request_encoder.encode(p.Exist(keys)), n, hits))
        self.probe = [(p.request_encoder.encode(p.Exist([stored_key(rng.randrange(objects))])), 1, 1)
                      for _ in range(count)]
        self.lookup = []
        for _ in range(count):
            n = rng.randint(1, 32)
            start = rng.randrange(objects - n + 1)
            self.lookup.append((p.request_encoder.encode(p.Lookup([stored_key(start + i) for i in range(n)])), n, n))


def _mix(spec: str) -> dict[str, float]:
    out = {k: 0.0 for k in KINDS}
    for part in spec.split(","):
        name, _, w = part.partition("=")
        if name not in out or not w:
            raise SystemExit(f"--mix: {part!r}: expected kind=weight with kind one of {', '.join(KINDS)}")
        out[name] = float(w)
    if not any(out.values()):
        raise SystemExit("--mix: every weight is 0")
    return out


def generator_main(addr: tuple[str, int], secret: bytes | None, gid: int, args: dict[str, Any],
                   ready: Any, go: Any, result: Any) -> None:
    try:
        result.put(_generate(addr, secret, gid, args, ready, go))
    except BaseException as e:
        result.put({"error": f"generator {gid}: {e!r}"})
        raise


def _generate(addr: tuple[str, int], secret: bytes | None, gid: int, a: dict[str, Any], ready: Any,
              go: Any) -> dict[str, Any]:
    rng = random.Random(gid)   # the workload's randomness only (a benchmark's, not an identity)
    frames = Frames(a["objects"], rng)
    conns = [Conn(addr, secret) for _ in range(a["connections"])]
    for i, c in enumerate(conns):
        c.join(f"gen{gid}.{i}", 1 << 40)
    sel = selectors.DefaultSelector()
    for c in conns:
        c.pipelined(sel)
    mix = _mix(a["mix"])
    kinds, weights = zip(*[(k, w) for k, w in mix.items() if w], strict=True)
    plan = rng.choices(kinds, weights, k=4096)
    rate = a["rate"] / a["generators"] if a["rate"] else 0.0
    window, seconds = a["window"], a["seconds"]
    put_seq = 0
    churn: collections.deque[str] = collections.deque()   # keys this generator put, oldest first
    counts: collections.Counter[str] = collections.Counter()
    keys: collections.Counter[str] = collections.Counter()
    lat: dict[str, list[int]] = {"probe": [], "exist": []}
    commits: list[tuple[Conn, list[str], list[int]]] = []
    ready.set()
    go.wait()
    t0 = time.perf_counter()
    end = t0 + seconds
    next_beat = t0 + a["heartbeat_s"]
    sent = 0
    rr = 0
    cpu0 = time.process_time()

    def send_one(c: Conn) -> None:
        nonlocal put_seq, sent
        kind = plan[sent % len(plan)]
        sent += 1
        if kind == "remove" and len(churn) < 16:
            kind = "put"
        if kind in ("exist", "probe", "lookup"):
            body, n, expect = rng.choice(getattr(frames, kind))
            c.queue(kind, body, (n, expect))
        elif kind == "put":
            n = rng.randint(1, 8)
            ks = [f"gen{gid}/{put_seq + i:012d}/{'p' * 60}" for i in range(n)]
            put_seq += n
            sizes = [int(64 * KIB * 128 ** rng.random()) for _ in range(n)]   # 64 KiB-8 MiB, log-uniform
            c.queue("alloc", p.request_encoder.encode(p.Alloc(c.cid, c.token, ks, sizes)), ks)
        else:
            n = rng.randint(1, 8)
            ks = [churn.popleft() for _ in range(min(n, len(churn)))]
            c.queue("remove", p.request_encoder.encode(p.Remove(ks)), ks)

    def answered(c: Conn, body: bytes) -> None:
        kind, t_ns, info = c.inflight.popleft()
        if kind == "heartbeat":
            c.heard(p.reply_decoder.decode(body))
            return
        done = time.perf_counter_ns()
        r = p.reply_decoder.decode(body)
        if isinstance(r, p.Error):
            raise SystemExit(f"{kind}: error reply {r.code}: {r.message}")
        counts[kind] += 1
        if kind in ("exist", "probe"):
            n, expect = info
            assert isinstance(r, p.Flags)
            if len(r.flags) != n or r.flags.count(True) != expect:
                raise SystemExit(f"{kind}: {r.flags.count(True)} of {n} keys found, expected {expect}")
            keys[kind] += n
            lat[kind].append(done - t_ns)
        elif kind == "lookup":
            n, expect = info
            assert isinstance(r, p.LookupReply)
            if len(r.results) != n or None in r.results:
                raise SystemExit(f"lookup: a stored key missing among {n}")
            keys[kind] += n
        elif kind == "alloc":
            assert isinstance(r, p.AllocReply)
            if any(x.code for x in r.results):
                raise SystemExit(f"put: alloc codes {[x.code for x in r.results]}")
            keys["put"] += len(info)
            commits.append((c, info, [x.generation for x in r.results]))
        elif kind == "commit":
            assert isinstance(r, p.Codes)
            if any(r.codes):
                raise SystemExit(f"put: commit codes {r.codes}")
            keys[kind] += len(info)
            churn.extend(info)
        elif kind == "remove":
            assert isinstance(r, p.Codes)
            if any(r.codes):
                raise SystemExit(f"remove: codes {r.codes}")
            keys[kind] += len(info)

    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if now >= next_beat:
            for c in conns:
                c.heartbeat()
            next_beat += a["heartbeat_s"]
        for c, ks, gens in commits:   # the second phase of each put goes out as soon as its alloc came back
            sums = [rng.getrandbits(64) for _ in ks]
            c.queue("commit", p.request_encoder.encode(p.Commit(c.cid, c.token, ks, gens, sums)), ks)
            sent += 1                   # (part of the offered load)
        commits.clear()
        if rate:
            due = int((now - t0) * rate) - sent
            while due > 0:
                c = conns[rr % len(conns)]
                rr += 1
                if len(c.inflight) >= window:
                    if all(len(x.inflight) >= window for x in conns):
                        break   # every window is full: the rest waits (the offered load is above what is served)
                    continue
                send_one(c)
                due -= 1
            timeout = max(0.0, min(t0 + (sent + 1) / rate - time.perf_counter(), 0.005))
        else:
            for c in conns:
                while len(c.inflight) < window:
                    send_one(c)
            timeout = 0.005
        for c in conns:
            c.flush()
        for key, _ in sel.select(timeout):
            c = key.data
            for body in c.replies():
                answered(c, body)
    elapsed = time.perf_counter() - t0
    gen_cpu = time.process_time() - cpu0
    # not counted: what is still in flight, then each member leaves (its objects go with it at once)
    for c in conns:
        c.queue("leave", p.request_encoder.encode(p.Leave(c.cid, c.token)))
    deadline = time.monotonic() + 30
    while any(c.inflight for c in conns) and time.monotonic() < deadline:
        for c in conns:
            c.flush()
        for key, _ in sel.select(0.05):
            c = key.data
            for _ in c.replies():
                c.inflight.popleft()
    return {"elapsed": elapsed, "generator_cpu": gen_cpu, "counts": dict(counts), "keys": dict(keys),
            "lat": lat}


# ---- phases -----------------------------------------------------------------------------------------

def run_phase(name: str, meta_pid: int, addr: tuple[str, int], secret: bytes | None, args: argparse.Namespace,
              mix: str, rate: float, window: int = 0) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    a = {"objects": args.objects, "connections": args.connections, "window": window or args.window, "mix": mix,
         "rate": rate, "generators": args.generators, "seconds": args.seconds, "heartbeat_s": args.heartbeat_ms / 1e3}
    readies = [ctx.Event() for _ in range(args.generators)]
    go, result = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=generator_main, args=(addr, secret, g, a, readies[g], go, result), daemon=True)
             for g in range(args.generators)]
    for pr in procs:
        pr.start()
    try:
        for r in readies:
            if not r.wait(120):
                raise SystemExit(f"{name}: a generator did not get ready")
        cpu0, t0 = cpu_seconds(meta_pid), time.monotonic()
        go.set()
        outs = [result.get(timeout=args.seconds + 120) for _ in procs]
        cpu1, t1 = cpu_seconds(meta_pid), time.monotonic()
    finally:
        for pr in procs:
            pr.join(30)
            if pr.is_alive():
                pr.kill()
    errs = [o["error"] for o in outs if "error" in o]
    if errs:
        raise SystemExit("; ".join(errs))
    row = summarise(name, outs, cpu1 - cpu0, t1 - t0, rate)
    row["loadavg"] = os.getloadavg()[0]
    return row


def summarise(name: str, outs: list[dict[str, Any]], cpu: float, wall: float, rate: float) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    keys: collections.Counter[str] = collections.Counter()
    lat: dict[str, list[int]] = {"probe": [], "exist": []}
    for o in outs:
        counts.update(o["counts"])
        keys.update(o["keys"])
        for k in lat:
            lat[k] += o["lat"][k]
    elapsed = max(o["elapsed"] for o in outs)
    requests = sum(counts.values())
    row: dict[str, Any] = {
        "phase": name, "offered_rps": rate, "seconds": round(elapsed, 3), "meta_cpu_s": round(cpu, 3),
        "meta_cpu_share": round(cpu / wall, 3), "requests": requests, "rps": round(requests / elapsed, 1),
        "rps_per_cpu_s": round(requests / cpu, 1) if cpu else None,
        "keys_per_cpu_s": round(sum(keys.values()) / cpu, 1) if cpu else None,
        "exist_keys_per_cpu_s": round((keys["exist"] + keys["probe"]) / cpu, 1) if cpu else None,
        "generator_cpu_share": round(sum(o["generator_cpu"] for o in outs) / elapsed, 3),
        "counts": dict(counts), "keys": dict(keys)}
    for k, values in lat.items():
        v = sorted(x / 1e3 for x in values)
        row[f"{k}_p50_us"] = round(statistics.median(v), 1) if v else None
        row[f"{k}_p99_us"] = round(percentile(v, 0.99), 1) if v else None
    return row


def idle_phase(name: str, meta_pid: int, seconds: float) -> dict[str, Any]:
    cpu0, t0 = cpu_seconds(meta_pid), time.monotonic()
    time.sleep(seconds)   # measuring an interval of time with no client action: nothing to wait for
    cpu1, t1 = cpu_seconds(meta_pid), time.monotonic()
    return {"phase": name, "seconds": round(t1 - t0, 3), "meta_cpu_s": round(cpu1 - cpu0, 3),
            "meta_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 4), "loadavg": os.getloadavg()[0]}


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str = "{:,.0f}") -> str:
        return "-" if v is None else fmt.format(v)
    lines = [f"{'phase':>12} {'offered/s':>10} {'served/s':>10} {'MS CPU':>7} {'req/CPU-s':>10} "
             f"{'keys/CPU-s':>11} {'probe p50':>9} {'p99 us':>8} {'exist p50':>9} {'p99 us':>8} {'gen CPU':>7} {'load':>5}"]
    for r in rows:
        if "rps" not in r:
            lines.append(f"{r['phase']:>12} {'':>10} {'':>10} {r['meta_cpu_share']:>7.1%} {'':>10} {'':>11} {'':>9} "
                         f"{'':>8} {'':>9} {'':>8} {'':>7} {f(r.get('loadavg'), '{:.1f}'):>5}")
            continue
        lines.append(f"{r['phase']:>12} {f(r['offered_rps'] or None):>10} {f(r['rps']):>10} {r['meta_cpu_share']:>7.1%} "
                     f"{f(r['rps_per_cpu_s']):>10} {f(r['keys_per_cpu_s']):>11} {f(r['probe_p50_us'], '{:.0f}'):>9} "
                     f"{f(r['probe_p99_us'], '{:.0f}'):>8} {f(r['exist_p50_us'], '{:.0f}'):>9} "
                     f"{f(r['exist_p99_us'], '{:.0f}'):>8} {r['generator_cpu_share']:>7.0%} {f(r.get('loadavg'), '{:.1f}'):>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=256, help="simulated LocalServices heartbeating")
    ap.add_argument("--objects", type=int, default=100_000, help="stored objects the reads ask for")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="the members' heartbeat_interval_ms")
    ap.add_argument("--generators", type=int, default=1, help="request generator processes")
    ap.add_argument("--connections", type=int, default=8, help="connections per generator")
    ap.add_argument("--window", type=int, default=8, help="requests in flight per connection")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    ap.add_argument("--mix", default=DEFAULT_MIX, help=f"weights of the request kinds (default {DEFAULT_MIX})")
    ap.add_argument("--levels", default="0.1,0.25,0.5,0.75,0.9,1.0,1.25",
                    help="offered load as fractions of the measured saturation rate of the mix (0.5 is always "
                         "run: the is_exist p50/p99 there is printed on a line of its own)")
    ap.add_argument("--rates", help="offered loads in requests/s of the mix (instead of --levels; no saturation run)")
    ap.add_argument("--phases", default="all",
                    help=f"run only these phases after idle and heartbeats (comma-separated: {', '.join(ALONE)}, mix)")
    ap.add_argument("--spin-us", type=int, default=None, help="the MetaService's poll_spin_us (default: its default)")
    ap.add_argument("--frame-loop", choices=("auto", "native", "python"), default=None,
                    help="the MetaService's frame_loop (default: its default, auto)")
    ap.add_argument("--meta-nice", type=int, default=0,
                    help="the MetaService's nice value: on a shared machine a negative one (needs root) keeps other "
                         "work from deciding its latency")
    ap.add_argument("--quick", action="store_true", help="16 members, 2,000 objects, 0.5 s phases, 2 levels")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--plot", help="draw the latency-against-load curve to this PNG (needs matplotlib)")
    ap.add_argument("--from-json", help="print the table (and --plot) of an earlier --json run and exit")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            rows = json.load(f)["results"]
        print(table(rows))
        half = next((r for r in rows if r["phase"] == "mix x0.5"), None)
        if half is not None:
            print(half_saturation(half))
        if args.plot:
            _plot(rows, args.plot)
        return 0
    if args.quick:
        args.members, args.objects, args.seconds, args.levels = 16, 2000, 0.5, "0.5,1.0"
        args.connections = min(args.connections, 4)
    rows = measure(args)
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "results": rows}, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from memcache_core.config import parse_url
    from memcache_core.testing import running_meta_service
    overrides: dict[str, Any] = {"log_level": "warning"}
    if args.spin_us is not None:
        overrides["poll_spin_us"] = args.spin_us
    if args.frame_loop is not None:
        overrides["frame_loop"] = args.frame_loop
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(table([row]).splitlines()[1], flush=True)

    with running_meta_service(**overrides) as ms:
        assert ms.pid is not None
        if args.meta_nice:
            os.setpriority(os.PRIO_PROCESS, ms.pid, args.meta_nice)
        addr = parse_url(ms.meta_service_url, "meta_service_url", ("tcp",))
        secret = load_secret(ms.config.get("auth_secret_path", ""))
        report(idle_phase("idle", ms.pid, args.seconds))
        ctx = mp.get_context("fork")
        ready, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
        members = ctx.Process(target=members_main, args=(addr, secret, args.members, args.objects,
                                                         args.heartbeat_ms / 1e3, ready, stop, result), daemon=True)
        members.start()
        try:
            if not ready.wait(300):
                raise SystemExit("the members did not join and fill the table in 300 s")
            report(idle_phase("heartbeats", ms.pid, max(args.seconds, 2 * args.heartbeat_ms / 1e3)))
            pid = ms.pid

            def phase(name: str, mix: str, rate: float, window: int = 0) -> dict[str, Any]:
                return run_phase(name, pid, addr, secret, args, mix, rate, window)
            wanted = set(args.phases.split(",")) if args.phases != "all" else set(ALONE) | {"mix"}
            for name, (mix, window) in ALONE.items():
                if name in wanted:
                    report(phase(name, mix, 0, window))
            if args.rates:
                for rate in (float(x) for x in args.rates.split(",")):
                    report(phase(f"mix {rate:g}/s", args.mix, rate))
            elif "mix" in wanted:
                saturated = phase("mix", args.mix, 0)
                report(saturated)
                for level in levels(args.levels):
                    report(phase(f"mix x{level:g}", args.mix, saturated["rps"] * level))
        finally:
            stop.set()
            members.join(30)
            if members.is_alive():
                members.kill()
        out = result.get(timeout=5)
        if "error" in out:
            raise SystemExit(out["error"])
    hb = rows[1]["meta_cpu_share"] - rows[0]["meta_cpu_share"]
    print(f"heartbeats of {args.members} members every {args.heartbeat_ms} ms: {hb:.2%} of one core "
          f"above idle ({rows[0]['meta_cpu_share']:.2%})")
    half = next((r for r in rows if r["phase"] == "mix x0.5"), None)
    if half is not None:
        print(half_saturation(half))
    return rows


def levels(spec: str) -> list[float]:
    """The fractions of saturation to offer, with 0.5 always among them (issue 26 quotes is_exist there)."""
    out = [float(x) for x in spec.split(",")]
    return out if 0.5 in out else sorted([*out, 0.5])


def half_saturation(row: dict[str, Any]) -> str:
    """The line that quotes ``is_exist`` at half of the measured saturation rate (target: p99 <= 1 ms)."""
    return (f"is_exist at 50% of saturation ({row['offered_rps']:,.0f} requests/s of the mix offered, "
            f"{row['rps']:,.0f} served, MetaService at {row['meta_cpu_share']:.0%} of a core): "
            f"p50 {row['probe_p50_us']} us, p99 {row['probe_p99_us']} us (target p99 <= 1,000 us); "
            f"batched exist p50 {row['exist_p50_us']} us, p99 {row['exist_p99_us']} us")


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from plots import latency_curve
    latency_curve([r for r in rows if r["phase"].startswith("mix x")], path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
