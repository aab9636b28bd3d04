"""``bench_store.py``'s shared pieces: the workload's constants, its errors, and the buffer layouts both
worker processes build (so the reader can rebuild what the writer wrote) with the memcpy references."""

from __future__ import annotations

import ctypes
import os
import resource
import socket
import sys
import time
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



def load_bench_nixl() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_nixl
    return bench_nixl


def process_cpu_ns(pid: int, seen: set[int] | None = None) -> int:
    """On-CPU nanoseconds so far of process ``pid`` (all its threads, those that ended included) and of
    its descendants: the kernel's exact scheduler count, read through the process's CPU clock (Linux
    lets any process read another's; /proc/<pid>/stat's utime+stime is the same sum cut to 10 ms
    clock ticks). 0 for a process that is gone."""
    seen = set() if seen is None else seen
    if pid <= 0 or pid in seen:
        return 0
    seen.add(pid)
    try:
        total = time.clock_gettime_ns(((~pid) << 3) | 2)   # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                children = [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        total += sum(process_cpu_ns(c, seen) for c in children)
    return total


def pool_cpu_ns(pool: dict[str, int]) -> dict[str, int]:
    """On-CPU ns so far of each named process of the pool (its threads and its children included)."""
    return {name: process_cpu_ns(pid) for name, pid in pool.items()}


def cpu_split(before: dict[str, int], after: dict[str, int], ops: int) -> dict[str, float]:
    """CPU µs per operation per process between two ``pool_cpu_ns`` readings, and their sum ("all")."""
    per = {name: round((after[name] - before[name]) / ops / 1e3, 1) for name in before}
    return {"all": round(sum(after[n] - before[n] for n in before) / ops / 1e3, 1), **per}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
