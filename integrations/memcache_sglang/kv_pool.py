"""The v1 calls for SGLang's KV pool, zero-copy between its registered host pool and the pool.

A page is one object per page shard (:meth:`~memcache_sglang.keys.KeyScheme.kv_keys`) holding
all of the shard's pieces (K and V, or the MLA components) as the host pool lists them; a batch of
pages is one layered call of the store. A page is a hit only when every object of it was read in
full; any failure is a miss (or a failed write), logged, never raised into SGLang's IO threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

EXISTS_CHUNK_PAGES = 256

Objects = tuple[list[str], list[list[int]], list[list[int]]]


def objects(obj_keys: list[str], ptrs: list[int], sizes: list[int]) -> Objects:
    """The object keys and, per object, the pointers and sizes of its pieces (listed object by object)."""
    if len(ptrs) % len(obj_keys):
        raise ValueError(f"host pool returned {len(ptrs)} pieces for {len(obj_keys)} objects")
    n = len(ptrs) // len(obj_keys)
    return (obj_keys, [ptrs[i:i + n] for i in range(0, len(ptrs), n)],
            [sizes[i:i + n] for i in range(0, len(sizes), n)])


def page_results(codes: Sequence[int], pages: int) -> list[bool]:
    per_page = len(codes) // pages if pages else 1
    return [all(int(c) == 0 for c in codes[i * per_page:(i + 1) * per_page]) for i in range(pages)]


def page_io(store: Any, move: str, pages: int,
            pieces: Callable[[], Objects]) -> tuple[list[bool], float | None]:
    """One batched layered call (``batch_get_into_layers`` or ``batch_put_from_layers``) for the
    objects ``pieces()`` lists; per-page results and the call's time, or all False and None when
    listing the pieces or the call fails (a miss)."""
    try:
        obj_keys, ptrs, sizes = pieces()
        start = time.perf_counter()
        codes = getattr(store, move)(obj_keys, ptrs, sizes)
        elapsed = time.perf_counter() - start
    except Exception:
        logger.exception("npu_memcache %s of %d pages failed; reporting misses", move, pages)
        return [False] * pages, None
    results = page_results(codes, pages)
    if not all(results):
        failed = sorted({int(c) for c in codes if int(c) != 0})
        if move == "batch_put_from_layers":
            logger.warning("npu_memcache: %d of %d pages not written (codes %s)", results.count(False),
                           pages, failed)
        else:  # a miss (evicted or gone since batch_exists, or a failed check): recomputed
            logger.info("npu_memcache: %d of %d pages not read (codes %s)", results.count(False),
                        pages, failed)
    return results, elapsed


def leading_pages(store: Any, keys: list[str], object_keys: Callable[[list[str]], list[str]],
                  per_page: int) -> int:
    """Number of leading pages whose every object exists (queried in chunks, stops at a miss)."""
    hits = 0
    for start in range(0, len(keys), EXISTS_CHUNK_PAGES):
        chunk = keys[start:start + EXISTS_CHUNK_PAGES]
        obj_keys = object_keys(chunk)
        try:
            flags = store.batch_is_exist(obj_keys)
        except Exception:
            logger.exception("npu_memcache batch_exists failed; reporting a miss")
            return hits
        for i in range(len(chunk)):
            if not all(int(f) == 1 for f in flags[i * per_page:(i + 1) * per_page]):
                return hits + i
        hits += len(chunk)
    return hits
