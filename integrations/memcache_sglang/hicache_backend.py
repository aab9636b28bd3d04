"""``NpuMemcacheStore``: SGLang's HiCache L3 ``HiCacheStorage`` on a MemCache pool.

SGLang builds it as ``NpuMemcacheStore(storage_config, mem_pool_host)`` in every scheduler
process (one per TP/PP/attention-CP rank); each instance is a LocalService of the pool
(:class:`memcache_core.DistributedObjectStore`) that contributes ``dram_size`` of memory.

Data moves zero-copy between SGLang's host KV pool (registered with the store) and the pool:

* KV pool (v1): ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``; one object per page
  shard holding all its pieces (K and V, or the MLA components), see :mod:`memcache_sglang.keys`.
* Hybrid side pools (v2): ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``, any pool
  whose host pool implements ``get_page_buffer_meta`` (Mamba, DSA indexer, draft, SWA, ...).
* Legacy copy calls (``get``/``set``/``batch_get``/``batch_set``/``exists``) for SGLang's generic
  path (``--hicache-storage-backend dynamic`` without ``interface_v1``).

Every failure - MetaService down, a peer gone, an object evicted between exists and get, an
exception inside the store - is reported as a miss or a failed write, never raised into SGLang's
IO threads and never a hit: a page is a hit only when every piece of it was read in full.
All methods are safe to call from SGLang's prefetch, IO, backup and scheduler threads at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from memcache_sglang.config import WARMUP_ENV, BackendConfig, env_flag
from memcache_sglang.keys import KeyScheme, LayoutIdentity, shard_suffix
from memcache_sglang.namespace_admin import remove_namespace
from memcache_sglang.side_pools import exists_v2, io_v2, pool_object_key_prefix

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head", "page_first_kv_split")
EXISTS_CHUNK_PAGES = 256
CHECK_SERVER_TIMEOUT_S = 600.0
LEGACY_POOL = "flat"


def _default_storage_config() -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=None, extra_config={},
    )


class NpuMemcacheStore(HiCacheStorage):
    """HiCache storage backend backed by a MemCache pool (``memcache_core``)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None, mem_pool: Any = None) -> None:
        from memcache_core import DistributedObjectStore, LocalConfig

        self.storage_config = storage_config or _default_storage_config()
        self.config = BackendConfig.from_sources(self.storage_config.extra_config)
        self.mem_pool_host = None
        self.registered_pools: dict[Any, Any] = {}
        self.keys: KeyScheme | None = None
        self.gb_per_page = 0.0
        self.enable_storage_metrics = bool(self.storage_config.enable_storage_metrics)
        extra = self.storage_config.extra_config or {}
        # Built through `--hicache-storage-backend dynamic` without "interface_v1": SGLang then drives
        # the legacy copy calls (whole flat pages), and existence is asked of those objects.
        self.copy_path = bool(extra.get("module_path")) and not extra.get("interface_v1")
        self._stats_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._reset_stats()

        local_cfg = LocalConfig()
        unknown = self.config.apply_to(local_cfg)
        if unknown:
            logger.warning("ignoring unknown MemCache LocalConfig keys: %s", unknown)
        sc = self.storage_config
        device_id = self.config.device_id(sc.tp_rank, sc.tp_size)
        store = DistributedObjectStore()
        rc = store.setup(local_cfg)
        if rc != 0:
            raise RuntimeError(f"MemCache DistributedObjectStore.setup failed (rc={rc}); is the MetaService "
                               f"at {getattr(local_cfg, 'meta_service_url', '?')} running?")
        rc = store.init(device_id, self.config.init_bm)
        if rc != 0:
            store.close()
            raise RuntimeError(f"MemCache DistributedObjectStore.init failed (rc={rc})")
        self.store: Any = store
        logger.info("MemCache store ready (tp_rank=%s pp_rank=%s cp_rank=%s device_id=%s init_bm=%s)",
                    sc.tp_rank, sc.pp_rank, sc.attn_cp_rank, device_id, self.config.init_bm)
        if self.config.check_server:
            self._wait_for_meta_service()

    # ------------------------------------------------------------------ setup

    def _wait_for_meta_service(self) -> None:
        import requests

        url = self.config.metrics_url
        if not url:
            logger.warning("check_server is set but no metrics_url is configured; not waiting")
            return
        deadline = time.monotonic() + CHECK_SERVER_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if requests.get(url.rstrip("/") + "/health", timeout=3).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"MetaService at {url} did not answer within {CHECK_SERVER_TIMEOUT_S:.0f}s")

    def _register(self, tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.numel() == 0:
            return
        rc = self.store.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if rc != 0:
            raise RuntimeError(f"MemCache register_buffer failed (rc={rc})")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS and not (self.copy_path and layout == "layer_first"):
            raise ValueError(f"npu_memcache supports host layouts {SUPPORTED_LAYOUTS}, got {layout!r}")
        self._register(getattr(mem_pool_host, "kv_buffer", None))
        if self._mla_kv_split():
            for name in ("v_buffer", "index_k_buffer", "index_k_scale_buffer"):
                self._register(getattr(mem_pool_host, name, None))
        self.keys = self._build_key_scheme(mem_pool_host)
        page_bytes = sum(self.keys.identity.piece_sizes) * self.keys.objects_per_page
        self.gb_per_page = page_bytes / (1 << 30)
        logger.info("npu_memcache keys: namespace %s (%s), %d object(s) per page, %d bytes per page",
                    self.keys.namespace, self.keys.identity, self.keys.objects_per_page, page_bytes)
        if env_flag(WARMUP_ENV) and self.config.init_bm:
            self._warmup()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if host_pool_name == PoolName.KV:
            return
        self.registered_pools[host_pool_name] = host_pool
        for buf in host_pool.get_hybrid_pool_buffer():
            self._register(buf)

    def _mla_kv_split(self) -> bool:
        return bool(self.storage_config.is_mla_model) and getattr(
            self.mem_pool_host, "layout", None) == "page_first_kv_split"

    def _split_factor(self) -> int:
        sc = self.storage_config
        if sc.should_split_heads and sc.tp_lcm_size:
            return sc.tp_lcm_size // sc.tp_size
        return 1

    def _rank_shard(self) -> str:
        sc = self.storage_config
        return f"r{sc.tp_rank}{shard_suffix(sc.pp_rank, sc.attn_cp_rank)}"

    def _build_key_scheme(self, pool: Any) -> KeyScheme:
        sc = self.storage_config
        ppcp = shard_suffix(sc.pp_rank, sc.attn_cp_rank)
        if sc.is_mla_model:
            sharding, shard_ids = "replicated", [ppcp]
        elif pool.layout == "page_head" and sc.tp_lcm_size and sc.tp_lcm_size % sc.tp_size == 0:
            f = sc.tp_lcm_size // sc.tp_size
            sharding = f"hs{sc.tp_lcm_size}"
            shard_ids = [f"r{sc.tp_rank * f + i}{ppcp}" for i in range(f)]
        else:
            sharding, shard_ids = f"tp{sc.tp_size}", [f"r{sc.tp_rank}{ppcp}"]
        _, sizes = self._page_meta(torch.arange(pool.page_size, dtype=torch.int64))
        per_obj = len(sizes) // len(shard_ids)
        identity = LayoutIdentity(
            model_name=sc.model_name or "",
            dtype=str(getattr(pool, "dtype", "")).removeprefix("torch."),
            layout=pool.layout,
            page_size=int(pool.page_size),
            attention="mla" if sc.is_mla_model else "mha",
            head_sharding=sharding,
            pp_size=sc.pp_size,
            attn_cp_size=sc.attn_cp_size,
            piece_sizes=tuple(int(s) for s in sizes[:per_obj]),
        )
        return KeyScheme(identity, shard_ids, self.config.extra_backend_tag)

    def _page_meta(self, host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        pool = self.mem_pool_host
        f = self._split_factor()
        if f > 1 and not self.storage_config.is_mla_model:
            ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, f)
        else:
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return list(ptrs), list(sizes)

    def _warmup(self) -> None:
        assert self.keys is not None
        key = f"{self.keys.prefix}warmup.{uuid.uuid4().hex}"
        payload = bytes(range(256)) * 16
        try:
            if self.store.put(key, payload) != 0 or self.store.is_exist(key) != 1:
                raise RuntimeError("warmup put/is_exist failed")
            if bytes(self.store.get(key)) != payload:
                raise RuntimeError("warmup get returned different bytes")
        finally:
            self.store.remove(key)
        logger.info("npu_memcache warmup passed")

    # ------------------------------------------------------------------ v1 (KV pool, zero-copy)

    def _objects(self, page_hashes: list[str], host_indices: torch.Tensor
                 ) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """Object keys and, per object, the pointers and sizes of its pieces."""
        assert self.keys is not None and self.mem_pool_host is not None
        if len(host_indices) != len(page_hashes) * self.mem_pool_host.page_size:
            raise ValueError(f"{len(page_hashes)} pages but {len(host_indices)} host indices")
        ptrs, sizes = self._page_meta(host_indices)
        keys = self.keys.kv_keys(page_hashes)
        if len(ptrs) % len(keys):
            raise ValueError(f"host pool returned {len(ptrs)} pieces for {len(keys)} objects")
        n = len(ptrs) // len(keys)
        return (keys, [ptrs[i:i + n] for i in range(0, len(ptrs), n)],
                [sizes[i:i + n] for i in range(0, len(sizes), n)])

    def _page_results(self, codes: Sequence[int], pages: int) -> list[bool]:
        per_page = len(codes) // pages if pages else 1
        return [all(int(c) == 0 for c in codes[i * per_page:(i + 1) * per_page]) for i in range(pages)]

    def _page_io(self, keys: list[str], host_indices: torch.Tensor,
                 move: str) -> tuple[list[bool], float | None]:
        """One batched layered call (``batch_get_into_layers`` or ``batch_put_from_layers``) for the
        pages; per-page results and the call's time, or all False and None when the store is gone or
        the call fails (a miss)."""
        store = self.store
        if store is None or self.keys is None:
            return [False] * len(keys), None
        try:
            obj_keys, ptrs, sizes = self._objects(keys, host_indices)
            start = time.perf_counter()
            codes = getattr(store, move)(obj_keys, ptrs, sizes)
            elapsed = time.perf_counter() - start
        except Exception:
            logger.exception("npu_memcache %s of %d pages failed; reporting misses", move, len(keys))
            return [False] * len(keys), None
        results = self._page_results(codes, len(keys))
        if move == "batch_put_from_layers" and not all(results):
            logger.warning("npu_memcache: %d of %d pages not written (codes %s)", results.count(False),
                           len(keys), sorted({int(c) for c in codes if int(c) != 0}))
        return results, elapsed

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        results, elapsed = self._page_io(keys, host_indices, "batch_get_into_layers")
        if elapsed is not None:
            self._record("prefetch", sum(results), elapsed)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        # Content-addressed: putting an object that already exists is a successful no-op.
        results, elapsed = self._page_io(keys, host_indices, "batch_put_from_layers")
        if elapsed is not None:
            self._record("backup", sum(results), elapsed)
        return results

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading pages whose every object exists (queried in chunks, stops at a miss)."""
        store = self.store
        if not keys or store is None or self.keys is None:
            return 0
        per_page = 1 if self.copy_path else self.keys.objects_per_page
        hits = 0
        for start in range(0, len(keys), EXISTS_CHUNK_PAGES):
            chunk = keys[start:start + EXISTS_CHUNK_PAGES]
            obj_keys = [self._legacy_key(k) for k in chunk] if self.copy_path else self.keys.kv_keys(chunk)
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

    # ------------------------------------------------------------------ v2 (hybrid side pools)

    def _pool_shard(self, pool_name: Any) -> str:
        """MLA side pools other than Mamba are written by one rank and read by all."""
        sc = self.storage_config
        if sc.is_mla_model and pool_name != PoolName.MAMBA:
            return shard_suffix(sc.pp_rank, sc.attn_cp_rank)
        return self._rank_shard()

    def _pool_keys(self, pool_name: Any, page_hashes: list[str]) -> list[str]:
        assert self.keys is not None
        tag = pool_object_key_prefix(pool_name, self.registered_pools.get(pool_name))
        return self.keys.pool_keys(page_hashes, tag, self._pool_shard(pool_name))

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        kv_pages = self.batch_exists(keys, extra_info)
        if not pool_transfers or kv_pages == 0 or self.store is None:
            return PoolTransferResult(kv_pages, {"kv": kv_pages} if kv_pages else {})
        return exists_v2(self.store, keys, kv_pages, pool_transfers, self._pool_keys)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return io_v2(self.store, transfers, self.registered_pools, self._pool_keys, is_set=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return io_v2(self.store, transfers, self.registered_pools, self._pool_keys, is_set=True)

    # ------------------------------------------------------------------ legacy copy path

    def _legacy_key(self, key: str) -> str:
        if self.keys is None:
            raise RuntimeError("npu_memcache: the host pool is not registered yet")
        return self.keys.page_key(key, self._rank_shard(), LEGACY_POOL)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Read whole flat pages: into tensors (returned) or raw registered pointers (True)."""
        out: list[Any] = [None] * len(keys)
        store = self.store
        if store is None or not keys:
            return out
        locations = list(target_locations) if target_locations is not None else [None] * len(keys)
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        for i, (key, loc, size) in enumerate(zip(keys, locations, sizes, strict=True)):
            try:
                if isinstance(loc, torch.Tensor):
                    data = store.get(self._legacy_key(key))
                    dst = loc.reshape(-1).view(torch.uint8)
                    if data is None or len(data) != dst.numel():
                        continue
                    dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    out[i] = loc
                elif loc is not None and size is not None:
                    rc = store.batch_get_into([self._legacy_key(key)], [int(loc)], [int(size)])[0]
                    out[i] = True if int(rc) == 0 else None
            except Exception:
                logger.exception("npu_memcache legacy get of %s failed", key)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value], [target_location], [target_sizes])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store = self.store
        if store is None or not keys:
            return False
        n = len(keys)
        values = list(values) if values is not None else [None] * n
        locations = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        ok = True
        for key, value, loc, size in zip(keys, values, locations, sizes, strict=True):
            try:
                if isinstance(value, torch.Tensor):
                    src = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                    rc = store.put(self._legacy_key(key), memoryview(src))
                elif loc is not None and size is not None:
                    rc = store.batch_put_from([self._legacy_key(key)], [int(loc)], [int(size)])[0]
                else:
                    rc = -1
            except Exception:
                logger.exception("npu_memcache legacy set of %s failed", key)
                rc = -1
            ok = ok and int(rc) == 0
        return ok

    def exists(self, key: str) -> bool:
        store = self.store
        if store is None or self.keys is None:
            return False
        try:
            return int(store.is_exist(self._legacy_key(key))) == 1
        except Exception:
            return False

    # ------------------------------------------------------------------ admin

    def clear(self) -> None:
        """Empty what this server can hit (its namespace), or the whole pool with clear_scope=all."""
        store = self.store
        if store is None:
            return
        if self.config.clear_scope == "all" or self.keys is None:
            rc = store.remove_all()
            logger.info("npu_memcache clear: removed every object of the pool (rc=%s)", rc)
            return
        removed = remove_namespace(store, self.keys.prefix, self.config.metrics_url)
        if removed is None:
            rc = store.remove_all()
            logger.warning("npu_memcache clear: cannot list keys (no metrics_url?); removed the whole "
                           "pool instead (rc=%s)", rc)
        else:
            logger.info("npu_memcache clear: removed %d objects of namespace %s", removed,
                        self.keys.namespace)

    def close(self) -> None:
        with self._state_lock:
            store, self.store = self.store, None
        if store is None:
            return
        try:
            store.close()
        except Exception as exc:
            logger.warning("MemCache store close failed: %s", exc)

    # ------------------------------------------------------------------ metrics

    def _reset_stats(self) -> None:
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def _record(self, kind: str, pages: int, elapsed: float) -> None:
        if not self.enable_storage_metrics or pages == 0 or elapsed <= 0:
            return
        with self._stats_lock:
            getattr(self, f"{kind}_pgs").append(pages)
            getattr(self, f"{kind}_bandwidth").append(pages * self.gb_per_page / elapsed)

    def get_stats(self) -> StorageMetrics:
        with self._stats_lock:
            metrics = StorageMetrics(
                prefetch_pgs=self.prefetch_pgs, backup_pgs=self.backup_pgs,
                prefetch_bandwidth=self.prefetch_bandwidth, backup_bandwidth=self.backup_bandwidth)
            self._reset_stats()
        return metrics
