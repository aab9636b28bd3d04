"""``NpuMemcacheStore``'s legacy copy calls (``get`` / ``set`` / ``batch_get`` / ``batch_set`` /
``exists``) for SGLang's generic storage path: a mixin over :mod:`memcache_sglang.copy_path`, one
object per whole flat page and rank (pool ``LEGACY_POOL``)."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from memcache_sglang import copy_path
from memcache_sglang.keys import KeyScheme

logger = logging.getLogger(__name__)

LEGACY_POOL = "flat"


class LegacyCalls:
    """The legacy copy calls (a mixin; ``NpuMemcacheStore`` holds the state)."""

    store: Any

    if TYPE_CHECKING:   # ``hicache_backend.NpuMemcacheStore``'s own, used here
        @property
        def keys(self) -> KeyScheme | None: ...

        def _rank_shard(self) -> str: ...

        def _unjoined_misses(self, pages: int) -> None: ...

    def _legacy_key(self, scheme: KeyScheme | None, key: str) -> str:
        if scheme is None:
            raise RuntimeError("npu_memcache: the host pool is not registered yet")
        return scheme.page_key(key, self._rank_shard(), LEGACY_POOL)

    def _legacy_keys(self, scheme: KeyScheme, keys: list[str]) -> list[str]:
        return [self._legacy_key(scheme, k) for k in keys]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Read whole flat pages: into tensors (returned) or raw registered pointers (True)."""
        store, scheme = self.store, self.keys
        if store is None or scheme is None or not keys:
            return [None] * len(keys)
        return copy_path.batch_get(store, partial(self._legacy_key, scheme), keys, target_locations,
                                   target_sizes)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value], [target_location], [target_sizes])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store, scheme = self.store, self.keys
        if store is None or scheme is None or not keys:
            return False
        return copy_path.batch_set(store, partial(self._legacy_key, scheme), keys, values, target_locations,
                                   target_sizes)

    def exists(self, key: str) -> bool:
        store, scheme = self.store, self.keys
        if store is None or scheme is None:
            if store is None:
                self._unjoined_misses(1)
            return False
        try:
            return int(store.is_exist(self._legacy_key(scheme, key))) == 1
        except Exception:
            logger.exception("npu_memcache legacy exists of %s failed; reporting a miss", key)
            return False
