"""A LocalService in its own process, driven by JSON lines on stdin (one answer line per command).

Payloads are derived from the key (``pattern``), so any process can check any object byte for byte
without the bytes travelling through the test; a put with a ``version`` derives them from the key and
the version, and ``get_versions`` says which version each read returned.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import sys
import time

import numpy as np

from memcache_core import G2H, H2G, DistributedObjectStore, LocalConfig, ReplicateConfig
from memcache_core.config import apply_dict

# a test that wants the LocalService's own account (joins, re-joins, scans) in its failure output
if os.environ.get("MEMCACHE_TEST_STORE_LOG_LEVEL"):
    logging.basicConfig(level=os.environ["MEMCACHE_TEST_STORE_LOG_LEVEL"], stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def versioned(key: str, version: int | None) -> str:
    return key if version is None else f"{key}@v{version}"


def digest(data: np.ndarray) -> str:
    """A short digest of bytes, to compare what two processes read without sending the bytes."""
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def pattern(key: str, n: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Worker:
    def __init__(self, cfg: dict, init_bm: bool) -> None:
        self.store = DistributedObjectStore()
        rc = self.store.setup(apply_dict(LocalConfig(), cfg))
        if rc == 0:
            rc = self.store.init(0, init_bm)
        self.rc = rc
        self.buf = np.zeros(0, np.uint8)
        self.stopped_at: list[int] = []

    def _buffer(self, n: int) -> np.ndarray:
        if self.buf.nbytes < n:
            if self.buf.nbytes:
                assert self.store.unregister_buffer(self.buf.ctypes.data, self.buf.nbytes) == 0
            self.buf = np.zeros(n, np.uint8)
            assert self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes) == 0
        return self.buf

    def _layout(self, keys: list[str], layout: list[int], gap: int = 0) -> tuple[list[list[int]], list[list[int]], int]:
        """Each key's pieces in turn, ``gap`` bytes after each piece (0: objects are contiguous)."""
        per = sum(layout) + gap * len(layout)
        buf = self._buffer(per * len(keys))
        base = buf.ctypes.data
        ptrs, sizes = [], []
        for i in range(len(keys)):
            off = base + i * per
            ps = []
            for s in layout:
                ps.append(off)
                off += s + gap
            ptrs.append(ps)
            sizes.append(list(layout))
        return ptrs, sizes, per

    def _gather(self, ptrs: list[int], sizes: list[int]) -> np.ndarray:
        base = self.buf.ctypes.data
        return np.concatenate([self.buf[p - base:p - base + n] for p, n in zip(ptrs, sizes, strict=True)])

    def _scatter(self, ptrs: list[int], sizes: list[int], data: np.ndarray) -> None:
        base, pos = self.buf.ctypes.data, 0
        for p, n in zip(ptrs, sizes, strict=True):
            self.buf[p - base:p - base + n] = data[pos:pos + n]
            pos += n

    def put(self, keys: list[str], layout: list[int], replicas: int = 1, preferred: list[int] | None = None,
            gap: int = 0, version: int | None = None) -> dict:
        ptrs, sizes, per = self._layout(keys, layout, gap)
        for i, k in enumerate(keys):
            self._scatter(ptrs[i], sizes[i], pattern(versioned(k, version), sum(layout)))
        rc = ReplicateConfig(replicas, preferred or [])
        t = time.perf_counter()
        codes = self.store.batch_put_from_layers(keys, ptrs, sizes, replicateConfig=rc)
        return {"codes": codes, "seconds": time.perf_counter() - t}

    def get(self, keys: list[str], layout: list[int], gap: int = 0) -> dict:
        """Read into the layout; the bytes between and after the pieces must stay untouched (0xEE)."""
        ptrs, sizes, per = self._layout(keys, layout, gap)
        self.buf[: per * len(keys)] = 0xEE
        t = time.perf_counter()
        codes = self.store.batch_get_into_layers(keys, ptrs, sizes)
        dt = time.perf_counter() - t
        bad = [k for i, (k, c) in enumerate(zip(keys, codes, strict=False)) if c == 0
               and not np.array_equal(self._gather(ptrs[i], sizes[i]), pattern(k, sum(layout)))]
        if gap:
            self._scatter([p for ps in ptrs for p in ps], [n for ns in sizes for n in ns],
                          np.full(sum(layout) * len(keys), 0xEE, np.uint8))
            if not np.all(self.buf[:per * len(keys)] == 0xEE):
                bad.append("bytes outside the pieces were written")
        return {"codes": codes, "mismatches": bad, "seconds": dt}

    def gva_save(self, keys: list[str], layout: list[int], results: list[int] | None = None,
                 order: list[int] | None = None, garbage_first: bool = False, whole: bool = False) -> dict:
        """The GVA path's save, as vllm-ascend's layer-wise connector does it: alloc, info, one
        ``batch_copy`` per layer (each key's slice at its offset in the object), finish. ``order``:
        the layers' order (default: first to last); ``garbage_first``: layer 0 is first written with
        other bytes, then again with the right ones; ``whole``: one ``batch_copy_layers`` of every piece
        instead (the copy loop hashes the whole object)."""
        ptrs, sizes, _ = self._layout(keys, layout)
        alloc = self.store.batch_alloc(keys, [sum(layout)] * len(keys))
        gvas = [(i.gva_list() or [0])[0] for i in self.store.batch_get_key_info(keys, 1)]
        starts = np.cumsum([0, *layout]).tolist()
        if garbage_first:
            for ps in ptrs:
                self.buf[ps[0] - self.buf.ctypes.data:ps[0] - self.buf.ctypes.data + layout[0]] = 0x5A
            self.store.batch_copy(gvas, [ps[0] for ps in ptrs], [layout[0]] * len(keys), H2G)
        for i, k in enumerate(keys):
            self._scatter(ptrs[i], sizes[i], pattern(k, sum(layout)))
        if whole:
            copies = [self.store.batch_copy_layers(gvas, ptrs, sizes, H2G)]
        else:
            copies = [self.store.batch_copy([g + starts[j] for g in gvas], [ps[j] for ps in ptrs],
                                            [layout[j]] * len(keys), H2G)
                      for j in (order if order is not None else range(len(layout)))]
        finish = self.store.batch_write_finish(keys, results or [0] * len(keys))
        return {"alloc": alloc, "gvas": gvas, "copies": copies, "finish": finish}

    def gva_load(self, keys: list[str], layout: list[int], lease_ms: int = 60_000, layers: bool = False,
                 unlease: bool = True) -> dict:
        """The GVA path's load: info, lease, one ``batch_copy`` per layer (or one ``batch_copy_layers``
        of every piece), unlease; keys read with code 0 whose bytes differ are ``mismatches``."""
        ptrs, sizes, per = self._layout(keys, layout)
        self.buf[: per * len(keys)] = 0xEE
        infos = self.store.batch_get_key_info(keys, 1)
        gvas = [(i.gva_list() or [0])[0] for i in infos]
        lease = self.store.batch_add_lease(keys, lease_ms)
        starts = np.cumsum([0, *layout]).tolist()
        if layers:
            copies = [self.store.batch_copy_layers(gvas, ptrs, sizes, G2H)]
        else:
            copies = [self.store.batch_copy([g + starts[j] for g in gvas], [ps[j] for ps in ptrs],
                                            [n] * len(keys), G2H) for j, n in enumerate(layout)]
        bad = [k for i, k in enumerate(keys) if not np.array_equal(self._gather(ptrs[i], sizes[i]),
                                                                    pattern(k, sum(layout)))]
        done = self.store.batch_remove_lease(keys) if unlease else None
        return {"sizes": [i.size() for i in infos], "gvas": gvas, "lease": lease, "copies": copies,
                "unlease": done, "mismatches": bad if all(c == 0 for c in copies) else None}

    def gva_copy(self, gvas: list[int], size: int, direct: int, fill: int = 0) -> dict:
        """One ``batch_copy`` of ``size`` bytes per GVA between the buffer (filled with ``fill`` for a
        write) and the pool; a read returns the bytes' distinct values and their ``digest``."""
        buf = self._buffer(size * len(gvas))
        buf[: size * len(gvas)] = fill
        base = buf.ctypes.data
        code = self.store.batch_copy(gvas, [base + i * size for i in range(len(gvas))], [size] * len(gvas), direct)
        return {"code": code, "values": sorted(set(buf[: size * len(gvas)].tolist())),
                "digest": digest(buf[: size * len(gvas)])}

    def get_versions(self, keys: list[str], layout: list[int], upto: int) -> dict:
        """Read each key; ``versions``: the version 0..upto whose bytes it read (None: a miss, -1: bytes
        of no version)."""
        ptrs, sizes, _ = self._layout(keys, layout)
        codes = self.store.batch_get_into_layers(keys, ptrs, sizes)
        versions: list[int | None] = []
        for i, (k, c) in enumerate(zip(keys, codes, strict=True)):
            got = self._gather(ptrs[i], sizes[i]) if c == 0 else None
            versions.append(None if got is None else next(
                (v for v in range(upto, -1, -1) if np.array_equal(got, pattern(versioned(k, v), sum(layout)))), -1))
        return {"codes": codes, "versions": versions}

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "put":
            return self.put(cmd["keys"], cmd["layout"], cmd.get("replicas", 1), cmd.get("preferred"),
                            cmd.get("gap", 0), cmd.get("version"))
        if op == "get":
            return self.get(cmd["keys"], cmd["layout"], cmd.get("gap", 0))
        if op == "get_versions":
            return self.get_versions(cmd["keys"], cmd["layout"], cmd["upto"])
        if op == "exist":
            return {"codes": self.store.batch_is_exist(cmd["keys"])}
        if op == "remove":
            return {"codes": self.store.remove_batch(cmd["keys"])}
        if op == "connects":   # connections to the MetaService opened so far (a new one voids GVA grants)
            return {"connects": self.store._service().rpc.connects}
        if op == "gva_save":
            return self.gva_save(cmd["keys"], cmd["layout"], cmd.get("results"), cmd.get("order"),
                                 cmd.get("garbage_first", False), cmd.get("whole", False))
        if op == "gva_load":
            return self.gva_load(cmd["keys"], cmd["layout"], cmd.get("lease_ms", 60_000), cmd.get("layers", False),
                                 cmd.get("unlease", True))
        if op == "gva_copy":
            return self.gva_copy(cmd["gvas"], cmd["size"], cmd["direct"], cmd.get("fill", 0))
        if op == "gva_info":
            infos = self.store.batch_get_key_info(cmd["keys"], 1)
            return {"sizes": [i.size() for i in infos], "gvas": [i.gva_list() for i in infos]}
        if op == "call":   # a GVA-path call whose arguments and result are plain JSON
            assert cmd["method"] in ("batch_alloc", "batch_write_finish", "batch_add_lease", "batch_remove_lease")
            return {"result": getattr(self.store, cmd["method"])(*cmd["args"])}
        if op == "stop_before_write":   # fault injection: the next write stops this process (SIGSTOP) after
            engine = self.store._service().engine   # every check of the caller, before a byte moves
            assert engine is not None
            real = engine.write

            def stop_then_write(ops):
                engine.write = real   # type: ignore[method-assign]
                self.stopped_at = [op.offset for op in ops]   # where the write goes (``stopped_at``)
                os.kill(os.getpid(), signal.SIGSTOP)
                return real(ops)

            engine.write = stop_then_write   # type: ignore[method-assign]
            return {}
        if op == "stopped_at":
            return {"offsets": self.stopped_at}
        if op == "id":
            return {"id": self.store.get_local_service_id()}
        if op == "paths":   # payload bytes moved per transfer path and direction, e.g. "nixl/read"
            reg = self.store._service().metrics.registry
            return {f"{s.labels['path']}/{s.labels['direction']}": s.value for m in reg.collect()
                    if m.name == "memcache_local_transfer_bytes" for s in m.samples if s.name.endswith("_total")}
        if op == "prefetch":
            return {"codes": self.store.prefetch(cmd["keys"])}
        if op == "pool_has_disk_tier":
            return {"value": self.store.pool_has_disk_tier()}
        if op == "evict":
            return {"codes": self.store.evict(cmd["keys"])}
        if op == "key_info":
            return {"media": [i.type_list() for i in self.store.batch_get_key_info(cmd["keys"])]}
        if op == "disk_counters":
            disk = self.store._service().disk   # a test probe of the provider's disk tier
            return {"counters": disk.counters() if disk is not None else None}
        if op == "close":
            t = time.perf_counter()
            return {"rc": self.store.close(), "seconds": time.perf_counter() - t}
        raise ValueError(f"unknown op {op}")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    init_bm = cfg.pop("init_bm", True)
    seed = cfg.pop("seed_random", None)
    fsize = cfg.pop("file_size_limit", None)
    if seed is not None:
        random.seed(seed)      # as vLLM and SGLang do in every worker process
    w = Worker(cfg, init_bm)
    if fsize is not None:   # a full disk: files may not grow past this (the segment exists already)
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    print(json.dumps({"ready": w.rc == 0, "rc": w.rc}), flush=True)
    if w.rc != 0:
        return
    for line in sys.stdin:
        try:
            out = w.handle(json.loads(line))
        except Exception as e:  # noqa: BLE001 - report to the test
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
        if out.get("rc") == 0 and line.find('"close"') >= 0:
            break


if __name__ == "__main__":
    main()
