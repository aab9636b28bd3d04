#!/usr/bin/env python3
"""The MemCache benchmark workload on memcache_core (or, with ``--engine mooncake``, on Mooncake Store).

A MetaService and two LocalService processes, a writer and a reader, each contributing a 1 GB
segment. Per protocol (host_shm, host_tcp), layout (one contiguous 8,784 KiB buffer per object, or
122 pieces: 61 x 128 KiB + 61 x 16 KiB scattered layer-major over the batch) and batch (1-32 keys):

* put      the writer stores a batch; objects land in its own segment (the default placement);
* put>peer the writer stores a batch into the reader's segment (cross-process write);
* get      the reader reads the writer's objects (cross-process read; over host_tcp through the
           writer's data server).

Every operation is followed, in the same process, by a single-thread ``ctypes.memmove`` of the same
number of bytes between two warm private buffers; figures are medians over the repetitions, and the
ratio is op bandwidth / memcpy bandwidth. Every get is checked byte for byte against what the writer
wrote (each object carries a per-repetition stamp, so stale data is caught too); a mismatch or a
failed operation aborts the run with a non-zero exit.

Small objects: 4 KiB put (writer), get and is_exist (reader) latency p50/p99, and batch_is_exist of
1,000 present keys (reader).

This file runs the pool and the measurements; ``bench_store_common.py`` (constants, buffer layouts),
``bench_store_worker.py`` (engine adapters, worker processes) and ``bench_store_report.py`` (rows,
the side-by-side table, the plot) are its parts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from bench_store_common import (
    KIB,
    LAYERS,
    OBJ_BYTES,
    SEGMENT,
    BenchError,
    OpFailed,
    free_port,
    load_bench_nixl,
)
from bench_store_common import SEED as SEED  # re-exported: bench_copy.py imports these from here
from bench_store_common import page_aligned as page_aligned
from bench_store_common import piece_memcpy_s as piece_memcpy_s
from bench_store_common import pieces_of as pieces_of
from bench_store_report import bandwidth_row, plot, print_row, print_table
from bench_store_worker import Proc

# ---- the pool: MetaService (or Mooncake master) + writer + reader --------------------------------------

class MooncakeMaster:
    def __init__(self) -> None:
        exe = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        rpc, meta, metrics = free_port(), free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={meta}",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.spec = {"master_addr": f"127.0.0.1:{rpc}", "metadata_url": f"http://127.0.0.1:{meta}/metadata"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"mooncake_master exited with {self.proc.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise BenchError("mooncake_master did not come up within 30 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_protocol(engine: str, protocol: str, args: argparse.Namespace, out: list[dict[str, Any]]) -> None:
    server_pid: int | None
    spec: dict[str, Any] = {"engine": engine, "protocol": protocol, "max_batch": max(args.batches),
                            "lease_ms": args.lease_ms, "checksum": args.checksum_now, "auth": args.auth_now,
                            "rpc_spin_us": args.rpc_spin_us, "data_server_loop": args.data_server_loop}
    if engine == "mooncake":
        master = MooncakeMaster()
        spec.update(master.spec)
        stop, server_pid = master.stop, master.proc.pid
    else:
        from memcache_core.testing import running_meta_service
        spin: dict[str, Any] = {} if args.poll_spin_us is None else {"poll_spin_us": args.poll_spin_us}
        if args.frame_loop is not None:
            spin["frame_loop"] = args.frame_loop
        ctx = running_meta_service(log_level="warning", lease_ttl_ms=args.lease_ms, auth_enable=args.auth_now, **spin)
        meta = ctx.__enter__()
        spec.update(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url)
        server_pid = meta.pid
        def stop() -> None:
            ctx.__exit__(None, None, None)
    procs: list[Proc] = []
    try:
        writer = Proc(spec)
        procs.append(writer)
        reader = Proc(spec)
        procs.append(reader)
        if not args.cold_pool and not args.small_only:
            warm_up_pool(engine, protocol, writer, reader, spec["lease_ms"])
        for layout in [] if args.small_only else args.layouts:
            for batch in args.batches:
                rows: dict[str, list[dict[str, Any]]] = {"put": [], "put>peer": [], "get": []}
                for rep in range(args.warmup + args.reps):
                    prefix = f"{engine}/{protocol}/{layout}/b{batch}/r{rep}"
                    try:
                        put = writer.call("put", layout=layout, batch=batch, rep=rep, prefix=prefix, peer=None)
                        get = reader.call("get", layout=layout, batch=batch, rep=rep, prefix=prefix)
                        writer.call("remove", layout=layout, batch=batch, prefix=prefix)
                        peer = writer.call("put", layout=layout, batch=batch, rep=rep, prefix=prefix + "p",
                                           peer=reader.ident)
                        writer.call("remove", layout=layout, batch=batch, prefix=prefix + "p")
                    except OpFailed as e:
                        if engine == "memcache":
                            raise
                        writer.call("remove", layout=layout, batch=batch, prefix=prefix)
                        writer.call("remove", layout=layout, batch=batch, prefix=prefix + "p")
                        row = {"engine": engine, "protocol": protocol, "layout": layout, "batch": batch,
                               "failed": str(e)}
                        out.append(row)
                        print(f"{engine:8} {protocol:8} {layout:10} {batch:>3} FAILED: {e}", flush=True)
                        break
                    if rep >= args.warmup:
                        for op, r in (("put", put), ("put>peer", peer), ("get", get)):
                            rows[op].append(r)
                    elif rep == 0:
                        cold = get["s"]
                for op, rs in rows.items():
                    if not rs:
                        continue
                    row = bandwidth_row(engine, protocol, layout, batch, op, rs)
                    if op == "get" and args.warmup:
                        row["cold_get_gbps"] = round(batch * OBJ_BYTES / cold / 1e9, 3)
                    out.append(row)
                    print_row(row)
        if args.checksum == "both" and engine == "memcache" and not args.small_only:
            checksum_cost(protocol, args, writer, reader, out)
        if len(args.replicas) > 1 and engine == "memcache" and not args.small_only:
            replica_cost(protocol, args, writer, reader, out)
        small_ops(engine, protocol, args, writer, reader, server_pid, out)
    finally:
        for p in procs:
            p.close()
        stop()


def small_ops(engine: str, protocol: str, args: argparse.Namespace, writer: Proc, reader: Proc,
              server_pid: int | None, out: list[dict[str, Any]]) -> None:
    """4 KiB put (writer), get and is_exist (reader), batch_is_exist of 1,000 keys (reader): latency
    p50/p99, and CPU time per op of every process of the pool (the MetaService or mooncake_master,
    the writer, the reader: all their threads), read right before and after each loop."""
    pool = {"meta" if engine == "memcache" else "master": server_pid or 0,
            "writer": writer.proc.pid or 0, "reader": reader.proc.pid or 0}
    small = f"{engine}/{protocol}/small"
    res = {"put": writer.call("small_ops", op="put", prefix=small, n=args.small_n, pool=pool),
           "get": reader.call("small_ops", op="get", prefix=small, n=args.small_n, pool=pool),
           "is_exist": reader.call("small_ops", op="exist", prefix=small, n=args.small_n, pool=pool),
           "batch_is_exist(1000)": reader.call("batch_exist", prefix=small, n=1000, reps=args.exist_reps,
                                               pool=pool)}
    for op, r in res.items():
        ns = sorted(r["ns"])
        row = {"engine": engine, "protocol": protocol, "op": op, "n": len(ns),
               "p50_us": round(ns[len(ns) // 2] / 1e3, 1),
               "p99_us": round(ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3, 1),
               "cpu_us": r["cpu_us"]}
        out.append(row)
        print_row(row)


def warm_up_pool(engine: str, protocol: str, writer: Proc, reader: Proc, lease_ms: int) -> None:
    """Write 85% of both segments once and read the writer's back, then free it all.

    A fresh segment's pages are allocated by the kernel on their first write (one fault and a page
    clear per 4 KiB) and each process maps a peer's pages on its first access; a long-running pool
    has paid this long ago. ``--cold-pool`` skips this to show that cost.
    """
    count, t = int(SEGMENT * 0.85) // OBJ_BYTES, time.perf_counter()
    prefix = f"{engine}/{protocol}/warm"
    writer.call("fill", op="put", prefix=prefix, count=count)
    reader.call("fill", op="get", prefix=prefix, count=count)
    writer.call("fill", op="remove", prefix=prefix, count=count)
    writer.call("fill", op="put", prefix=prefix + "p", count=count, peer=reader.ident)
    writer.call("fill", op="remove", prefix=prefix + "p", count=count)
    time.sleep(lease_ms / 1000 + 0.2)   # space of objects read above comes back when their lease ends
    print(f"{engine:8} {protocol:8} pool warm-up: {2 * count} objects written, {count} read, "
          f"{time.perf_counter() - t:.1f} s", flush=True)


def checksum_cost(protocol: str, args: argparse.Namespace, writer: Proc, reader: Proc,
                  out: list[dict[str, Any]]) -> None:
    """What checksums cost: each op timed with and without them, alternately, on the same objects."""
    for layout in args.layouts:
        for batch in args.batches:
            prefix = f"memcache/{protocol}/{layout}/b{batch}/checksum"
            writer.call("put", layout=layout, batch=batch, rep=0, prefix=prefix, peer=None)
            for op, proc in (("get", reader), ("put", writer)):
                r = proc.call("paired", op=op, layout=layout, batch=batch, prefix=prefix, reps=2 * args.reps)
                ratios = [b / a for a, b in zip(r["on"], r["off"], strict=True)]
                nbytes = batch * OBJ_BYTES
                row = {"engine": "memcache", "protocol": protocol, "layout": layout, "batch": batch,
                       "op": f"{op} checksum", "gbps_on": round(nbytes / statistics.median(r["on"]) / 1e9, 3),
                       "gbps_off": round(nbytes / statistics.median(r["off"]) / 1e9, 3),
                       "with_over_without": round(statistics.median(ratios), 3)}
                out.append(row)
                print(f"memcache {protocol:8} {layout:10} {batch:>3} {op + ' cksum':9} "
                      f"{row['gbps_on']:7.2f} GB/s with, {row['gbps_off']:7.2f} GB/s without:"
                      f" x{row['with_over_without']:.2f} (median of paired ratios)", flush=True)
            writer.call("remove", layout=layout, batch=batch, prefix=prefix)


def auth_cost(out: list[dict[str, Any]]) -> None:
    """Authentication's cost: the same figures from pools with auth on and pools with it off, run in
    the order on, off, off, on (each a pool of its own; the order cancels a linear drift of the
    machine), compared by their medians."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["protocol"], r.get("layout") or "", r.get("batch") or 0, r["op"]
    def value(r: dict[str, Any]) -> float:
        return float(r["gbps"] if "gbps" in r else r["p50_us"])
    runs: dict[tuple[Any, ...], dict[bool, list[float]]] = {}
    for r in out:
        if "auth" in r and "failed" not in r:
            runs.setdefault(key(r), {True: [], False: []})[r["auth"]].append(value(r))
    print("auth cost: median with auth / median without (GB/s; for latencies, p50 us)")
    for (protocol, layout, batch, op), v in runs.items():
        if not v[True] or not v[False]:
            continue
        on, off = statistics.median(v[True]), statistics.median(v[False])
        out.append({"engine": "memcache", "protocol": protocol, "layout": layout, "batch": batch,
                    "op": f"{op} auth", "with": on, "without": off, "with_over_without": round(on / off, 3)})
        print(f"memcache {protocol:8} {layout:10} {batch or '':>3} {op:21} {on:8.2f} with, {off:8.2f} without:"
              f" x{on / off:.2f}", flush=True)


def replica_cost(protocol: str, args: argparse.Namespace, writer: Proc, reader: Proc,
                 out: list[dict[str, Any]]) -> None:
    """What replicas cost: put (by the writer) and get (by the reader) of the same batch with each
    replica count, alternately; ratio = median over repetitions of (time with n / time with the first).
    The first copy is pinned to the writer's segment, so with two segments the second copy is in the
    reader's: a get of a replicated object reads the reader's own copy."""
    counts, base = args.replicas, str(args.replicas[0])
    time.sleep(args.lease_ms / 1000 + 0.2)   # space of the objects just read comes back when their lease ends
    for layout in args.layouts:
        for batch in args.batches:
            prefix = f"memcache/{protocol}/{layout}/b{batch}/replicas"
            writer.call("replica_sets", layout=layout, batch=batch, prefix=prefix, counts=counts, op="put")
            for op, proc in (("get", reader), ("put", writer)):
                r = proc.call("paired_replicas", op=op, layout=layout, batch=batch, prefix=prefix,
                              reps=len(counts) * args.reps, counts=counts)["s"]
                nbytes = batch * OBJ_BYTES
                row: dict[str, Any] = {"engine": "memcache", "protocol": protocol, "layout": layout, "batch": batch,
                                       "op": f"{op} replicas"}
                for n in map(str, counts):
                    row[f"gbps_{n}"] = round(nbytes / statistics.median(r[n]) / 1e9, 3)
                    row[f"ms_{n}"] = round(statistics.median(r[n]) * 1e3, 2)
                    row[f"time_{n}_over_{base}"] = round(statistics.median(
                        a / b for a, b in zip(r[n], r[base], strict=True)), 3)
                out.append(row)
                print(f"memcache {protocol:8} {layout:10} {batch:>3} {op + ' repl':9} "
                      + ", ".join(f"{n}: {row[f'gbps_{n}']:6.2f} GB/s {row[f'ms_{n}']:7.2f} ms "
                                  f"(time x{row[f'time_{n}_over_{base}']:.2f})" for n in map(str, counts))
                      + f"  (median of paired ratios against {base})", flush=True)
            writer.call("replica_sets", layout=layout, batch=batch, prefix=prefix, counts=counts, op="remove")

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("memcache", "mooncake"), default="memcache")
    ap.add_argument("--protocol", choices=("host_shm", "host_tcp", "all"), default="all",
                    help="Mooncake has only TCP: it always runs host_tcp")
    ap.add_argument("--transfer-engine", choices=("builtin", "nixl"), default="builtin",
                    help="nixl: also run both LocalServices as distinct hosts over NIXL/UCX (protocol column "
                         "'nixl'), beside the built-in host_tcp path (benchmarks/bench_nixl.py)")
    ap.add_argument("--quick", action="store_true", help="small run (< 60 s), a smoke check")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=["contiguous", "layered"],
                    help="comma-separated: contiguous, layered")
    ap.add_argument("--reps", type=int, default=None, help="measured repetitions per figure")
    ap.add_argument("--lease-ms", type=int, default=2000,
                    help="MetaService lease_ttl_ms: objects just read are freed this long after their removal, "
                         "so a 1 GB segment holds only a few batches of 32 in flight (default 2000)")
    ap.add_argument("--cold-pool", action="store_true",
                    help="skip the pool warm-up: measure fresh segments (first-touch page faults)")
    ap.add_argument("--small-only", action="store_true",
                    help="only the small-object figures (4 KiB put, get, is_exist; batch_is_exist), on a pool "
                         "without the warm-up")
    ap.add_argument("--poll-spin-us", type=int, default=None,
                    help="the MetaService's poll_spin_us (polling after a request; default: its default)")
    ap.add_argument("--frame-loop", choices=("auto", "native", "python"), default=None,
                    help="the MetaService's frame_loop (default: its default, auto)")
    ap.add_argument("--rpc-spin-us", type=int, default=None,
                    help="the clients' rpc_spin_us (polling for a reply; default: its default)")
    ap.add_argument("--data-server-loop", choices=("auto", "native", "python"), default=None,
                    help="the providers' data_server_loop (default: its default)")
    ap.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    ap.add_argument("--checksum", choices=("on", "off", "both"), default="on",
                    help="payload checksums (computed by writers, verified by readers); 'both': figures with "
                         "them, plus each op timed with and without them alternately (their cost)")
    ap.add_argument("--auth", choices=("on", "off", "both"), default="on",
                    help="pool authentication; 'both': every figure from pools with it and without it "
                         "(on, off, off, on) and the ratios of their medians (its cost)")
    ap.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                    help="comma-separated replicaNum values, e.g. 1,2: besides the figures, each put and get "
                         "timed with every count alternately on the same batch (the cost of replicas; "
                         "memcache only; each segment is 1 GB, so keep batches at 8 or below)")
    ap.add_argument("--table", nargs="+", metavar="JSON",
                    help="print a side-by-side table of earlier --json results (e.g. memcache and mooncake) and exit")
    ap.add_argument("--plot", metavar="PNG", help="draw GB/s against batch size per op beside memcpy into this "
                    "PNG (needs matplotlib: the bench extra); with --table, from the first JSON given")
    args = ap.parse_args(argv)
    if args.table:
        print_table(args.table)
        if args.plot:
            with open(args.table[0], encoding="utf-8") as f:
                print(f"plot: {plot(json.load(f)['results'], args.plot)}")
        return 0
    if args.engine == "mooncake":
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            print(f"--engine mooncake: Mooncake Store is not importable in {sys.executable} ({e}).\n"
                  "Install it into a separate venv: pip install mooncake-transfer-engine-non-cuda numpy "
                  "(and apt-get install libibverbs1), then run this script with that venv's python.",
                  file=sys.stderr)
            return 2
    args.batches = args.batches or ([1, 8] if args.quick else [1, 2, 4, 8, 16, 32])
    args.reps = args.reps or (3 if args.quick else 7)
    args.warmup = 1
    args.small_n = 2000 if args.quick else 5000   # >= 2,000 ops: CPU per op steady to a few percent
    args.exist_reps = 300 if args.quick else 1000
    protocols = ["host_tcp"] if args.engine == "mooncake" else (
        ["host_shm", "host_tcp"] if args.protocol == "all" else [args.protocol])
    if args.transfer_engine == "nixl" and args.engine == "memcache":
        nixl_protocols = load_bench_nixl().prepare(args.protocol)
        if nixl_protocols is None:
            return 2
        protocols = nixl_protocols
    print(f"engine {args.engine}; object {OBJ_BYTES // KIB} KiB (contiguous, or {LAYERS}x128 KiB + {LAYERS}x16 KiB);"
          f" batches {args.batches}; {args.reps} reps (+{args.warmup} warm-up) per figure; medians; "
          f"xR = median over repetitions of (memcpy time / op time), the memcpy of the same bytes timed right after "
          f"the op in the same process", flush=True)
    out: list[dict[str, Any]] = []
    t0 = time.monotonic()
    args.checksum_now = args.checksum != "off"
    try:
        for protocol in protocols:
            for auth in ([True, False, False, True] if args.auth == "both" and args.engine == "memcache" else
                         [args.auth != "off"]):
                args.auth_now, first = auth, len(out)
                if args.auth == "both":
                    print(f"== {protocol}, auth {'on' if auth else 'off'}", flush=True)
                run_protocol(args.engine, protocol, args, out)
                for r in out[first:]:
                    r["auth"] = auth
        if args.auth == "both":
            auth_cost(out)
    except BenchError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"argv": sys.argv[1:], "results": out}, f, indent=1)
    if args.plot:
        print(f"plot: {plot(out, args.plot)}")
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
