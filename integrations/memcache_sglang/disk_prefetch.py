"""Promotion of disk-held pages ahead of SGLang's reads.

SGLang's prefetch asks ``batch_exists`` how many leading pages the pool holds, and reads them with
``batch_get_v1`` once the scheduler has host memory for them (at the earliest its next loop
iteration). Pages a provider holds on its disk tier only read correctly either way (the provider
serves them from disk); ``DiskPromoter`` asks the pool (``store.prefetch``) to bring the counted
pages back into DRAM as soon as they are counted, so the reads that follow find many of them in
DRAM, and later restores of the same prefix do too.

It never blocks ``batch_exists``: that also runs on SGLang's scheduler thread
(``query_storage_hit_length``), where waiting for disk reads would stall every running request.
Promotions run on one background thread and the reads do not wait for them: a page promoted before
its read is read from DRAM, one still on disk is read from disk beside its promotion, both verified.
Measured (``benchmarks/bench_disk_promotion.py``): a read racing the promotion of its own pages
costs about a fifth more than a plain disk read, a read that waited for the promotion about half
more, and a read after a finished promotion a tenth of it. At most ``MAX_PENDING_KEYS`` keys wait
for promotion; more are skipped (their reads come from disk). In a pool without a disk tier (as the
heartbeats tell, ``pool_has_disk_tier``) nothing is held on disk only and nothing is submitted.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

MAX_PENDING_KEYS = 4096


class DiskPromoter:
    """Background ``store.prefetch`` of keys about to be read; thread-safe, never raises."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-memcache-promote")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._closed = False
        self.submitted = 0   # keys handed to store.prefetch
        self.skipped = 0     # keys not handed over: too many waiting
        self.failed = 0      # keys store.prefetch left on disk (no room, I/O error) or could not ask about

    def submit(self, store: Any, keys: list[str]) -> None:
        if not keys or getattr(store, "prefetch", None) is None or not store.pool_has_disk_tier():
            return   # no disk tier in the pool: nothing is on disk only, so no Lookup to spend
        with self._lock:
            if self._closed:
                return
            fresh = [k for k in dict.fromkeys(keys) if k not in self._pending]
            room = max(0, MAX_PENDING_KEYS - len(self._pending))
            self.skipped += max(0, len(fresh) - room)
            fresh = fresh[:room]
            if not fresh:
                return
            self._pending.update(fresh)
            self.submitted += len(fresh)
        self._pool.submit(self._run, store, fresh)

    def _run(self, store: Any, keys: list[str]) -> None:
        try:
            codes = store.prefetch(keys)
            failed = sum(1 for c in codes if int(c) != 0)
            if failed:
                logger.debug("npu_memcache: %d of %d pages stay on disk (codes %s)", failed, len(keys),
                             sorted({int(c) for c in codes if int(c) != 0}))
        except Exception:
            logger.exception("npu_memcache: promotion of %d pages failed; they are read from disk", len(keys))
            failed = len(keys)
        with self._lock:
            self.failed += failed
            self._pending.difference_update(keys)

    def close(self) -> None:
        """Stop taking work, drop what waits, and wait for a promotion under way (the store closes next)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
