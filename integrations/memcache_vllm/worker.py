"""Worker side of the MemCache connector (runs in each vLLM worker process).

It joins the pool as a LocalService (``init_bm=True``: its ``dram_size`` becomes part of the pool;
with ``dram_size`` 0 it is a client and its blocks live in the pool's other segments),
registers the KV cache tensors, and moves whole blocks of all its layers as layered objects, one
key per block per rank (``batch_put_from_layers`` / ``batch_get_into_layers``).

* Loads: synchronous ones run in ``start_load_kv`` before the forward; asynchronous ones run on a
  background thread and are reported through ``get_finished`` exactly once, failed or not.
  A block that does not load (missing, evicted, pool down) is reported through
  ``get_block_ids_with_load_errors`` no later than its request's completion, so vLLM recomputes it.
* Failed loads fence saves: every failed block gets the rank's next failure epoch; a save whose
  request's blocks up to the saved ones include a fenced block is skipped (it was computed over
  bytes that did not load), until the scheduler acknowledges that epoch (vLLM has rescheduled the
  affected requests, which recompute and save again). Keys the scheduler names as written from
  such steps (by other ranks, or before the failure was known) are removed.
* Saves: issued in ``wait_for_save`` after the forward filled the blocks. Asynchronous saves keep
  their source blocks alive: a finished request is reported in ``finished_sending`` only when its
  saves are done (the scheduler delays the free until then), and a preempted request's in-flight
  saves are waited for before the next forward may overwrite its freed blocks.
* MLA: every TP rank holds the same latent KV, so one copy is kept under a key without a TP rank;
  TP rank 0 saves it, every rank loads it (``Namespace.tp_shared``).
* ``use_layerwise``: loads and saves move layer by layer during the forward (``layerwise.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from memcache_vllm.config import ConnectorConfig, RolePolicy
from memcache_vllm.fence import LoadFailureFence
from memcache_vllm.keys import Namespace
from memcache_vllm.layerwise import LayerwiseWorker
from memcache_vllm.layout import (
    BlockLayout,
    check_kv_cache_config,
    current_layout_signature,
    describe,
)
from memcache_vllm.metadata import (
    LoadJob,
    MemCacheConnectorMetadata,
    MemCacheHandshake,
    MemCacheWorkerMetadata,
    SaveJob,
)
from memcache_vllm.mover import BlockMover
from memcache_vllm.stats import StatsRecorder

logger = logging.getLogger("vllm." + __name__)

STORE_RETRY_S = 5.0


def _parallel_ranks(pcp_size: int) -> tuple[int, int, int]:
    """(TP rank, PP rank, prefill-context-parallel rank) of this worker. Without parallel groups
    (single-process use) it is rank 0 of 1; any other failure propagates and the worker refuses to
    start: guessing rank 0 would make every rank write rank 0's keys over each other's."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 0, 0
    pcp = int(ps.get_pcp_group().rank_in_group) if pcp_size > 1 else 0
    return int(ps.get_tensor_model_parallel_rank()), int(ps.get_pp_group().rank_in_group), pcp


class MemCacheWorker:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig,
                 policy: RolePolicy, stats: StatsRecorder) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        check_kv_cache_config(kv_cache_config)
        self._vllm_config = vllm_config
        self._cfg = cfg
        self._policy = policy
        self._stats = stats
        self._kv_cache_config = kv_cache_config
        self.block_size, _ = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        pc = vllm_config.parallel_config
        self.tp_rank, self.pp_rank, self.pcp_rank = _parallel_ranks(
            int(getattr(pc, "prefill_context_parallel_size", 1) or 1))
        self.namespace: Namespace | None = None
        self.epoch = "0"
        self._local_rank = int(getattr(vllm_config.parallel_config, "local_rank", 0) or 0)
        self._layout: BlockLayout | None = None
        self._mover: BlockMover | None = None
        self._store: Any = None
        self._store_retry_at = 0.0
        self._store_lock = threading.Lock()
        # One thread per direction keeps each direction in order and off the forward's path.
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="memcache-save")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="memcache-load")
        self._save_futures: dict[str, list[Future]] = {}
        self._reqs_with_saves: set[str] = set()
        self._finishing: set[str] = set()
        self._load_done: queue.SimpleQueue[tuple[str, list[int]]] = queue.SimpleQueue()
        self._invalid_blocks: set[int] = set()
        self._fence = LoadFailureFence()
        self._begun: MemCacheConnectorMetadata | None = None
        self._layerwise: LayerwiseWorker | None = None
        self._saves_lock = threading.Lock()
        self._saved_keys: list[str] = []
        self._unsaved_keys: list[str] = []
        """Keys whose saves ended since the last ``worker_meta``, in the pool or not (the
        scheduler announces a block once every rank's key is in the pool)."""

    @property
    def rank(self) -> tuple[int, int, int]:
        return self.tp_rank, self.pp_rank, self.pcp_rank

    def key_prefix(self) -> str:
        assert self.namespace is not None
        return self.namespace.rank_prefix(self.epoch, *self.rank)

    def keys(self, names: list[str]) -> list[str]:
        assert self.namespace is not None
        return self.namespace.keys(self.epoch, names, *self.rank)

    @property
    def saves(self) -> bool:
        """Whether this rank writes blocks: not a TP rank other than 0 of an MLA model, whose copy
        is rank 0's (``Namespace.tp_shared``); it still loads, and reports its requests' saves as
        done so that vLLM frees their blocks."""
        return self.namespace is not None and self.namespace.saves(self.tp_rank)

    # -- setup -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()))
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or first.shape[0])
        self._layout = describe(kv_caches, num_blocks)
        signature = current_layout_signature(self._vllm_config, kv_caches, num_blocks)
        self.namespace = Namespace.build(self._vllm_config, self.block_size, self._cfg.cache_prefix,
                                         signature, self._cfg.weights_full_hash)
        logger.info("MemCacheConnector worker tp%d pp%d: KV layout %s, keys %s<block>",
                    self.tp_rank, self.pp_rank, signature, self.key_prefix())
        self._mover_or_none()

    def handshake(self) -> MemCacheHandshake | None:
        return MemCacheHandshake(self.namespace) if self.namespace is not None else None

    def _mover_or_none(self) -> BlockMover | None:
        """The mover, joining the pool first if needed (retried every few seconds when it fails)."""
        if self._mover is not None or self._layout is None:
            return self._mover
        with self._store_lock:
            if self._mover is not None or time.monotonic() < self._store_retry_at:
                return self._mover
            try:
                self._mover = self._join_pool(self._layout)
            except Exception as exc:
                logger.warning("MemCacheConnector: cannot join the pool (%s); loads fail and saves "
                               "are skipped until it can", exc)
                self._store_retry_at = time.monotonic() + STORE_RETRY_S
            return self._mover

    def _join_pool(self, layout: BlockLayout) -> BlockMover:
        from memcache_core import open_store

        # each worker on this host its own metrics port: metrics_port + local rank
        local = self._cfg.worker_local_config(*self.rank).for_rank(self._local_rank)
        # dram_size 0: this instance contributes no memory; its blocks go to the other segments of
        # the pool (e.g. standalone ``memcache local-service`` processes) and outlive it.
        contributes = local.dram_bytes > 0
        store = open_store(local, self._local_rank, init_bm=contributes)
        mover = BlockMover(store, layout, self._stats)
        for ptr, size in mover.regions():
            rc = store.register_buffer(ptr, size)
            if rc != 0:
                store.close()
                raise RuntimeError(f"register_buffer({ptr:#x}, {size}) failed with code {rc}")
        self._store = store
        if self._cfg.use_layerwise and layout.on_host:
            self._layerwise = LayerwiseWorker(store, layout, self._cfg.layerwise_prefetch_layers, self._stats)
        elif self._cfg.use_layerwise:
            logger.warning("MemCacheConnector: use_layerwise serves KV caches in host memory; these are on %s, "
                           "so whole blocks are moved", layout.device)
        logger.info("MemCacheConnector worker tp%d pp%d joined %s (%s)",
                    self.tp_rank, self.pp_rank, local.meta_service_url,
                    f"contributing {local.dram_size}" if contributes else "client only")
        return mover

    # -- per step, before the forward --------------------------------------------------------

    def begin_step(self, meta: MemCacheConnectorMetadata) -> None:
        """Adopt the step's epoch, lift acknowledged fences, remove poisoned keys, and finish
        in-flight saves of preempted requests before their blocks can be reused.

        vLLM calls both ``handle_preemptions`` and ``bind_connector_metadata`` with the step's
        metadata; the first call does the work."""
        if meta is self._begun:
            return
        self._begun = meta
        if self._layerwise is not None:   # a step that ended in an exception: its saves are aborted
            self._failed(sorted(self._layerwise.abandon()))
        if meta.epoch != self.epoch:
            logger.info("MemCacheConnector worker tp%d pp%d: namespace epoch %s -> %s",
                        self.tp_rank, self.pp_rank, self.epoch, meta.epoch)
            self.epoch = meta.epoch
        handled = meta.handled_failures.get(self.rank)
        if handled is not None:
            self._fence.acknowledge(handled)
        if meta.remove:
            self._remove(meta.remove)
        for rid in meta.preempted_req_ids:
            self._wait_saves(rid)
            self._reqs_with_saves.discard(rid)

    def _remove(self, remove: dict[str, list[str]]) -> None:
        for rid in remove:
            self._wait_saves(rid)
        if not self.saves:
            return   # the rank that saved them removes them
        keys = self.keys([n for names in remove.values() for n in names])
        mover = self._mover_or_none()
        if not keys or mover is None:
            return
        try:
            codes = list(mover.store.remove_batch(keys))
        except Exception as exc:
            logger.error("MemCacheConnector: removing %d keys saved over a failed load failed: %s",
                         len(keys), exc)
            return
        removed = sum(1 for c in codes if c == 0)
        self._stats.add(poisoned_removed=removed)
        logger.warning("MemCacheConnector worker tp%d pp%d: removed %d of %d keys saved from steps "
                       "that read a block which failed to load", self.tp_rank, self.pp_rank,
                       removed, len(keys))

    # -- loads -----------------------------------------------------------------------------

    def start_load_kv(self, meta: MemCacheConnectorMetadata) -> None:
        self._mover_or_none()
        if self._layerwise is not None:
            ids = [b for j in meta.loads for b in j.block_ids]
            self._layerwise.start_load(ids, self.keys([n for j in meta.loads for n in j.names]))
            return
        sync_jobs = [j for j in meta.loads if not j.is_async]
        for job in meta.loads:
            if job.is_async:
                self._load_pool.submit(self._load_async, job, self.keys(job.names))
        if sync_jobs:
            ids = [b for j in sync_jobs for b in j.block_ids]
            keys = self.keys([n for j in sync_jobs for n in j.names])
            self._failed(self._load(ids, keys))

    def _failed(self, block_ids: list[int]) -> None:
        """Blocks that did not load: reported to vLLM, and fenced (no save computed over them)."""
        if not block_ids:
            return
        self._invalid_blocks.update(block_ids)
        self._fence.fail(block_ids)

    def _load(self, block_ids: list[int], keys: list[str]) -> list[int]:
        mover = self._mover_or_none()
        if mover is None:
            self._stats.add(load_failed_blocks=len(block_ids))
            return list(block_ids)
        return mover.load(block_ids, keys)

    def _load_async(self, job: LoadJob, keys: list[str]) -> None:
        failed = list(job.block_ids)
        try:
            failed = self._load(job.block_ids, keys)
        except Exception:
            logger.exception("MemCacheConnector: asynchronous load of %s failed", job.req_id)
        finally:
            self._load_done.put((job.req_id, failed))

    # -- saves -----------------------------------------------------------------------------

    def _is_fenced(self, job: SaveJob) -> bool:
        return self._fence.fenced(job.context_block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise is not None:
            self._layerwise.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, meta: MemCacheConnectorMetadata) -> None:
        if self._layerwise is None or not meta.saves or not self.saves:
            return
        self._layerwise.save_layer(layer_name, lambda: [(job.block_ids, self.keys(job.names))
                                                        for job in meta.saves if not self._is_fenced(job)])

    def _finish_layerwise(self, lw: LayerwiseWorker, meta: MemCacheConnectorMetadata) -> None:
        """After the forward: the step's load is whole (its failures reported and fenced), then its
        saves are published, except those computed over a block that failed to load."""
        self._failed(sorted(lw.finish_load()))
        fenced = [job for job in meta.saves if self.saves and self._is_fenced(job)]
        if fenced:
            n = sum(len(job.block_ids) for job in fenced)
            logger.warning("MemCacheConnector: not saving %d blocks: computed over a block that failed to load", n)
            self._stats.add(save_fenced_blocks=n)
        self._saves_ended(*lw.finish_save({b for job in fenced for b in job.block_ids}))

    def _saves_ended(self, saved: list[str], unsaved: list[str]) -> None:
        with self._saves_lock:
            self._saved_keys.extend(saved)
            self._unsaved_keys.extend(unsaved)

    def _save(self, mover: BlockMover, block_ids: list[int], keys: list[str]) -> None:
        saved: list[str] = []
        try:
            saved = mover.save(block_ids, keys)
        finally:
            done = set(saved)
            self._saves_ended(saved, [k for k in keys if k not in done])

    def wait_for_save(self, meta: MemCacheConnectorMetadata) -> None:
        if self._layerwise is not None:
            self._finish_layerwise(self._layerwise, meta)
            return
        if not meta.saves:
            return
        mover = self._mover_or_none()
        for job in meta.saves:
            if self._cfg.save_async:
                self._reqs_with_saves.add(job.req_id)
            if not self.saves:
                continue
            if self._is_fenced(job):
                logger.warning("MemCacheConnector: not saving %d blocks of %s: computed over a block "
                               "that failed to load", len(job.block_ids), job.req_id)
                self._stats.add(save_fenced_blocks=len(job.block_ids))
                self._saves_ended([], self.keys(job.names))
                continue
            if mover is None:
                self._stats.add(save_failed_blocks=len(job.block_ids))
                self._saves_ended([], self.keys(job.names))
                continue
            keys = self.keys(job.names)
            if not self._cfg.save_async or not mover.layout.on_host:
                # Device caches are copied out through one staging buffer, in the step.
                self._save(mover, job.block_ids, keys)
                continue
            fut = self._save_pool.submit(self._save, mover, job.block_ids, keys)
            self._save_futures.setdefault(job.req_id, []).append(fut)

    def _wait_saves(self, req_id: str) -> None:
        for fut in self._save_futures.pop(req_id, []):
            try:
                fut.result()
            except Exception:
                logger.exception("MemCacheConnector: save of %s failed", req_id)

    # -- completions -----------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for rid in finished_req_ids:
            if rid in self._reqs_with_saves:
                self._reqs_with_saves.discard(rid)
                self._finishing.add(rid)
        sending = {rid for rid in self._finishing
                   if all(f.done() for f in self._save_futures.get(rid, []))}
        for rid in sending:
            self._finishing.discard(rid)
            self._wait_saves(rid)
        recving: set[str] = set()
        while True:
            try:
                rid, failed = self._load_done.get_nowait()
            except queue.Empty:
                break
            recving.add(rid)
            self._failed(failed)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def worker_meta(self) -> MemCacheWorkerMetadata | None:
        """This rank's latest failure epoch, when it reported failures since the last call, and the
        keys its saves ended with since then."""
        epoch = self._fence.take_report()
        with self._saves_lock:
            saved, self._saved_keys = self._saved_keys, []
            unsaved, self._unsaved_keys = self._unsaved_keys, []
        if epoch is None and not saved and not unsaved:
            return None
        return MemCacheWorkerMetadata({self.rank: epoch} if epoch is not None else {}, saved, unsaved)

    def shutdown(self) -> None:
        if self._layerwise is not None:
            self._layerwise.shutdown()
        self._save_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception:
                logger.debug("MemCacheConnector: store close failed", exc_info=True)
            self._store = None
