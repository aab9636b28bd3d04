"""The SGLang backend's v1 page IO (``memcache_sglang.kv_pool``) on a real pool, without SGLang: pages
of two pieces move between registered host memory and the pool byte-exact; a page with a missing
object is a miss, existence counts leading pages only, and a failure to list the pieces is a miss."""

from __future__ import annotations

import numpy as np
from memcache_sglang import kv_pool

from memcache_core import DistributedObjectStore
from memcache_core.testing import MetaServiceProcess

PIECE = 4096   # two pieces (K and V) per page object


def _pieces(buf: np.ndarray, pages: int) -> tuple[list[int], list[int]]:
    return [buf.ctypes.data + i * PIECE for i in range(2 * pages)], [PIECE] * (2 * pages)


def _fail() -> kv_pool.Objects:
    raise ValueError("the host pool cannot list these pages")


def test_pages_round_trip_byte_exact_and_misses_are_per_page(meta: MetaServiceProcess) -> None:
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(dram_size="16MB")) == 0 and store.init(0, True) == 0
    try:
        src = np.random.default_rng(5).integers(0, 256, 4 * 2 * PIECE, dtype=np.uint8)
        dst = np.zeros_like(src)
        for buf in (src, dst):
            assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        keys = [f"page-{i}" for i in range(4)]
        ptrs, sizes = _pieces(src, 4)
        written, elapsed = kv_pool.page_io(store, "batch_put_from_layers", 4,
                                           lambda: kv_pool.objects(keys, ptrs, sizes))
        assert written == [True] * 4 and elapsed is not None
        ptrs, sizes = _pieces(dst, 3)
        read, _ = kv_pool.page_io(store, "batch_get_into_layers", 3,
                                  lambda: kv_pool.objects(["page-0", "page-1", "missing"], ptrs, sizes))
        assert read == [True, True, False]
        assert bytes(dst[:2 * 2 * PIECE]) == bytes(src[:2 * 2 * PIECE])
        assert kv_pool.leading_pages(store, ["page-0", "page-1", "missing", "page-3"], list, 1) == 2
        shards = {"a": ["page-0", "page-1"], "b": ["page-2", "missing"], "c": ["page-3", "page-3"]}
        assert kv_pool.leading_pages(store, ["a", "b", "c"], lambda pages: [k for p in pages for k in shards[p]],
                                     2) == 1   # two objects per page: b lacks one
        assert kv_pool.page_io(store, "batch_get_into_layers", 2, _fail) == ([False, False], None)
    finally:
        store.close()
