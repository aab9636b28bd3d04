#!/usr/bin/env python3
"""The GVA path (layer by layer) against whole-object puts and gets, on DeepSeek-R1-shaped blocks.

A MetaService, a provider process holding the pool (``memcache local-service``), and this process as a
pure client (no segment), so every copy crosses processes: through shared memory (``host_shm``) or the
provider's data server (``host_tcp``). Per batch of B blocks (61 layers x (128 KiB + 16 KiB), 8,784 KiB):

* put        ``batch_put_from_layers``: all 122 pieces of every block in one call;
* gva save   ``batch_alloc``, ``batch_get_key_info``, one ``batch_copy`` per layer piece (122 calls, each
             with one slice of every block, as a layer-wise connector saves as layers are computed),
             ``batch_write_finish``;
* get        ``batch_get_into_layers``;
* gva load   ``batch_get_key_info``, ``batch_add_lease``, 122 ``batch_copy`` calls, ``batch_remove_lease``;

and the same bytes with one ``memmove`` for reference. The copies run on grants given at ``batch_alloc`` and
``batch_add_lease`` (no round trip per copy while they last: docs/design.md "The GVA path"), and the finish
writes only the header. Figures are medians over ``--reps``; every read is checked byte for byte (a mismatch
or a failed call aborts with a non-zero exit).

    python benchmarks/bench_gva.py --protocols host_shm,host_tcp --batches 1,8 --reps 5
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from memcache_core import G2H, H2G, DistributedObjectStore, LocalConfig  # noqa: E402
from memcache_core.config import HostProtocol  # noqa: E402
from memcache_core.testing import running_meta_service, start_local_service, terminate, wait_for  # noqa: E402

LAYOUT = [128 << 10] * 61 + [16 << 10] * 61
OBJ = sum(LAYOUT)
STARTS = np.cumsum([0, *LAYOUT]).tolist()


def check(what: str, codes: object) -> None:
    flat = codes if isinstance(codes, list) else [codes]
    if any(c != 0 for c in flat):
        raise SystemExit(f"{what} failed: {codes}")


def run(protocol: HostProtocol, batches: list[int], reps: int, ms_url: str, cs_url: str, used: Callable[[], int]) -> None:
    store = DistributedObjectStore()
    cfg = LocalConfig(meta_service_url=ms_url, config_store_url=cs_url, protocol=protocol, dram_size="0")
    check("setup", store.setup(cfg))
    check("init", store.init(0, False))
    top = max(batches)
    src = np.random.default_rng(1).integers(0, 256, OBJ * top, dtype=np.uint8)
    dst = np.zeros_like(src)
    for buf in (src, dst):
        check("register", store.register_buffer(buf.ctypes.data, buf.nbytes))
    try:
        for b in batches:
            times: dict[str, list[float]] = {k: [] for k in ("put", "gva save", "get", "gva load", "memcpy")}
            for rep in range(reps):
                keys = [f"{protocol}-{b}-{rep}-{i}" for i in range(b)]
                gkeys = [f"g{k}" for k in keys]
                ptrs = [[src.ctypes.data + i * OBJ + s for s in STARTS[:-1]] for i in range(b)]
                sizes = [list(LAYOUT)] * b
                t = time.perf_counter()
                check("put", store.batch_put_from_layers(keys, ptrs, sizes))
                times["put"].append(time.perf_counter() - t)
                t = time.perf_counter()
                check("batch_alloc", store.batch_alloc(gkeys, [OBJ] * b))
                gvas = [i.gva_list()[0] for i in store.batch_get_key_info(gkeys, 1)]
                for j, n in enumerate(LAYOUT):
                    check("batch_copy", store.batch_copy([g + STARTS[j] for g in gvas], [p[j] for p in ptrs],
                                                         [n] * b, H2G))
                check("batch_write_finish", store.batch_write_finish(gkeys, [0] * b))
                times["gva save"].append(time.perf_counter() - t)
                dptrs = [[dst.ctypes.data + i * OBJ + s for s in STARTS[:-1]] for i in range(b)]
                for name, ks in (("get", keys), ("gva load", gkeys)):
                    dst[: OBJ * b] = 0
                    t = time.perf_counter()
                    if name == "get":
                        check("get", store.batch_get_into_layers(ks, dptrs, sizes))
                    else:
                        gvas = [i.gva_list()[0] for i in store.batch_get_key_info(ks, 1)]
                        check("batch_add_lease", store.batch_add_lease(ks, 5_000))   # outlives the 122 copies
                        for j, n in enumerate(LAYOUT):
                            check("batch_copy", store.batch_copy([g + STARTS[j] for g in gvas],
                                                                 [p[j] for p in dptrs], [n] * b, G2H))
                        check("batch_remove_lease", store.batch_remove_lease(ks))
                    times[name].append(time.perf_counter() - t)
                    if not np.array_equal(dst[: OBJ * b], src[: OBJ * b]):
                        raise SystemExit(f"{name}: the bytes read differ from those written")
                t = time.perf_counter()
                ctypes.memmove(dst.ctypes.data, src.ctypes.data, OBJ * b)
                times["memcpy"].append(time.perf_counter() - t)
                check("remove", store.remove_batch(keys + gkeys))
                wait_for(lambda: used() == 0, 30, "the removed objects' space (freed when their leases end)")
            mib = OBJ * b / (1 << 20)
            cells = "  ".join(f"{k} {statistics.median(v) * 1e3:8.2f} ms {mib / statistics.median(v) / 1024:6.2f} GiB/s"
                              for k, v in times.items())
            print(f"{protocol:9s} batch {b:3d}  {cells}", flush=True)
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocols", default="host_shm,host_tcp")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    with running_meta_service(lease_ttl_ms=500) as ms, tempfile.TemporaryDirectory() as d:
        for protocol in args.protocols.split(","):
            conf = {"meta_service_url": ms.meta_service_url, "config_store_url": ms.config_store_url,
                    "protocol": protocol, "dram_size": f"{max(batches) * 24 + 64}MB"}
            provider, _ = start_local_service(conf, d, lambda: ms.http("/get_all_segments")["segments"],
                                              name=f"provider-{protocol}")
            try:
                run(protocol, batches, args.reps, ms.meta_service_url, ms.config_store_url,
                    lambda: int(ms.http("/api/v1/capacity/usage")["used_bytes"]))
            finally:
                terminate(provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
