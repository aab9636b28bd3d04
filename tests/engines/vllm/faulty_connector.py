"""Test scaffolding: the real MemCacheConnector, except that right before each load the worker
removes some of the blocks it is about to load from the pool (as an eviction or a dead
LocalService would between the scheduler's lookup and the load).

Selected with ``"kv_connector_module_path": "faulty_connector"``; the blocks removed are every
block from the middle of each load job on (``MEMCACHE_TEST_DROP_FROM`` = fraction, default 0.5).
Their destination blocks in the KV cache are filled with a constant first, as a load that failed
half-way leaves them: whatever reads them before vLLM recomputes them reads wrong bytes (and not,
by chance, the same prompt's KV left there by an earlier request).

With ``"test_unfenced": true`` in the extra config the worker's load-failure fence never fences:
it then saves what it computed over the failed blocks, as another tensor-parallel rank that did
not see the failure would, and only the scheduler's removal of those keys keeps the pool clean.
"""

from __future__ import annotations

import ctypes
import logging
import os

from memcache_vllm import MemCacheConnector as _Real
from memcache_vllm.metadata import LoadJob

logger = logging.getLogger("vllm." + __name__)


class MemCacheConnector(_Real):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config
        if self._worker is not None and extra.get("test_unfenced"):
            logger.warning("faulty_connector: load-failure fence disabled")
            self._worker._fence.fenced = lambda block_ids: False  # type: ignore[method-assign]

    def start_load_kv(self, forward_context, **kwargs):  # type: ignore[no-untyped-def]
        worker = self._worker
        assert worker is not None
        meta = self._meta()
        frac = float(os.environ.get("MEMCACHE_TEST_DROP_FROM", "0.5"))
        for job in meta.loads:
            self._drop(worker, job, frac)
        super().start_load_kv(forward_context, **kwargs)

    @staticmethod
    def _drop(worker, job: LoadJob, frac: float) -> None:  # type: ignore[no-untyped-def]
        first = int(len(job.names) * frac)
        keys = worker.keys(job.names[first:])
        mover = worker._mover
        if keys and mover is not None and mover.layout.on_host:
            for block_id in job.block_ids[first:]:
                for ptr, size in zip(*mover.layout.pieces(block_id), strict=True):
                    ctypes.memset(ptr, 0x3C, size)
        if keys and worker._store is not None:
            codes = worker._store.remove_batch(keys)
            logger.warning("faulty_connector: removed %d of %d blocks of %s before loading: %s",
                           len(keys), len(job.names), job.req_id, codes)
