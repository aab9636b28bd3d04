"""One process of the invariant checker: random batched puts, gets, exists and removes, every read
checked byte for byte.

Payloads describe themselves: ``(key hash, writer, sequence, size)`` then bytes derived from those,
so a reader proves that what it got is one whole put of that very key, without asking anyone. Every
put is logged (before it starts) to ``<out>.puts``, so the test can check that each read payload was
put under that key by someone, even by a process that was killed later.

Usage: chaos_worker.py CONFIG_JSON OUT_PREFIX SECONDS
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time

import numpy as np

from memcache_core import DistributedObjectStore, LocalConfig, ReplicateConfig
from memcache_core.config import apply_dict

HEAD = struct.Struct("<QQQQ")      # key hash, writer, sequence, size
KEYS = 600
BATCH = 16


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def size_of(i: int) -> int:
    return 16384 * (1 + i % 8)


def layout(size: int) -> list[int]:
    return [size // 2, size // 4, size - size // 2 - size // 4]


def fill(key: str, writer: int, seq: int, n: int) -> np.ndarray:
    seed = hashlib.blake2b(f"{key}|{writer}|{seq}".encode(), digest_size=64).digest()
    reps = -(-n // 64)
    return np.frombuffer(seed * reps, np.uint8)[:n]


class Worker:
    def __init__(self, cfg: dict, out: str) -> None:
        init_bm = cfg.pop("init_bm", True)
        self.replicas = ReplicateConfig(cfg.pop("replicas", 1))
        self.store = DistributedObjectStore()
        assert self.store.setup(apply_dict(LocalConfig(), cfg)) == 0
        rc = self.store.init(0, init_bm)
        if rc != 0:
            raise SystemExit(f"init failed: {rc}")
        self.writer = int.from_bytes(os.urandom(8), "little") >> 1
        self.seq = 0
        self.rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        self.buf = np.zeros(BATCH * size_of(7), np.uint8)
        assert self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes) == 0
        self.puts_log = open(out + ".puts", "a", encoding="ascii")  # noqa: SIM115 - closed in run()
        self.out = out
        self.stats = {"verified": 0, "misses": 0, "put_ok": 0, "put_failed": 0, "exists": 0, "removes": 0}
        self.wrong: list[str] = []
        self.read: set[tuple[str, int, int]] = set()

    def _batch(self) -> tuple[list[str], list[list[int]], list[list[int]], list[int]]:
        idx = sorted(set(self.rng.integers(0, KEYS, BATCH).tolist()))
        keys, ptrs, sizes, offs = [], [], [], []
        pos = 0
        for i in idx:
            lay = layout(size_of(i))
            keys.append(f"chaos-{i}")
            p = self.buf.ctypes.data + pos
            ptrs.append([p, p + lay[0], p + lay[0] + lay[1]])
            sizes.append(lay)
            offs.append(pos)
            pos += sum(lay)
        return keys, ptrs, sizes, offs

    def put(self) -> None:
        keys, ptrs, sizes, offs = self._batch()
        for k, lay, off in zip(keys, sizes, offs, strict=True):
            self.seq += 1
            n = sum(lay)
            self.buf[off:off + HEAD.size] = np.frombuffer(HEAD.pack(key_hash(k), self.writer, self.seq, n), np.uint8)
            self.buf[off + HEAD.size:off + n] = fill(k, self.writer, self.seq, n - HEAD.size)
            self.puts_log.write(f"{k} {self.writer} {self.seq}\n")
        self.puts_log.flush()
        for c in self.store.batch_put_from_layers(keys, ptrs, sizes, replicateConfig=self.replicas):
            self.stats["put_ok" if c == 0 else "put_failed"] += 1

    def get(self) -> None:
        keys, ptrs, sizes, offs = self._batch()
        self.buf[:] = 0xEE
        codes = self.store.batch_get_into_layers(keys, ptrs, sizes)
        for k, lay, off, c in zip(keys, sizes, offs, codes, strict=True):
            if c != 0:
                self.stats["misses"] += 1
                continue
            n = sum(lay)
            kh, writer, seq, size = HEAD.unpack(self.buf[off:off + HEAD.size].tobytes())
            ok = (kh == key_hash(k) and size == n
                  and np.array_equal(self.buf[off + HEAD.size:off + n], fill(k, writer, seq, n - HEAD.size)))
            if ok:
                self.stats["verified"] += 1
                self.read.add((k, writer, seq))
            else:
                self.wrong.append(f"{k}: header {(kh, writer, seq, size)} (key hash {key_hash(k)}, size {n})")

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        ops = [self.put] * 7 + [self.get] * 10 + [self.exist] * 2 + [self.remove]
        try:
            while time.monotonic() < deadline and not os.path.exists(self.out + ".stop"):
                ops[int(self.rng.integers(0, len(ops)))]()
        finally:
            self.puts_log.close()
            with open(self.out + ".json", "w", encoding="ascii") as f:
                json.dump({"stats": self.stats, "wrong": self.wrong[:50], "wrong_count": len(self.wrong),
                           "read": sorted(self.read), "paths": self.paths()}, f)
            self.store.close()

    def paths(self) -> dict[str, float]:
        """Payload bytes moved per transfer path and direction, e.g. ``nixl/read``."""
        reg = self.store._service().metrics.registry
        return {f"{s.labels['path']}/{s.labels['direction']}": s.value for m in reg.collect()
                if m.name == "memcache_local_transfer_bytes" for s in m.samples if s.name.endswith("_total")}

    def exist(self) -> None:
        keys, *_ = self._batch()
        self.store.batch_is_exist(keys)
        self.stats["exists"] += 1

    def remove(self) -> None:
        keys, *_ = self._batch()
        self.store.remove_batch(keys[:2])
        self.stats["removes"] += 1


def main() -> None:
    cfg, out, seconds = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    Worker(cfg, out).run(seconds)


if __name__ == "__main__":
    main()
