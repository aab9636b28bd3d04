"""``NpuMemcacheStore``'s v2 calls for SGLang's hybrid side pools (``batch_exists_v2`` /
``batch_get_v2`` / ``batch_set_v2``): a mixin over :mod:`memcache_sglang.side_pools`. A pool's
objects are keyed per rank, except MLA side pools other than Mamba (written by one rank, read by all)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from memcache_sglang.keys import KeyScheme, shard_suffix
from memcache_sglang.side_pools import exists_v2, io_v2, pool_object_key_prefix


class SidePoolCalls:
    """The v2 calls (a mixin; ``NpuMemcacheStore`` holds the state)."""

    store: Any
    storage_config: HiCacheStorageConfig
    registered_pools: dict[Any, Any]

    if TYPE_CHECKING:   # ``hicache_backend.NpuMemcacheStore``'s own, used here
        @property
        def keys(self) -> KeyScheme | None: ...

        def _rank_shard(self) -> str: ...

        def _batch_exists(self, scheme: KeyScheme, keys: list[str]) -> int: ...

    def _pool_shard(self, pool_name: Any) -> str:
        """MLA side pools other than Mamba are written by one rank and read by all."""
        sc = self.storage_config
        if sc.is_mla_model and pool_name != PoolName.MAMBA:
            return shard_suffix(sc.pp_rank, sc.attn_cp_rank)
        return self._rank_shard()

    def _pool_keys_of(self, scheme: KeyScheme) -> Any:
        def pool_keys(pool_name: Any, page_hashes: list[str]) -> list[str]:
            tag = pool_object_key_prefix(pool_name, self.registered_pools.get(pool_name))
            return scheme.pool_keys(page_hashes, tag, self._pool_shard(pool_name))
        return pool_keys

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        scheme = self.keys
        kv_pages = self._batch_exists(scheme, keys) if scheme is not None else 0
        if not pool_transfers or kv_pages == 0 or self.store is None or scheme is None:
            return PoolTransferResult(kv_pages, {"kv": kv_pages} if kv_pages else {})
        return exists_v2(self.store, keys, kv_pages, pool_transfers, self._pool_keys_of(scheme))

    def _io_v2(self, transfers: list[PoolTransfer], is_set: bool) -> dict[str, list[bool]]:
        scheme = self.keys
        if scheme is None:
            return {t.name: [False] * len(t.keys or []) for t in transfers}
        return io_v2(self.store, transfers, self.registered_pools, self._pool_keys_of(scheme), is_set=is_set)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._io_v2(transfers, is_set=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._io_v2(transfers, is_set=True)
