#!/usr/bin/env python3
"""A stand-in engine for ``one_machine.py``: joins the pool as a client (``dram_size`` 0, no memory of
its own), writes or reads ``N`` KV pages shaped like an engine's (61 layers x 2 pieces), and exits.

    python examples/deploy/engine_client.py POOL.json write|read N

It reads the pool file as a real engine reads its ``config_path``: the file's ``LocalConfig`` keys,
under the keys an engine gives inline (here ``dram_size`` 0 over the providers' size).

Page bytes are derived from the page's key, so a reader in another process checks every byte.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from memcache_core import DistributedObjectStore
from memcache_core.config import LocalConfig, apply_dict, file_values

INLINE = {"dram_size": 0, "client_timeout_seconds": 5}   # a client, which gives up on a dead peer soon
LAYOUT = [32 << 10] * 61 + [4 << 10] * 61      # per layer: K 32 KiB + V 4 KiB
PAGE = sum(LAYOUT)


def page_bytes(key: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


def main() -> int:
    config, op, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = DistributedObjectStore()
    assert store.setup(apply_dict(LocalConfig(), {**file_values(LocalConfig, config), **INLINE}, source=config)) == 0
    assert store.init(0, init_bm=False) == 0           # a client: the providers hold the pages
    keys = [f"deploy-demo/page-{i}" for i in range(n)]
    buf = np.zeros(PAGE * n, np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    offsets = np.cumsum([0, *LAYOUT[:-1]])
    ptrs = [[buf.ctypes.data + i * PAGE + int(o) for o in offsets] for i in range(n)]
    try:
        if op == "write":
            for i, k in enumerate(keys):
                buf[i * PAGE:(i + 1) * PAGE] = page_bytes(k)
            codes = store.batch_put_from_layers(keys, ptrs, [LAYOUT] * n)
            print(f"  engine: wrote {codes.count(0)} of {n} pages")
            return 0 if codes == [0] * n else 1
        codes = store.batch_get_into_layers(keys, ptrs, [LAYOUT] * n)
        exact = sum(c == 0 and np.array_equal(buf[i * PAGE:(i + 1) * PAGE], page_bytes(k))
                    for i, (k, c) in enumerate(zip(keys, codes, strict=True)))
        print(f"  engine: found {exact} of {n} pages, byte-exact")
        return 0 if exact == n else 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
