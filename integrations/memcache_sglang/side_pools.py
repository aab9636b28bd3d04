"""The v2 calls for SGLang's hybrid side pools (Mamba state, DSA indexer, draft KV, SWA, ...).

Every side pool is handled the same way: its host pool's ``get_page_buffer_meta`` gives the
pieces of each page, which become one object per page (key: the page hash plus the pool's name
and a digest of its piece sizes, see :mod:`memcache_sglang.keys`). All transfers of one call go
to the store in a single batched request.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, PoolTransferResult

logger = logging.getLogger(__name__)

PoolKeysFn = Callable[[Any, list[str]], list[str]]
_pool_tags: dict[int, str] = {}


def pool_object_key_prefix(pool_name: Any, host_pool: Any) -> str:
    """``{pool}-{digest of its per-page piece sizes}``; the bare name for a pool never registered
    (whose transfers all fail, so its keys are never written).

    Raises when a registered pool cannot describe its pages: the backend then refuses to attach
    rather than key the pool by its name alone, which would let pools of different layouts share
    objects.
    """
    name = str(pool_name.value if hasattr(pool_name, "value") else pool_name)
    if host_pool is None:
        return name
    tag = _pool_tags.get(id(host_pool))
    if tag is None:
        page_size = int(getattr(host_pool, "page_size", 1) or 1)
        try:
            _, sizes = host_pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        except Exception as exc:
            raise RuntimeError(f"npu_memcache: side pool {name} cannot describe its pages "
                               f"(get_page_buffer_meta: {exc}); cannot key it") from exc
        digest = hashlib.sha256(",".join(str(int(s)) for s in sizes).encode()).hexdigest()[:8]
        tag = f"{name}-{digest}"
        _pool_tags[id(host_pool)] = tag
    return tag


def _leading(flags: list[bool]) -> int:
    return flags.index(False) if False in flags else len(flags)


def exists_v2(store: Any, keys: list[str], kv_pages: int, transfers: list[PoolTransfer],
              pool_keys: PoolKeysFn) -> PoolTransferResult:
    """Longest prefix usable by the KV pool and every side pool, per their hit policies."""
    hits: dict[Any, int] = {"kv": kv_pages}
    final = kv_pages
    trailing_sets: list[set[int]] = []
    for t in transfers:
        if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
            hits[t.name] = 0  # compressed block groups are not stored by this backend
            continue
        try:
            flags = store.batch_is_exist(pool_keys(t.name, keys[:kv_pages]))
            present = [int(f) == 1 for f in flags]
        except Exception:
            logger.exception("npu_memcache batch_exists_v2 for pool %s failed", t.name)
            present = [False] * kv_pages
        if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(t.keys) if t.keys else 1)
            valid = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - window):p])}
            trailing_sets.append(valid)
            boundary = max(valid, default=0)
        else:
            boundary = _leading(present)
        hits[t.name] = boundary
        final = min(final, boundary)
    restorable = None
    if trailing_sets:
        restorable = sorted(p for p in range(1, final + 1) if all(p in s for s in trailing_sets))
        final = restorable[-1] if restorable else 0
    hits["kv"] = final
    return PoolTransferResult(final, {k: v for k, v in hits.items() if v}, restorable)


def io_v2(store: Any, transfers: list[PoolTransfer], pools: dict[Any, Any], pool_keys: PoolKeysFn,
          *, is_set: bool) -> dict[str, list[bool]]:
    """Read or write every transfer in one batched layered call; per pool, per page success."""
    results: dict[Any, list[bool]] = {}
    all_keys: list[str] = []
    all_ptrs: list[list[int]] = []
    all_sizes: list[list[int]] = []
    spans: list[tuple[Any, int, int]] = []
    for t in transfers:
        n = len(t.keys or [])
        pool = pools.get(t.name)
        results[t.name] = [False] * n
        if store is None or pool is None or n == 0 or t.host_indices is None:
            if pool is None and n:
                logger.warning("npu_memcache: side pool %s is not registered", t.name)
            continue
        try:
            ptrs, sizes = pool.get_page_buffer_meta(t.host_indices)
            if len(ptrs) % n:
                raise ValueError(f"{len(ptrs)} pieces for {n} pages")
            per = len(ptrs) // n
            spans.append((t.name, len(all_keys), n))
            all_keys += pool_keys(t.name, list(t.keys))
            all_ptrs += [list(ptrs[i:i + per]) for i in range(0, len(ptrs), per)]
            all_sizes += [list(sizes[i:i + per]) for i in range(0, len(sizes), per)]
        except Exception:
            logger.exception("npu_memcache: cannot map side pool %s pages", t.name)
    if not all_keys:
        return results
    try:
        if is_set:
            codes = store.batch_put_from_layers(all_keys, all_ptrs, all_sizes)
        else:
            codes = store.batch_get_into_layers(all_keys, all_ptrs, all_sizes)
    except Exception:
        logger.exception("npu_memcache batch_%s_v2 failed", "set" if is_set else "get")
        return results
    for name, start, n in spans:
        results[name] = [int(c) == 0 for c in codes[start:start + n]]
    return results
