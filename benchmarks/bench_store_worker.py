"""``bench_store.py``'s worker processes: the worker that times operations (through the engine adapters
of ``bench_store_engines.py``), and ``Proc``, the parent's handle on one worker (spawned)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_store_common import (
    OBJ_BYTES,
    OUT_OF_SPACE,
    SEED,
    SMALL,
    BenchError,
    OpFailed,
    cpu_split,
    memcpy_s,
    minor_faults,
    page_aligned,
    piece_memcpy_s,
    pieces_of,
    pool_cpu_ns,
    stamp,
)
from bench_store_engines import CoreClient, Layers, MooncakeClient, moved

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

    def hello(self) -> dict[str, Any]:
        return {"ident": self.client.ident}

    def close(self) -> None:
        self.client.close()

    def _batch(self, layout: str, batch: int, prefix: str) -> tuple[list[str], Layers]:
        keys = [f"{prefix}/{k}" for k in range(batch)]
        return keys, Layers(pieces_of(layout, self.data.ctypes.data, batch, k) for k in range(batch))

    def put(self, layout: str, batch: int, rep: int, prefix: str, peer: Any) -> dict[str, Any]:
        ctypes.memmove(self.data.ctypes.data, self.expected.ctypes.data, batch * OBJ_BYTES)  # drop old stamps
        stamp(self.data, layout, batch, rep, tag=1 if peer is None else 2)
        keys, pieces = self._batch(layout, batch, prefix)
        for attempt in range(3):
            before = self.client.paths()
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
                "piece_memcpy_s": piece_memcpy_s(pieces, self.scratch.ctypes.data, gather=True),
                "paths": moved(before, self.client.paths(), "write")}

    def get(self, layout: str, batch: int, rep: int, prefix: str) -> dict[str, Any]:
        keys, pieces = self._batch(layout, batch, prefix)
        before = self.client.paths()
        f, t = minor_faults(), time.perf_counter()
        codes = self.client.get(keys, pieces)
        dt, f = time.perf_counter() - t, minor_faults() - f
        paths = moved(before, self.client.paths(), "read")
        if any(c != 0 for c in codes):
            return {"error": f"get {prefix}: codes {sorted(set(codes))}", "codes": True}
        n = batch * OBJ_BYTES
        mc = memcpy_s(self.scratch, self.expected, n)   # the scratch copy then becomes the expected image
        want = self.scratch
        stamp(want, layout, batch, rep, tag=1)
        if not np.array_equal(self.data[:n], want[:n]):
            bad = int(np.flatnonzero(self.data[:n] != want[:n])[0])
            return {"error": f"get {prefix}: bytes differ from what was written (first at offset {bad})"}
        return {"s": dt, "faults": f, "memcpy_s": mc, "paths": paths,
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

    def small_ops(self, op: str, prefix: str, n: int, pool: dict[str, int] | None = None) -> dict[str, Any]:
        """``n`` 4 KiB puts, gets or is_exist calls, one at a time: each one's latency, and the CPU time
        per op of every process of ``pool`` (name -> pid), read right before and after the loop."""
        lat, c = [], self.client
        ptr_s, ptr_d = self.small.ctypes.data, self.small_dst.ctypes.data
        cpu0 = pool_cpu_ns(pool or {})
        for i in range(n):
            key = f"{prefix}/{i}"
            t = time.perf_counter_ns()
            rc = (c.put1(key, ptr_s, SMALL) if op == "put" else c.get1(key, ptr_d, SMALL) if op == "get"
                  else c.exist1(key) - 1)
            lat.append(time.perf_counter_ns() - t)
            if rc != 0:
                return {"error": f"small {op} {key}: {rc}"}
        cpu = cpu_split(cpu0, pool_cpu_ns(pool or {}), n)
        if op == "get" and not np.array_equal(self.small, self.small_dst):
            return {"error": "small get: bytes differ from what was written"}
        return {"ns": lat, "cpu_us": cpu}

    def batch_exist(self, prefix: str, n: int, reps: int, pool: dict[str, int] | None = None) -> dict[str, Any]:
        keys, lat = [f"{prefix}/{i}" for i in range(n)], []
        cpu0 = pool_cpu_ns(pool or {})
        for _ in range(reps):
            t = time.perf_counter_ns()
            flags = self.client.exist(keys)
            lat.append(time.perf_counter_ns() - t)
            if list(flags) != [1] * n:
                return {"error": f"batch_is_exist: {sum(f == 1 for f in flags)} of {n} keys found"}
        return {"ns": lat, "cpu_us": cpu_split(cpu0, pool_cpu_ns(pool or {}), reps)}


def serve(conn: Any, make: Callable[[dict[str, Any]], Any], spec: dict[str, Any]) -> None:
    """A spawned worker's loop: build ``make(spec)``, answer its ``hello()``, then run the parent's
    commands (method name and keyword arguments) until ``close``; errors go back as ``{"error": ...}``."""
    try:
        w = make(spec)
        conn.send(w.hello())
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send({"error": f"worker start: {e!r}"})
        return
    while True:
        cmd, kwargs = conn.recv()
        if cmd == "close":
            w.close()
            conn.send({})
            return
        try:
            conn.send(getattr(w, cmd)(**kwargs))
        except Exception as e:  # noqa: BLE001
            conn.send({"error": f"{cmd}: {e!r}"})


def _worker_main(conn: Any, spec: dict[str, Any]) -> None:
    serve(conn, Worker, spec)


class Proc:
    """A spawned worker process (``target`` runs ``serve`` with its Worker class)."""

    def __init__(self, spec: dict[str, Any], target: Callable[[Any, dict[str, Any]], None] = _worker_main) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, spec), daemon=True)
        self.proc.start()
        self.ident = self.wait().get("ident")

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
