"""The scheduler's pool client: existence lookups and namespace removals, never payload.

A pure client of the pool (``init(0, init_bm=False)``: no pool memory), connected on first use.
Every failure of the pool is a miss, and a failed lookup makes the next ones misses at once for
``lookup_retry_s``, so a slow or absent MetaService costs vLLM's scheduler a miss, never a stall.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from memcache_vllm.config import ConnectorConfig

logger = logging.getLogger("vllm." + __name__)

# Longest wait of a scheduler lookup for the MetaService: a slow pool must cost a miss, not a stall.
LOOKUP_TIMEOUT_S = 2.0


class PoolClient:
    """A metadata-only pool client that turns failures into misses and backs off after them."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self._cfg = cfg
        self._store: Any = None
        self._down_until = 0.0

    def _connect(self) -> Any:
        from memcache_core import open_store

        local = self._cfg.local_config()
        local.client_timeout_seconds = min(float(local.client_timeout_seconds), LOOKUP_TIMEOUT_S)
        store = open_store(local, 0, init_bm=False)
        logger.info("MemCacheConnector: scheduler lookups through %s", local.meta_service_url)
        return store

    def exists(self, keys: list[str]) -> list[int] | None:
        """Per-key 1/0/negative codes, or None when the pool cannot be asked now."""
        now = time.monotonic()
        if now < self._down_until:
            return None
        try:
            if self._store is None:
                self._store = self._connect()
            codes = list(self._store.batch_is_exist(keys))
            if len(codes) != len(keys):
                raise RuntimeError(f"batch_is_exist returned {len(codes)} codes for {len(keys)} keys")
        except Exception as exc:  # any failure of the pool is a miss
            logger.warning("MemCacheConnector: pool lookup failed (%s); treating as a miss for %.1f s",
                           exc, self._cfg.lookup_retry_s)
            self._down_until = now + self._cfg.lookup_retry_s
            return None
        if any(c < 0 for c in codes):
            self._down_until = now + self._cfg.lookup_retry_s
        return codes

    def remove_by_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; the count removed, or a negative error code."""
        if self._store is None:
            self._store = self._connect()
        remove = getattr(self._store, "remove_by_prefix", None)
        if remove is None:
            raise RuntimeError("this memcache_core has no remove_by_prefix")
        return int(remove(prefix))

    def close(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # best effort at shutdown
                logger.debug("MemCacheConnector: closing the lookup client failed", exc_info=True)
            self._store = None
