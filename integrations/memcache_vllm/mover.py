"""Moving whole blocks between a vLLM worker's KV caches and the pool (``worker.py``): one layered
object per block, through pinned host staging when the KV caches are on a CUDA device."""

from __future__ import annotations

import logging
import time
from typing import Any

from memcache_vllm.layout import BlockLayout, DeviceStager, staging_capacity
from memcache_vllm.stats import StatsRecorder

logger = logging.getLogger("vllm." + __name__)

STAGING_BYTES = 256 << 20
"""Pinned host staging per direction for KV caches on a CUDA device."""


class BlockMover:
    """Moves blocks between the KV caches and the pool; thread-safe per direction."""

    def __init__(self, store: Any, layout: BlockLayout, stats: StatsRecorder) -> None:
        self.store = store
        self.layout = layout
        self.stats = stats
        self._stagers: dict[str, DeviceStager] = {}
        if not layout.on_host:
            cap = staging_capacity(layout, STAGING_BYTES)
            self._stagers = {d: DeviceStager(layout, cap) for d in ("load", "save")}

    def regions(self) -> list[tuple[int, int]]:
        if self.layout.on_host:
            return self.layout.regions()
        return [s.region() for s in self._stagers.values()]

    def _pieces(self, stage: str, ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Pointers and sizes of each block's pieces: in its ``stage`` staging slot when the KV cache
        is staged, else in the KV cache itself."""
        if self._stagers:
            parts = [self._stagers[stage].pieces(slot) for slot in range(len(ids))]
        else:
            parts = [self.layout.pieces(b) for b in ids]
        return [p for p, _ in parts], [s for _, s in parts]

    def _chunks(self, n: int) -> list[range]:
        step = self._stagers["load"].capacity if self._stagers else max(n, 1)
        return [range(i, min(i + step, n)) for i in range(0, n, step)]

    def load(self, block_ids: list[int], all_keys: list[str]) -> list[int]:
        """Load blocks; returns the ids of blocks that did not load."""
        t0 = time.perf_counter()
        failed: list[int] = []
        for part in self._chunks(len(block_ids)):
            ids = [block_ids[i] for i in part]
            keys = [all_keys[i] for i in part]
            ptrs, sizes = self._pieces("load", ids)
            try:
                codes = list(self.store.batch_get_into_layers(keys, ptrs, sizes))
                if len(codes) != len(keys):
                    raise RuntimeError(f"{len(codes)} codes for {len(keys)} keys")
            except Exception as exc:
                logger.warning("MemCacheConnector: load of %d blocks failed: %s", len(keys), exc)
                codes = [-1] * len(keys)
            ok = [i for i, c in enumerate(codes) if c == 0]
            failed.extend(ids[i] for i, c in enumerate(codes) if c != 0)
            if self._stagers and ok:
                self._stagers["load"].scatter([ids[i] for i in ok], ok)
        n_ok = len(block_ids) - len(failed)
        self.stats.add(load_blocks=n_ok, load_bytes=n_ok * self.layout.block_bytes,
                       load_failed_blocks=len(failed), load_time_s=time.perf_counter() - t0)
        if failed:
            logger.warning("MemCacheConnector: %d of %d blocks did not load; they will be recomputed",
                           len(failed), len(block_ids))
        return failed

    def save(self, block_ids: list[int], all_keys: list[str]) -> list[str]:
        """Save blocks; returns the keys now in the pool (written, or already there)."""
        t0 = time.perf_counter()
        failed = 0
        saved: list[str] = []
        bad_codes: set[int] = set()
        for part in self._chunks(len(block_ids)):
            ids = [block_ids[i] for i in part]
            keys = [all_keys[i] for i in part]
            if self._stagers:
                self._stagers["save"].gather(ids)
            ptrs, sizes = self._pieces("save", ids)
            try:
                codes = list(self.store.batch_put_from_layers(keys, ptrs, sizes))
                if len(codes) != len(keys):
                    raise RuntimeError(f"{len(codes)} codes for {len(keys)} keys")
            except Exception as exc:
                logger.warning("MemCacheConnector: save of %d blocks failed: %s", len(keys), exc)
                codes = [-1] * len(keys)
            failed += sum(1 for c in codes if c != 0)
            saved.extend(k for k, c in zip(keys, codes, strict=True) if c == 0)
            bad_codes.update(c for c in codes if c != 0)
        n_ok = len(block_ids) - failed
        self.stats.add(save_blocks=n_ok, save_bytes=n_ok * self.layout.block_bytes,
                       save_failed_blocks=failed, save_time_s=time.perf_counter() - t0)
        if failed:
            logger.info("MemCacheConnector: %d of %d blocks not saved (codes %s)",
                        failed, len(block_ids), sorted(bad_codes))
        return saved
