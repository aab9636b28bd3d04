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
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

KIB = 1 << 10
OBJ_BYTES = 8784 * KIB
LAYER_PIECES = (128 * KIB, 16 * KIB)          # per layer: one 128 KiB and one 16 KiB piece
LAYERS = 61
SMALL = 4 * KIB
SEGMENT = 1 << 30
SEED = 20240611
OUT_OF_SPACE = (-3013, -3016)   # memcache_hybrid codes of a put that does not fit


class BenchError(RuntimeError):
    """A failed operation or a byte mismatch: the run is invalid."""


class OpFailed(BenchError):
    """An operation returned error codes (for Mooncake: recorded as a failed figure, the run goes on)."""


# ---- buffer layouts (shared by both processes, so the reader can rebuild what the writer wrote) ----

def pieces_of(layout: str, base: int, batch: int, k: int) -> list[tuple[int, int]]:
    """(pointer, size) pieces of object k of a batch; laid end to end they form the object."""
    if layout == "contiguous":
        return [(base + k * OBJ_BYTES, OBJ_BYTES)]
    out, off = [], 0
    for _ in range(LAYERS):
        for size in LAYER_PIECES:
            out.append((base + off + k * size, size))
            off += batch * size
    return out


def stamp(arr: np.ndarray, layout: str, batch: int, rep: int, tag: int) -> None:
    """Write a per-(repetition, object) marker into each object's first piece."""
    base = arr.ctypes.data
    for k in range(batch):
        ptr, _ = pieces_of(layout, base, batch, k)[0]
        arr[ptr - base:ptr - base + 8] = np.frombuffer(
            np.uint64((tag << 40) ^ (rep << 16) ^ (k + 1)).tobytes(), np.uint8)


def page_aligned(n: int, fill: bytes | None = None) -> np.ndarray:
    """A page-aligned buffer, like a KV-cache pool (numpy's own allocations sit 16 bytes past a cache
    line, which makes glibc's memmove of 16-128 KiB pieces about 3x slower on this CPU)."""
    raw = np.empty(n + 4096, np.uint8)
    arr = raw[(-raw.ctypes.data) % 4096:][:n]
    if fill is not None:
        arr[:] = np.frombuffer(fill, np.uint8)
    return arr


def minor_faults() -> int:
    """Minor page faults of this process so far (all threads): first touches of mapped pages."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def memcpy_s(dst: np.ndarray, src: np.ndarray, n: int) -> float:
    t = time.perf_counter()
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)
    return time.perf_counter() - t


def piece_memcpy_s(pieces: list[list[tuple[int, int]]], flat: int, gather: bool) -> float:
    """Single-thread memmove of every piece to (gather) or from a contiguous buffer at ``flat``."""
    t, pos = time.perf_counter(), flat
    for ps in pieces:
        for ptr, size in ps:
            if gather:
                ctypes.memmove(pos, ptr, size)
            else:
                ctypes.memmove(ptr, pos, size)
            pos += size
    return time.perf_counter() - t


# ---- engine adapters (run inside the worker processes) ----------------------------------------------

class CoreClient:
    """memcache_core's DistributedObjectStore."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from memcache_core import DistributedObjectStore, LocalConfig, ReplicateConfig
        cfg = LocalConfig()
        cfg.meta_service_url = spec["meta_service_url"]
        cfg.config_store_url = spec["config_store_url"]
        _bench_nixl().configure(cfg, spec["protocol"])
        cfg.dram_size = SEGMENT
        cfg.log_level = "warning"
        cfg.hcom_url = "tcp://127.0.0.1:0"
        cfg.checksum = spec.get("checksum", True)
        cfg.auth_enable = spec.get("auth", True)
        self._rc = ReplicateConfig
        self.store = DistributedObjectStore()
        if self.store.setup(cfg) != 0 or self.store.init(0, init_bm=True) != 0:
            raise BenchError("LocalService did not start")
        self.ident = self.store.get_local_service_id()

    def register(self, ptr: int, size: int) -> None:
        if self.store.register_buffer(ptr, size) != 0:
            raise BenchError("register_buffer failed")

    def set_checksum(self, on: bool) -> None:
        """Checksums on or off for this process's next puts (computed) and gets (verified)."""
        cfg = self.store._service().config
        cfg.checksum, cfg.checksum_verify_ratio = on, 1.0 if on else 0.0

    def put(self, keys: list[str], pieces: list[list[tuple[int, int]]], peer: Any, replicas: int = 1) -> list[int]:
        rc = None
        if peer is not None or replicas != 1:
            rc = self._rc(replicas)
            rc.preferredLocalServiceIDs = [peer] if peer is not None else []
        return self.store.batch_put_from_layers(keys, [[p for p, _ in ps] for ps in pieces],
                                                [[s for _, s in ps] for ps in pieces], replicateConfig=rc)

    def get(self, keys: list[str], pieces: list[list[tuple[int, int]]]) -> list[int]:
        return self.store.batch_get_into_layers(keys, [[p for p, _ in ps] for ps in pieces],
                                                [[s for _, s in ps] for ps in pieces])

    def put1(self, key: str, ptr: int, size: int) -> int:
        return self.store.put_from(key, ptr, size)

    def get1(self, key: str, ptr: int, size: int) -> int:
        return self.store.get_into(key, ptr, size)

    def exist1(self, key: str) -> int:
        return self.store.is_exist(key)

    def exist(self, keys: list[str]) -> list[int]:
        return self.store.batch_is_exist(keys)

    def remove(self, keys: list[str]) -> None:
        self.store.remove_batch(keys)

    def close(self) -> None:
        self.store.close()


class MooncakeClient:
    """Mooncake Store's MooncakeDistributedStore over its TCP transport (its only CPU transport)."""

    def set_checksum(self, on: bool) -> None:
        """Mooncake Store has no payload checksums: there is nothing to switch."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        self._rc = ReplicateConfig
        self.store = MooncakeDistributedStore()
        self.ident = f"127.0.0.1:{_free_port()}"
        rc = self.store.setup(self.ident, spec["metadata_url"], SEGMENT, 64 << 20, "tcp", "",
                              spec["master_addr"])
        if rc != 0:
            raise BenchError(f"Mooncake setup failed ({rc})")

    def register(self, ptr: int, size: int) -> None:
        if self.store.register_buffer(ptr, size) != 0:
            raise BenchError("register_buffer failed")

    def _config(self, segment: str | None, replicas: int = 1) -> Any:
        rc = self._rc()
        rc.replica_num = replicas
        rc.preferred_segment = segment or self.ident
        return rc

    def put(self, keys: list[str], pieces: list[list[tuple[int, int]]], peer: Any, replicas: int = 1) -> list[int]:
        cfg = self._config(peer, replicas)
        if all(len(ps) == 1 for ps in pieces):
            return self.store.batch_put_from(keys, [ps[0][0] for ps in pieces], [ps[0][1] for ps in pieces], cfg)
        return self.store.batch_put_from_multi_buffers(keys, [[p for p, _ in ps] for ps in pieces],
                                                       [[s for _, s in ps] for ps in pieces], cfg)

    def get(self, keys: list[str], pieces: list[list[tuple[int, int]]]) -> list[int]:
        if all(len(ps) == 1 for ps in pieces):
            got = self.store.batch_get_into(keys, [ps[0][0] for ps in pieces], [ps[0][1] for ps in pieces])
        else:
            got = self.store.batch_get_into_multi_buffers(keys, [[p for p, _ in ps] for ps in pieces],
                                                          [[s for _, s in ps] for ps in pieces])
        return [0 if g == sum(s for _, s in ps) else (g if g < 0 else -1) for g, ps in zip(got, pieces, strict=True)]

    def put1(self, key: str, ptr: int, size: int) -> int:
        return self.store.put_from(key, ptr, size, self._config(None))

    def get1(self, key: str, ptr: int, size: int) -> int:
        got = self.store.get_into(key, ptr, size)
        return 0 if got == size else -1

    def exist1(self, key: str) -> int:
        return self.store.is_exist(key)

    def exist(self, keys: list[str]) -> list[int]:
        return self.store.batch_is_exist(keys)

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k, True)

    def close(self) -> None:
        self.store.close()


# ---- worker process -------------------------------------------------------------------------------

class Worker:
    """One LocalService process: holds a data buffer (source or destination), a reference copy of the
    expected content and a scratch buffer for the memcpy reference."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.client = (MooncakeClient if spec["engine"] == "mooncake" else CoreClient)(spec)
        self.lease_s = spec["lease_ms"] / 1000
        n = spec["max_batch"] * OBJ_BYTES
        self.expected = page_aligned(n, np.random.default_rng(SEED).bytes(n))
        self.data = page_aligned(n, self.expected.tobytes())
        self.scratch = page_aligned(n, bytes(n))
        self.small = page_aligned(SMALL, np.random.default_rng(SEED + 1).bytes(SMALL))
        self.small_dst = page_aligned(SMALL, bytes(SMALL))
        for arr in (self.data, self.small, self.small_dst):
            self.client.register(arr.ctypes.data, arr.nbytes)

    def _batch(self, layout: str, batch: int, prefix: str) -> tuple[list[str], list[list[tuple[int, int]]]]:
        keys = [f"{prefix}/{k}" for k in range(batch)]
        return keys, [pieces_of(layout, self.data.ctypes.data, batch, k) for k in range(batch)]

    def put(self, layout: str, batch: int, rep: int, prefix: str, peer: Any) -> dict[str, Any]:
        ctypes.memmove(self.data.ctypes.data, self.expected.ctypes.data, batch * OBJ_BYTES)  # drop old stamps
        stamp(self.data, layout, batch, rep, tag=1 if peer is None else 2)
        keys, pieces = self._batch(layout, batch, prefix)
        for attempt in range(3):
            f, t = minor_faults(), time.perf_counter()
            codes = self.client.put(keys, pieces, peer)
            dt, f = time.perf_counter() - t, minor_faults() - f
            if attempt < 2 and all(c in (0, *OUT_OF_SPACE) for c in codes) and any(c != 0 for c in codes):
                # objects read moments ago stay leased (their space is freed when the lease ends):
                # drop this batch, wait for the leases and time the put again
                self.client.remove(keys)
                time.sleep(self.lease_s + 0.2)
                continue
            break
        if any(c != 0 for c in codes):
            return {"error": f"put {prefix}: codes {sorted(set(codes))}", "codes": True}
        return {"s": dt, "faults": f, "memcpy_s": memcpy_s(self.scratch, self.expected, batch * OBJ_BYTES),
                "piece_memcpy_s": piece_memcpy_s(pieces, self.scratch.ctypes.data, gather=True)}

    def get(self, layout: str, batch: int, rep: int, prefix: str) -> dict[str, Any]:
        keys, pieces = self._batch(layout, batch, prefix)
        f, t = minor_faults(), time.perf_counter()
        codes = self.client.get(keys, pieces)
        dt, f = time.perf_counter() - t, minor_faults() - f
        if any(c != 0 for c in codes):
            return {"error": f"get {prefix}: codes {sorted(set(codes))}", "codes": True}
        n = batch * OBJ_BYTES
        mc = memcpy_s(self.scratch, self.expected, n)   # the scratch copy then becomes the expected image
        want = self.scratch
        stamp(want, layout, batch, rep, tag=1)
        if not np.array_equal(self.data[:n], want[:n]):
            bad = int(np.flatnonzero(self.data[:n] != want[:n])[0])
            return {"error": f"get {prefix}: bytes differ from what was written (first at offset {bad})"}
        return {"s": dt, "faults": f, "memcpy_s": mc,
                "piece_memcpy_s": piece_memcpy_s(pieces, self.expected.ctypes.data, gather=False)}

    def fill(self, op: str, prefix: str, count: int, peer: Any = None) -> dict[str, Any]:
        """Put (or get, or remove) ``count`` objects, a batch at a time: touches every page of a segment."""
        step = len(self.data) // OBJ_BYTES
        for first in range(0, count, step):
            keys, pieces = self._batch("contiguous", min(step, count - first), f"{prefix}/{first}")
            codes = (self.client.put(keys, pieces, peer) if op == "put" else self.client.get(keys, pieces)
                     if op == "get" else (self.client.remove(keys), [0] * len(keys))[1])
            if any(c != 0 for c in codes):
                return {"error": f"pool warm-up {op} {prefix}: codes {sorted(set(codes))}"}
        return {}

    def remove(self, layout: str, batch: int, prefix: str) -> dict[str, Any]:
        self.client.remove(self._batch(layout, batch, prefix)[0])
        return {}

    def paired(self, op: str, layout: str, batch: int, prefix: str, reps: int) -> dict[str, Any]:
        """Time ``op`` with checksums and without, alternately, on the same objects: per repetition
        the pair ran seconds apart under the same load, so their ratio is a fair cost."""
        keys, pieces = self._batch(layout, batch, prefix)
        on: list[float] = []
        off: list[float] = []
        for rep in range(reps):
            for flag in ((True, False) if rep % 2 else (False, True)):
                self.client.set_checksum(flag)
                if op == "put":
                    k = [f"{key}/{rep}/{int(flag)}" for key in keys]
                    t = time.perf_counter()
                    codes = self.client.put(k, pieces, None)
                    dt = time.perf_counter() - t
                    self.client.remove(k)
                else:
                    t = time.perf_counter()
                    codes = self.client.get(keys, pieces)
                    dt = time.perf_counter() - t
                if any(c != 0 for c in codes):
                    return {"error": f"paired {op} {prefix}: codes {sorted(set(codes))}"}
                (on if flag else off).append(dt)
        self.client.set_checksum(True)
        return {"on": on, "off": off}

    def replica_sets(self, layout: str, batch: int, prefix: str, counts: list[int], op: str) -> dict[str, Any]:
        """Put (op "put") or remove one batch per replica count, unstamped (readers compare with
        ``expected``); the first copy always in the writer's own segment."""
        ctypes.memmove(self.data.ctypes.data, self.expected.ctypes.data, batch * OBJ_BYTES)
        keys, pieces = self._batch(layout, batch, prefix)
        for n in counts:
            k = [f"{key}/n{n}" for key in keys]
            codes = (self.client.put(k, pieces, self.client.ident, n) if op == "put"
                     else (self.client.remove(k), [0])[1])
            if any(c != 0 for c in codes):
                return {"error": f"replica set {prefix} n{n}: codes {sorted(set(codes))}"}
        return {}

    def paired_replicas(self, op: str, layout: str, batch: int, prefix: str, reps: int,
                        counts: list[int]) -> dict[str, Any]:
        """Time ``op`` with each replica count in turn (the order rotates per repetition) on the same
        pieces, so the runs of one repetition are seconds apart under the same load. Puts use new
        keys (removed after); gets read the sets ``replica_sets`` put and are checked byte for byte."""
        ctypes.memmove(self.data.ctypes.data, self.expected.ctypes.data, batch * OBJ_BYTES)
        keys, pieces = self._batch(layout, batch, prefix)
        own = self.client.ident   # the first copy always in the writer's own segment, the others beyond
        times: dict[str, list[float]] = {str(n): [] for n in counts}
        nbytes = batch * OBJ_BYTES
        for rep in range(reps):
            for n in counts[rep % len(counts):] + counts[:rep % len(counts)]:
                k = [f"{key}/n{n}" + (f"/{rep}" if op == "put" else "") for key in keys]
                if op == "get":
                    self.data[:nbytes] = 0
                t = time.perf_counter()
                codes = self.client.put(k, pieces, own, n) if op == "put" else self.client.get(k, pieces)
                times[str(n)].append(time.perf_counter() - t)
                if any(c != 0 for c in codes):
                    return {"error": f"paired replicas {op} {prefix}: codes {sorted(set(codes))}"}
                if op == "put":
                    self.client.remove(k)
                elif not np.array_equal(self.data[:nbytes], self.expected[:nbytes]):
                    return {"error": f"paired replicas get {prefix} n{n}: bytes differ from what was written"}
        return {"s": times}

    def small_ops(self, op: str, prefix: str, n: int) -> dict[str, Any]:
        lat, c = [], self.client
        ptr_s, ptr_d = self.small.ctypes.data, self.small_dst.ctypes.data
        for i in range(n):
            key = f"{prefix}/{i}"
            t = time.perf_counter_ns()
            rc = (c.put1(key, ptr_s, SMALL) if op == "put" else c.get1(key, ptr_d, SMALL) if op == "get"
                  else c.exist1(key) - 1)
            lat.append(time.perf_counter_ns() - t)
            if rc != 0:
                return {"error": f"small {op} {key}: {rc}"}
        if op == "get" and not np.array_equal(self.small, self.small_dst):
            return {"error": "small get: bytes differ from what was written"}
        return {"ns": lat}

    def batch_exist(self, prefix: str, n: int, reps: int) -> dict[str, Any]:
        keys, lat = [f"{prefix}/{i}" for i in range(n)], []
        for _ in range(reps):
            t = time.perf_counter_ns()
            flags = self.client.exist(keys)
            lat.append(time.perf_counter_ns() - t)
            if list(flags) != [1] * n:
                return {"error": f"batch_is_exist: {sum(f == 1 for f in flags)} of {n} keys found"}
        return {"ns": lat}


def _worker_main(conn: Any, spec: dict[str, Any]) -> None:
    try:
        w = Worker(spec)
        conn.send({"ident": w.client.ident})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send({"error": f"worker start: {e!r}"})
        return
    while True:
        cmd, kwargs = conn.recv()
        if cmd == "close":
            w.client.close()
            conn.send({})
            return
        try:
            conn.send(getattr(w, cmd)(**kwargs))
        except Exception as e:  # noqa: BLE001
            conn.send({"error": f"{cmd}: {e!r}"})


class Proc:
    def __init__(self, spec: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
        self.proc.start()
        self.ident = self.wait()["ident"]

    def wait(self) -> dict[str, Any]:
        if not self.conn.poll(300):
            raise BenchError("worker did not answer within 300 s")
        r = self.conn.recv()
        if "error" in r:
            raise (OpFailed if r.get("codes") else BenchError)(r["error"])
        return r

    def call(self, cmd: str, **kwargs: Any) -> dict[str, Any]:
        self.conn.send((cmd, kwargs))
        return self.wait()

    def close(self) -> None:
        try:
            self.conn.send(("close", {}))
            self.conn.poll(20)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---- the pool: MetaService (or Mooncake master) + writer + reader --------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    def __init__(self) -> None:
        exe = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        rpc, meta, metrics = _free_port(), _free_port(), _free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, f"--rpc_port={rpc}", "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={meta}", f"--metrics_port={metrics}"],
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
    spec: dict[str, Any] = {"engine": engine, "protocol": protocol, "max_batch": max(args.batches),
                            "lease_ms": args.lease_ms, "checksum": args.checksum_now, "auth": args.auth_now}
    if engine == "mooncake":
        master = MooncakeMaster()
        spec.update(master.spec)
        stop = master.stop
    else:
        from memcache_core.testing import running_meta_service
        ctx = running_meta_service(log_level="warning", lease_ttl_ms=args.lease_ms, auth_enable=args.auth_now)
        meta = ctx.__enter__()
        spec.update(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url)
        def stop() -> None:
            ctx.__exit__(None, None, None)
    procs: list[Proc] = []
    try:
        writer = Proc(spec)
        procs.append(writer)
        reader = Proc(spec)
        procs.append(reader)
        if not args.cold_pool:
            warm_up_pool(engine, protocol, writer, reader, spec["lease_ms"])
        for layout in args.layouts:
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
                    row = _bandwidth_row(engine, protocol, layout, batch, op, rs)
                    if op == "get" and args.warmup:
                        row["cold_get_gbps"] = round(batch * OBJ_BYTES / cold / 1e9, 3)
                    out.append(row)
                    _print_row(row)
        if args.checksum == "both" and engine == "memcache":
            checksum_cost(protocol, args, writer, reader, out)
        if len(args.replicas) > 1 and engine == "memcache":
            replica_cost(protocol, args, writer, reader, out)
        small = f"{engine}/{protocol}/small"
        res = {"put": writer.call("small_ops", op="put", prefix=small, n=max(args.small_n, 1000)),
               "get": reader.call("small_ops", op="get", prefix=small, n=args.small_n),
               "is_exist": reader.call("small_ops", op="exist", prefix=small, n=args.small_n),
               "batch_is_exist(1000)": reader.call("batch_exist", prefix=small, n=1000, reps=args.exist_reps)}
        for op, r in res.items():
            ns = sorted(r["ns"])
            row = {"engine": engine, "protocol": protocol, "op": op, "n": len(ns),
                   "p50_us": round(ns[len(ns) // 2] / 1e3, 1),
                   "p99_us": round(ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3, 1)}
            out.append(row)
            _print_row(row)
    finally:
        for p in procs:
            p.close()
        stop()


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


def _bandwidth_row(engine: str, protocol: str, layout: str, batch: int, op: str,
                   rs: list[dict[str, Any]]) -> dict[str, Any]:
    nbytes = batch * OBJ_BYTES
    t, mc = statistics.median(r["s"] for r in rs), statistics.median(r["memcpy_s"] for r in rs)
    return {"engine": engine, "protocol": protocol, "layout": layout, "batch": batch, "op": op,
            "gbps": round(nbytes / t / 1e9, 3), "memcpy_gbps": round(nbytes / mc / 1e9, 3),
            "ratio": round(statistics.median(r["memcpy_s"] / r["s"] for r in rs), 3), "ms": round(t * 1e3, 2), "reps": len(rs),
            "piece_ratio": round(statistics.median(r["piece_memcpy_s"] / r["s"] for r in rs), 3),
            "faults_per_mib": round(statistics.median(r["faults"] for r in rs) / (nbytes / (1 << 20)), 1)}


def _print_row(row: dict[str, Any]) -> None:
    if "gbps" in row:
        extra = f"  cold {row['cold_get_gbps']:6.2f} GB/s" if "cold_get_gbps" in row else ""
        print(f"{row['engine']:8} {row['protocol']:8} {row['layout']:10} {row['batch']:>3} {row['op']:9}"
              f" {row['gbps']:7.2f} GB/s  memcpy {row['memcpy_gbps']:6.2f} GB/s  x{row['ratio']:.2f}"
              f"  {row['ms']:8.2f} ms  {row['faults_per_mib']:4.0f} flt/MiB{extra}"
              + (f"  (x{row['piece_ratio']:.2f} of memcpy piece by piece)" if row["layout"] == "layered" else ""),
              flush=True)
    else:
        print(f"{row['engine']:8} {row['protocol']:8} {'4KiB' if 'batch' not in row['op'] else '1000 keys':10}"
              f"     {row['op']:21} p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us  (n={row['n']})",
              flush=True)


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


def print_table(paths: list[str]) -> None:
    """Side by side: one column per (engine, protocol) found in the JSON files of earlier runs."""
    cols: list[tuple[str, str]] = []
    cells: dict[tuple[Any, ...], dict[tuple[str, str], str]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)["results"]
        for r in results:
            col = (r["engine"], r["protocol"])
            if col not in cols:
                cols.append(col)
            if "failed" in r:
                for op in ("put", "put>peer", "get"):
                    cells.setdefault((r["layout"], r["batch"], op), {})[col] = "FAILED"
            elif "gbps" in r:
                key: tuple[Any, ...] = (r["layout"], r["batch"], r["op"])
                cells.setdefault(key, {})[col] = f"{r['gbps']:5.2f} GB/s x{r['ratio']:.2f}"
            else:
                cells.setdefault(("small", 0, r["op"]), {})[col] = f"{r['p50_us']:6.0f} / {r['p99_us']:<6.0f}us"
    head = f"{'layout':10} {'batch':>5} {'op':21}" + "".join(f" | {e + ' ' + p:19}" for e, p in cols)
    print(head + "\n" + "-" * len(head))
    for (layout, batch, op), row in cells.items():
        label = f"{layout:10} {batch:>5} {op:21}" if layout != "small" else f"{'p50 / p99':10} {'':>5} {op:21}"
        print(label + "".join(f" | {row.get(c, '-'):19}" for c in cols))


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
                print(f"plot: {_plot(json.load(f)['results'], args.plot)}")
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
    args.small_n = 300 if args.quick else 2000
    args.exist_reps = 50 if args.quick else 300
    protocols = ["host_tcp"] if args.engine == "mooncake" else (
        ["host_shm", "host_tcp"] if args.protocol == "all" else [args.protocol])
    if args.transfer_engine == "nixl" and args.engine == "memcache":
        nixl_protocols = _bench_nixl().prepare(args.protocol)
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
        print(f"plot: {_plot(out, args.plot)}")
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


def _bench_nixl() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_nixl
    return bench_nixl


def _plot(rows: list[dict[str, Any]], path: str) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plots
    return plots.bandwidth(rows, path, f"object {OBJ_BYTES // KIB} KiB; medians")


if __name__ == "__main__":
    sys.exit(main())
