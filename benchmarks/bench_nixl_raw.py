#!/usr/bin/env python3
"""NIXL alone, no store: what UCX gives a one-sided READ or WRITE of bench_store's objects.

Two processes. The owner maps a ``/dev/shm`` region, fills it, registers it with its NIXL agent (UCX
backend) and hands its metadata to the initiator through a pipe; it does nothing per transfer (its
progress thread, when on, serves the peer). The initiator registers a private page-aligned buffer and
moves a batch of DeepSeek-shaped objects (``layered``: 61 x 128 KiB + 61 x 16 KiB per object,
scattered layer-major over the batch on the initiator's side, each object contiguous in the region,
320 bytes past a 4 KiB boundary like a pool object's payload; ``contiguous``: one 8,784 KiB piece)
in ONE request, then times, right after, a single-thread ``memmove`` of the same bytes between two
warm private buffers (bench_store's memcpy reference). Every transfer is checked byte for byte (the
initiator maps the same ``/dev/shm`` file to check; UCX never uses that mapping).

    python benchmarks/bench_nixl_raw.py                         # READ and WRITE, batch 8 and 16
    python benchmarks/bench_nixl_raw.py --env UCX_TCP_TX_SEG_SIZE=8k --env UCX_TCP_RX_SEG_SIZE=8k
    python benchmarks/bench_nixl_raw.py --mode initialize --initiator-progress on --wait sleep
    python benchmarks/bench_nixl_raw.py --socket                # plain TCP on loopback, no UCX
    python benchmarks/bench_nixl_raw.py --socket --streams 2    # the same over 2 parallel streams
    python benchmarks/bench_nixl_raw.py --bounce                # one descriptor per object + memmove

UCX is pinned to ``UCX_TLS=tcp UCX_NET_DEVICES=lo`` unless the environment (or ``--env``) says
otherwise; the transport's own tcp defaults (``memcache_core/transfer/nixl.py``) apply unless
``--no-defaults``. Each line: op, layout, batch, the median GB/s and its ratio to memcpy (min-max over
the repetitions), the time to build the request, and the descriptor count.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_store_common import OBJ_BYTES, SEED, memcpy_s, page_aligned, pieces_of  # noqa: E402

SLOT = OBJ_BYTES + 8192       # one object per slot of the owner's region
PAYLOAD = 4096 + 320          # where an object's payload starts in its slot


def _env(pairs: list[str], defaults: bool) -> None:
    for pair in pairs:
        k, _, v = pair.partition("=")
        os.environ[k] = v
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if not defaults:
        from memcache_core.transfer import nixl_agent
        nixl_agent.UCX_DEFAULTS = {}


def _agent(name: str, progress: bool, params: list[str]) -> Any:
    from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging
    own_nixl_logging()
    return make_agent(name, progress, dict(p.split("=", 1) for p in params))


def owner(path: str, size: int, conn: Any, env: list[str], defaults: bool,
          params: list[str], poll_us: int | None) -> None:
    _env(env, defaults)
    if poll_us is not None:
        from memcache_core.transfer import nixl_agent
        nixl_agent.PROGRESS_POLL_US = poll_us
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, size)
    arr = np.frombuffer(mm, np.uint8)
    arr[:] = np.frombuffer(np.random.default_rng(SEED).bytes(size), np.uint8)
    agent = _agent("owner", True, params)   # without its progress thread nothing answers over tcp
    handle = agent.register_memory([(arr.ctypes.data, size, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), arr.ctypes.data))
    conn.recv()                   # the initiator is done
    agent.deregister_memory(handle)
    del agent, arr
    mm.close()


def _ranges(batch: int, layout: str, local: int, remote: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) Nx3 descriptor arrays of one batch: object k's pieces end to end in slot k."""
    loc, rem = [], []
    for k in range(batch):
        pos = remote + k * SLOT + PAYLOAD
        for ptr, size in pieces_of(layout, local, batch, k):
            loc.append((ptr, size, 0))
            rem.append((pos, size, 0))
            pos += size
    return np.array(loc, np.uint64), np.array(rem, np.uint64)


def _bounce(loc: np.ndarray, flat: int, gather: bool) -> None:
    """memmove every piece to (gather) or from the contiguous bounce buffer at ``flat``, objects end to end."""
    pos = flat
    for ptr, size, _ in loc.tolist():
        if gather:
            ctypes.memmove(pos, ptr, size)
        else:
            ctypes.memmove(ptr, pos, size)
        pos += size


def cpu_s(pid: int) -> float:
    """CPU time of every thread of a process so far (``/proc/<pid>/task/*/schedstat``, ns)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass   # a thread that ended meanwhile
    return total / 1e9


def _wait(agent: Any, handle: Any, wait: str) -> None:
    state, deadline = agent.transfer(handle), time.monotonic() + 60
    while state == "PROC":
        if time.monotonic() > deadline:
            raise RuntimeError("transfer still running after 60 s")
        if wait != "spin":
            time.sleep(0.00005 if wait == "sleep" else 0)
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer ended {state}")


class Initiator:
    def __init__(self, args: argparse.Namespace, meta: bytes, remote: int, view: np.ndarray, owner: int) -> None:
        self.args, self.remote, self.view, self.owner = args, remote, view, owner
        self.agent = _agent("initiator", args.initiator_progress == "on", args.param)
        n = max(args.batches) * OBJ_BYTES
        self.buf = page_aligned(n, bytes(n))
        self.src = page_aligned(n, np.random.default_rng(SEED + 1).bytes(n))
        self.scratch = page_aligned(n, bytes(n))
        self.bounce = page_aligned(n, bytes(n)) if args.bounce else None
        for arr in (self.buf, self.bounce):
            if arr is not None:
                self.agent.register_memory([(arr.ctypes.data, n, 0, "")], "DRAM")
        self.peer = self.agent.add_remote_agent(meta)
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()

    def request(self, op: str, loc: np.ndarray, rem: np.ndarray) -> Any:
        a = self.agent
        if self.args.mode == "initialize":
            return a.initialize_xfer(op, a.get_xfer_descs(loc, "DRAM"), a.get_xfer_descs(rem, "DRAM"), self.peer)
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
        rh = a.prep_xfer_dlist(self.peer, rem, "DRAM")
        idx = np.arange(len(loc), dtype=np.int32)
        return a.make_prepped_xfer(op, lh, idx, rh, idx), (lh, rh)

    def one(self, op: str, layout: str, batch: int, rep: int) -> tuple[float, float, float, int, float, float]:
        loc, rem = _ranges(batch, layout, self.buf.ctypes.data, self.remote)
        nbytes = batch * OBJ_BYTES
        if op == "WRITE":
            self.buf[:nbytes] = self.src[:nbytes]
            self.buf[rep * 4096] ^= 0xFF   # a fresh byte per repetition
        else:
            self.buf[:nbytes] = 0
        c0, o0 = cpu_s(os.getpid()), cpu_s(self.owner)
        t0 = time.perf_counter()
        if self.bounce is not None and op == "WRITE":
            _bounce(loc, self.bounce.ctypes.data, gather=True)
        req = self.request(op, *self._bounced(loc, rem))
        handle = req[0] if isinstance(req, tuple) else req
        t1 = time.perf_counter()
        _wait(self.agent, handle, self.args.wait)
        if self.bounce is not None and op == "READ":
            _bounce(loc, self.bounce.ctypes.data, gather=False)
        t2 = time.perf_counter()
        c1, o1 = cpu_s(os.getpid()), cpu_s(self.owner)
        ref = memcpy_s(self.scratch, self.src, nbytes)
        self.agent.release_xfer_handle(handle)
        if isinstance(req, tuple):
            for h in req[1]:
                self.agent.release_dlist_handle(h)
        self._check(loc, rem)
        return t2 - t0, t1 - t0, ref, len(loc), c1 - c0, o1 - o0

    def _bounced(self, loc: np.ndarray, rem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """With ``--bounce``: one descriptor per object, between the bounce buffer and its whole payload."""
        if self.bounce is None:
            return loc, rem
        nobj = int(loc[:, 1].sum()) // OBJ_BYTES
        ks = np.arange(nobj, dtype=np.uint64)
        sizes = np.full(nobj, OBJ_BYTES, np.uint64)
        zero = np.zeros(nobj, np.uint64)
        return (np.stack([self.bounce.ctypes.data + ks * OBJ_BYTES, sizes, zero], axis=1),
                np.stack([self.remote + ks * SLOT + PAYLOAD, sizes, zero], axis=1))

    def _check(self, loc: np.ndarray, rem: np.ndarray) -> None:
        base, rbase = self.buf.ctypes.data, self.remote
        for (lp, n, _), (rp, _, _) in zip(loc.tolist(), rem.tolist(), strict=True):
            if not np.array_equal(self.buf[lp - base:lp - base + n], self.view[rp - rbase:rp - rbase + n]):
                raise RuntimeError(f"bytes differ at local {lp - base:#x}+{n}")


def _sender(port: int, nbytes: int, reps: int, streams: int) -> None:
    import socket
    import threading
    src = page_aligned(nbytes, np.random.default_rng(SEED).bytes(nbytes))
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

    def send(k: int) -> None:
        share = memoryview(src)[k * nbytes // streams:(k + 1) * nbytes // streams]
        for _ in range(reps):
            conns[k].recv(1)
            conns[k].sendall(share)
    threads = [threading.Thread(target=send, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()


def run_socket(args: argparse.Namespace) -> None:
    """What TCP on loopback itself gives here: ``--streams`` Python socket streams (one thread each on
    both ends; the socket calls release the GIL) carrying the same bytes from a second process into a
    private buffer (kernel copies only, no UCX), beside the same memcpy."""
    import socket
    from concurrent.futures import ThreadPoolExecutor
    nbytes, n = max(args.batches) * OBJ_BYTES, args.streams
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(n)
        proc = mp.get_context("spawn").Process(target=_sender, args=(srv.getsockname()[1], nbytes, args.reps + 1, n))
        proc.start()
        conns = [srv.accept()[0] for _ in range(n)]
    conns.sort(key=lambda c: c.getpeername()[1])   # the sender's k-th connection has the k-th port
    dst, src = page_aligned(nbytes, bytes(nbytes)), page_aligned(nbytes, bytes(nbytes))

    def receive(k: int) -> None:
        lo, hi = k * nbytes // n, (k + 1) * nbytes // n
        conns[k].send(b"x")
        got = lo
        while got < hi:
            got += conns[k].recv_into(memoryview(dst)[got:hi], hi - got)
    runs = []
    with ThreadPoolExecutor(n) as pool:
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            list(pool.map(receive, range(n)))
            runs.append((time.perf_counter() - t, 0.0, memcpy_s(src, dst, nbytes), 1, 0.0, 0.0))
    for c in conns:
        c.close()
    proc.join(30)
    _report("TCP", f"socket x{n}", max(args.batches), runs[1:])


def run(args: argparse.Namespace) -> None:
    _env(args.env, not args.no_defaults)
    size = max(args.batches) * SLOT
    fd, path = tempfile.mkstemp(prefix="nixl-raw-", dir="/dev/shm")
    os.ftruncate(fd, size)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(path, size, theirs, args.env,
                                           not args.no_defaults, args.param, args.poll_us))
    proc.start()
    theirs.close()   # the owner's end: its exit is an EOF here, not a wait forever
    try:
        meta, remote = mine.recv()
        view = np.frombuffer(mmap.mmap(fd, size), np.uint8)
        from memcache_core.transfer.nixl_agent import ucx_settings
        print("UCX: " + " ".join(f"{k}={v}" for k, v in sorted(ucx_settings().items())),
              f"| poll {args.poll_us or 'default'} us, initiator progress {args.initiator_progress}, "
              f"{args.mode}, wait {args.wait}, params {args.param}", flush=True)
        assert proc.pid is not None
        ini = Initiator(args, meta, remote, view, proc.pid)
        for op in args.ops:
            for layout in args.layouts:
                for batch in args.batches:
                    _report(op, layout, batch, [ini.one(op, layout, batch, r) for r in range(args.reps + 1)][1:])
    finally:
        os.close(fd)
        os.unlink(path)
        if proc.is_alive():
            mine.send("done")
            proc.join(30)


def _report(op: str, layout: str, batch: int, runs: list[tuple[float, float, float, int, float, float]]) -> None:
    nbytes = batch * OBJ_BYTES
    ratios = [r[2] / r[0] for r in runs]
    dt = statistics.median(r[0] for r in runs)
    line = (f"{op:5} {layout:10} batch {batch:2}  {nbytes / dt / 1e9:5.2f} GB/s  x{statistics.median(ratios):.2f} "
            f"(x{min(ratios):.2f}-x{max(ratios):.2f})  memcpy "
            f"{nbytes / statistics.median(r[2] for r in runs) / 1e9:5.2f} GB/s")
    if op != "TCP":
        line += (f"  build {statistics.median(r[1] for r in runs) * 1e3:.2f} ms  {runs[0][3]} descriptors  "
                 f"CPU per GB: initiator {statistics.median(r[4] for r in runs) / nbytes * 1e12:.0f} ms, owner "
                 f"{statistics.median(r[5] for r in runs) / nbytes * 1e12:.0f} ms")
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", choices=("READ", "WRITE"), default=["READ", "WRITE"])
    ap.add_argument("--layouts", nargs="+", choices=("layered", "contiguous"), default=["layered"])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mode", choices=("prepped", "initialize"), default="prepped",
                    help="prep_xfer_dlist + make_prepped_xfer, or initialize_xfer (both timed as 'build')")
    ap.add_argument("--poll-us", type=int, default=None,
                    help="the owner's progress thread poll timeout (default: the transport's)")
    ap.add_argument("--initiator-progress", choices=("on", "off"), default="off")
    ap.add_argument("--wait", choices=("spin", "yield", "sleep"), default="spin",
                    help="poll check_xfer_state back to back, with sleep(0) between polls, or sleep 50 us")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="set a UCX variable (repeatable)")
    ap.add_argument("--param", action="append", default=[], metavar="K=V",
                    help="a NIXL UCX backend parameter on both sides, e.g. num_workers=2 (repeatable)")
    ap.add_argument("--bounce", action="store_true",
                    help="move each object whole between a registered bounce buffer and the region, and scatter "
                         "(gather) its pieces with memmove (timed with the transfer)")
    ap.add_argument("--streams", type=int, default=1, help="with --socket: parallel TCP streams (default 1)")
    ap.add_argument("--socket", action="store_true",
                    help="instead of NIXL, one plain TCP socket stream of the largest batch's bytes (loopback's own rate)")
    ap.add_argument("--no-defaults", action="store_true", help="leave out the transport's UCX tcp defaults")
    args = ap.parse_args()
    (run_socket if args.socket else run)(args)


if __name__ == "__main__":
    main()
