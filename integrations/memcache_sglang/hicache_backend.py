"""``NpuMemcacheStore``: SGLang's HiCache L3 ``HiCacheStorage`` on a MemCache pool.

SGLang builds it as ``NpuMemcacheStore(storage_config, mem_pool_host)`` in every scheduler
process (one per TP/PP/attention-CP rank); each instance is a LocalService of the pool
(:class:`memcache_core.DistributedObjectStore`) that contributes ``dram_size`` of memory.

Data moves zero-copy between SGLang's host KV pool (registered with the store) and the pool:

* KV pool (v1): ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``; one object per page
  shard holding all its pieces (K and V, or the MLA components), see :mod:`memcache_sglang.kv_pool`
  and :mod:`memcache_sglang.keys`.
* Hybrid side pools (v2): ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``, any pool
  whose host pool implements ``get_page_buffer_meta`` (Mamba, DSA indexer, draft, SWA, ...), see
  :mod:`memcache_sglang.side_pools`.
* Legacy copy calls (``get``/``set``/``batch_get``/``batch_set``/``exists``) for SGLang's generic
  path (``--hicache-storage-backend dynamic`` without ``interface_v1``), see
  :mod:`memcache_sglang.copy_path`.

The keys follow the weights served at the time of each call (:mod:`memcache_sglang.namespace`).

A server that cannot join the pool at start-up (MetaService down) starts anyway: it logs it once,
serves misses, and joins in the background with backoff (:mod:`memcache_sglang.pool_join`); the
buffers SGLang registered meanwhile are registered when it joins. The attempts, their failures,
whether it is in the pool and the misses served meanwhile are on SGLang's ``/metrics``
(:mod:`memcache_sglang.join_metrics`).

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
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from memcache_sglang import kv_pool
from memcache_sglang.config import WARMUP_ENV, BackendConfig, env_flag, place_disk_tier, rank_index
from memcache_sglang.disk_prefetch import DiskPromoter
from memcache_sglang.join_metrics import join_metrics
from memcache_sglang.keys import KeyScheme, shard_suffix
from memcache_sglang.legacy_calls import LegacyCalls
from memcache_sglang.namespace import Namespace, build_layout, model_config_digests
from memcache_sglang.pool_join import BackgroundJoin
from memcache_sglang.side_pool_calls import SidePoolCalls
from memcache_sglang.side_pools import pool_object_key_prefix

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head", "page_first_kv_split")
CHECK_SERVER_TIMEOUT_S = 600.0
# A MetaService that does not answer costs a call this long (the core's default is a minute).
CLIENT_TIMEOUT_S = 5.0


def _default_storage_config() -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=None, extra_config={},
    )


class NpuMemcacheStore(SidePoolCalls, LegacyCalls, HiCacheStorage):
    """HiCache storage backend backed by a MemCache pool (``memcache_core``)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None, mem_pool: Any = None) -> None:
        from memcache_core import LocalConfig, MemCacheError, open_store

        self.storage_config = storage_config or _default_storage_config()
        self.config = BackendConfig.from_sources(self.storage_config.extra_config)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        # The key scheme follows the served weights; set once the host pool is registered.
        self._namespace: Namespace | None = None
        self.gb_per_page = 0.0
        self.enable_storage_metrics = bool(self.storage_config.enable_storage_metrics)
        extra = self.storage_config.extra_config or {}
        # Built through `--hicache-storage-backend dynamic` without "interface_v1": SGLang then drives
        # the legacy copy calls (whole flat pages), and existence is asked of those objects.
        self.copy_path = bool(extra.get("module_path")) and not extra.get("interface_v1")
        self._stats_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._join_closed = False
        self._reset_stats()

        local_cfg = LocalConfig()
        local_cfg.client_timeout_seconds = CLIENT_TIMEOUT_S
        unknown = self.config.apply_to(local_cfg)
        if unknown:
            logger.warning("ignoring unknown MemCache LocalConfig keys: %s", unknown)
        sc = self.storage_config
        device_id = self.config.device_id(sc.tp_rank, sc.tp_size)
        place_disk_tier(local_cfg, self.config.init_bm, self._rank_shard())
        local_cfg = local_cfg.for_rank(rank_index(sc))   # each rank its own metrics port: metrics_port + rank
        self._promoter = DiskPromoter() if self.config.disk_prefetch else None
        self.store: Any = None
        self._buffers: list[tuple[int, int]] = []
        """Every buffer SGLang registered (registered again with a store that joins late)."""
        self._join: BackgroundJoin | None = None
        self._metrics = join_metrics().of_rank(rank_index(sc))
        self._metrics.joined.set(0)
        if self.config.check_server:
            self._wait_for_meta_service()
        join = partial(self._open_counted, partial(open_store, local_cfg, device_id, self.config.init_bm))
        try:
            self.store = join()
        except MemCacheError as e:
            logger.warning("npu_memcache: cannot join the pool at start-up (%s); serving misses and "
                           "joining in the background", e)
            self._join = BackgroundJoin(join, self._joined, max_s=self.config.join_retry_max_seconds).start()
            return
        self._metrics.joined.set(1)
        logger.info("MemCache store ready (tp_rank=%s pp_rank=%s cp_rank=%s device_id=%s init_bm=%s)",
                    sc.tp_rank, sc.pp_rank, sc.attn_cp_rank, device_id, self.config.init_bm)

    def _open_counted(self, open_store: Any) -> Any:
        """``open_store()``, counted in the join metrics."""
        self._metrics.attempts.inc()
        try:
            return open_store()
        except Exception:
            self._metrics.failures.inc()
            raise

    def _unjoined_misses(self, pages: int) -> None:
        """Count pages answered as misses because the pool is not joined (not after ``close``)."""
        if pages and not self._join_closed:
            self._metrics.unjoined_misses.inc(pages)

    def _joined(self, store: Any) -> None:
        """The background join succeeded: register the buffers, then serve from the pool."""
        with self._state_lock:
            closed = self._join_closed
            if not closed:
                try:
                    for ptr, size in self._buffers:
                        rc = store.register_buffer(ptr, size)
                        if rc != 0:
                            raise RuntimeError(f"register_buffer({ptr:#x}, {size}) failed with code {rc}")
                except Exception:
                    logger.exception("npu_memcache: the pool was joined but a buffer cannot be "
                                     "registered; serving misses")
                    closed = True
                else:
                    self.store = store
                    self._metrics.joined.set(1)
        if closed:
            store.close()

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
        buf = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self._state_lock:
            self._buffers.append(buf)
            store = self.store
            if store is None:
                return  # registered when the background join succeeds
            rc = store.register_buffer(*buf)
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
        _, sizes = self._page_meta(torch.arange(mem_pool_host.page_size, dtype=torch.int64))
        identity, shard_ids = build_layout(self.storage_config, mem_pool_host, sizes)
        tag = self.config.extra_backend_tag
        self._namespace = Namespace(identity, shard_ids, model_config_digests(), tag,
                                    self.config.weights_full_hash)
        keys = self._scheme()
        page_bytes = sum(keys.identity.piece_sizes) * keys.objects_per_page
        self.gb_per_page = page_bytes / (1 << 30)
        if env_flag(WARMUP_ENV) and self.config.init_bm and self.store is not None:
            self._warmup()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if host_pool_name == PoolName.KV:
            return
        pool_object_key_prefix(host_pool_name, host_pool)  # raises (refusing the attach) if unkeyable
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

    @property
    def keys(self) -> KeyScheme | None:
        """The key scheme of the weights served now (None before the host pool is registered)."""
        namespace = self._namespace
        return namespace.scheme() if namespace is not None else None

    def _scheme(self) -> KeyScheme:
        assert self._namespace is not None
        return self._namespace.scheme()

    def _page_meta(self, host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        pool = self.mem_pool_host
        f = self._split_factor()
        if f > 1 and not self.storage_config.is_mla_model:
            ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, f)
        else:
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return list(ptrs), list(sizes)

    def _warmup(self) -> None:
        key = f"{self._scheme().prefix}warmup.{uuid.uuid4().hex}"
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

    def _objects(self, scheme: KeyScheme, page_hashes: list[str],
                 host_indices: torch.Tensor) -> kv_pool.Objects:
        """Object keys and, per object, the pointers and sizes of its pieces."""
        assert self.mem_pool_host is not None
        if len(host_indices) != len(page_hashes) * self.mem_pool_host.page_size:
            raise ValueError(f"{len(page_hashes)} pages but {len(host_indices)} host indices")
        ptrs, sizes = self._page_meta(host_indices)
        return kv_pool.objects(scheme.kv_keys(page_hashes), ptrs, sizes)

    def _page_io(self, keys: list[str], host_indices: torch.Tensor,
                 move: str) -> tuple[list[bool], float | None]:
        """Per-page results and the call's time; all False and None when the store is gone."""
        store, scheme = self.store, self.keys
        if store is None or scheme is None:
            return [False] * len(keys), None
        return kv_pool.page_io(store, move, len(keys), partial(self._objects, scheme, keys, host_indices))

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
        scheme = self.keys
        return self._batch_exists(scheme, keys) if scheme is not None else 0

    def _batch_exists(self, scheme: KeyScheme, keys: list[str]) -> int:
        store = self.store
        if not keys or store is None:
            if store is None:
                self._unjoined_misses(len(keys))
            return 0
        object_keys = partial(self._legacy_keys, scheme) if self.copy_path else scheme.kv_keys
        hits = kv_pool.leading_pages(store, keys, object_keys, 1 if self.copy_path else scheme.objects_per_page)
        if hits and self._promoter is not None:   # pages held on disk: into DRAM before the reads
            self._promoter.submit(store, object_keys(keys[:hits]))
        return hits

    # ------------------------------------------------------------------ admin

    def clear(self) -> bool:
        """Empty what this server can hit (its namespace), or the whole pool with clear_scope=all.

        Never wider than asked: a failure is logged and reported (False), never answered by
        removing more (SGLang ignores the value; the log line is what an operator sees).
        """
        store, scheme = self.store, self.keys
        if store is None or scheme is None:
            logger.error("npu_memcache clear: the backend is closed or not attached; nothing removed")
            return False
        if self.config.clear_scope == "all":
            rc = store.remove_all()
            logger.info("npu_memcache clear (clear_scope=all): removed every object of the pool (rc=%s)", rc)
            return int(rc) == 0
        try:
            removed = int(store.remove_by_prefix(scheme.prefix))
        except Exception:
            logger.exception("npu_memcache clear of namespace %s failed; nothing else removed", scheme.namespace)
            return False
        if removed < 0:
            logger.error("npu_memcache clear of namespace %s failed (rc=%d); nothing else removed",
                         scheme.namespace, removed)
            return False
        logger.info("npu_memcache clear: removed %d objects of namespace %s", removed, scheme.namespace)
        return True

    def close(self) -> None:
        with self._state_lock:
            self._join_closed = True
            store, self.store = self.store, None
            self._metrics.joined.set(0)
        if self._join is not None:
            self._join.stop()
        if store is None:
            return
        if self._promoter is not None:
            self._promoter.close()
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
