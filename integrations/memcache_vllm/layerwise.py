"""Layer-wise KV transfer (``use_layerwise``): each layer's slice of a block moves on its own, over the
pool's GVA path (``batch_alloc`` / ``batch_copy_layers`` / ``batch_write_finish``, ``batch_get_key_info``
/ ``batch_add_lease`` / ``batch_remove_lease``), so loads overlap the forward and saves follow it.

Objects are the whole-block path's: one key per block per rank, the block's pieces of every layer end
to end in layer order (``BlockLayout.pieces``). Layer ``l``'s pieces are the bytes from
``layer_offsets[l]`` on, so either path reads what the other wrote (checksums included).

* Loads (``LayerLoad``, one per step): ``start_load_kv`` describes and leases the step's blocks, then a
  thread copies layer after layer into the KV caches; ``wait_for_layer_load(l)`` returns once layer
  ``l`` is in place. The thread stays at most ``layerwise_prefetch_layers`` layers ahead of the layer
  the forward waits for, so layers ``l+1 .. l+k`` load while layer ``l`` computes. A block that is
  missing, or a layer copy that fails, makes every block of the step's load a failed load
  (``get_block_ids_with_load_errors``: vLLM recomputes them). The leases are renewed while a long
  forward runs and removed when the last layer is in.
* Saves (``LayerSave``, one per step): the first ``save_kv_layer`` of a step reserves the step's new
  blocks (``batch_alloc``: unfinished objects, invisible to every reader); each ``save_kv_layer``
  copies that layer's slices on a thread, in layer order, as the forward goes on; ``wait_for_save``
  waits for the copies and publishes the objects whose every layer arrived (``batch_write_finish`` 0),
  aborting the others (a failed copy, a layer the forward never saved, a save computed over a block
  that failed to load, a step that ended in an exception). Nothing half-written is ever readable.
  Saves finish inside their step, so blocks are never freed under them.

KV caches on a CUDA device are not served layer by layer yet (the whole-block path's staging buffer
moves all layers of a block at once): there the worker logs it and moves whole blocks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from memcache_core import G2H, H2G
from memcache_vllm.layout import BlockLayout
from memcache_vllm.stats import StatsRecorder

logger = logging.getLogger("vllm." + __name__)

OBJECT_EXISTS = -3006
LAYER_WAIT_S = 60.0
"""The longest ``wait_for_layer_load`` waits for one layer before the step's load counts as failed."""
LEASE_MS = 10_000
"""Leases taken on the blocks a step loads, renewed each half of it while the forward runs."""


class LayerPlan:
    """Where each layer's slice of a block lies, in the KV caches and in the block's object."""

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout
        self.index = {layer.name: i for i, layer in enumerate(layout.layers)}
        self.offsets = list(itertools.accumulate([0] + [layer.block_bytes for layer in layout.layers]))[:-1]

    def pieces(self, layer: int, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Pointers and sizes of layer ``layer``'s pieces of each block."""
        lay = self.layout.layers[layer]
        base = lay.tensor.data_ptr()
        ptrs = [[base + b * lay.block_stride + off for off in lay.outer_offsets] for b in block_ids]
        return ptrs, [[lay.piece_bytes] * len(lay.outer_offsets)] * len(block_ids)

    def layer_of(self, name: str) -> int | None:
        return self.index.get(name)


def _gvas(store: Any, keys: list[str]) -> list[int]:
    """The first GVA of each key (0: no object)."""
    infos = store.batch_get_key_info(keys, 1)
    return [(info.gva_list() or [0])[0] if info is not None else 0 for info in infos]


class LayerLoad:
    """One step's layer-wise load of ``block_ids`` from ``keys``."""

    def __init__(self, store: Any, plan: LayerPlan, block_ids: list[int], keys: list[str], ahead: int,
                 lease_ms: int, stats: StatsRecorder, pool: ThreadPoolExecutor) -> None:
        self.store, self.plan, self.stats = store, plan, stats
        self.ahead = max(1, ahead)
        self.lease_ms = lease_ms
        n_layers = len(plan.layout.layers)
        self.done = [threading.Event() for _ in range(n_layers)]
        self.failed: set[int] = set()
        self._cond = threading.Condition()
        self._allowed = self.ahead - 1   # the thread may copy layers up to this one
        self._t0 = time.perf_counter()
        self.waited_s = 0.0
        try:
            gvas = _gvas(store, keys)
            present = [i for i, g in enumerate(gvas) if g]
            codes = list(store.batch_add_lease([keys[i] for i in present], lease_ms)) if present else []
        except Exception as exc:
            logger.warning("MemCacheConnector: layer-wise load of %d blocks could not start: %s", len(keys), exc)
            gvas, present, codes = [0] * len(keys), [], []
        leased = [i for i, c in zip(present, codes, strict=True) if c == 0]
        self.failed.update(block_ids[i] for i in set(range(len(keys))) - set(leased))
        self.block_ids = [block_ids[i] for i in leased]
        self.keys = [keys[i] for i in leased]
        self.gvas = [gvas[i] for i in leased]
        self.all_block_ids = list(block_ids)
        self.future: Future | None = pool.submit(self._run) if self.keys else None
        if self.future is None:
            for ev in self.done:
                ev.set()

    def _run(self) -> None:
        leased_at = time.monotonic()
        try:
            for layer in range(len(self.done)):
                with self._cond:
                    while layer > self._allowed:
                        self._cond.wait()
                if time.monotonic() - leased_at > self.lease_ms / 2000.0:   # a long forward: renew
                    codes = list(self.store.batch_add_lease(self.keys, self.lease_ms))
                    leased_at = time.monotonic()
                    if any(c != 0 for c in codes):
                        raise RuntimeError(f"renewing the leases failed: codes {sorted(set(codes))}")
                ptrs, sizes = self.plan.pieces(layer, self.block_ids)
                off = self.plan.offsets[layer]
                rc = self.store.batch_copy_layers([g + off for g in self.gvas], ptrs, sizes, G2H)
                if rc != 0:
                    raise RuntimeError(f"batch_copy_layers of layer {layer} returned {rc}")
                self.done[layer].set()
        except Exception as exc:
            logger.warning("MemCacheConnector: layer-wise load of %d blocks failed: %s; they will be "
                           "recomputed", len(self.keys), exc)
            self.failed.update(self.block_ids)
        finally:
            for ev in self.done:
                ev.set()
            try:
                self.store.batch_remove_lease(self.keys)
            except Exception:
                logger.debug("MemCacheConnector: removing leases failed", exc_info=True)

    def wait(self, layer: int) -> None:
        """Return once ``layer`` is in place (or failed); let the thread run ``ahead`` layers further."""
        with self._cond:
            self._allowed = max(self._allowed, layer + self.ahead)
            self._cond.notify_all()
        t0 = time.perf_counter()
        if not self.done[layer].wait(LAYER_WAIT_S):
            logger.warning("MemCacheConnector: layer %d did not load in %.0f s; the step's blocks count as "
                           "failed loads", layer, LAYER_WAIT_S)
            self.failed.update(self.all_block_ids)
        self.waited_s += time.perf_counter() - t0

    def finish(self) -> set[int]:
        """Wait for the rest (after the forward); the block ids that did not load."""
        with self._cond:
            self._allowed = len(self.done)
            self._cond.notify_all()
        if self.future is not None:
            self.future.result()
        n_ok = len(self.all_block_ids) - len(self.failed)
        self.stats.add(load_blocks=n_ok, load_bytes=n_ok * self.plan.layout.block_bytes,
                       load_failed_blocks=len(self.failed), load_time_s=time.perf_counter() - self._t0,
                       layer_wait_s=self.waited_s)
        return set(self.failed)


class LayerSave:
    """One step's layer-wise save of blocks ``block_ids`` under ``keys``."""

    def __init__(self, store: Any, plan: LayerPlan, block_ids: list[int], keys: list[str],
                 stats: StatsRecorder, pool: ThreadPoolExecutor) -> None:
        self.store, self.plan, self.stats, self.pool = store, plan, stats, pool
        self.all_keys = list(keys)
        self._t0 = time.perf_counter()
        self.skipped = 0
        self.failed: set[str] = set()
        self.copied: dict[str, set[int]] = {}
        self.futures: list[Future] = []
        try:
            codes = list(store.batch_alloc(keys, [plan.layout.block_bytes] * len(keys)))
        except Exception as exc:
            logger.warning("MemCacheConnector: layer-wise save of %d blocks could not start: %s", len(keys), exc)
            codes = [-1] * len(keys)
        mine = [i for i, c in enumerate(codes) if c == 0]
        self.existing = [k for k, c in zip(keys, codes, strict=False) if c == OBJECT_EXISTS]
        self.skipped = len(self.existing)   # already in the pool: nothing to do
        self.failed_alloc = len(keys) - len(mine) - self.skipped
        self.block_ids = [block_ids[i] for i in mine]
        self.keys = [keys[i] for i in mine]
        try:
            self.gvas = _gvas(store, self.keys) if self.keys else []
        except Exception as exc:
            logger.warning("MemCacheConnector: describing %d reserved blocks failed: %s", len(self.keys), exc)
            self.gvas = [0] * len(self.keys)
        self.failed.update(k for k, g in zip(self.keys, self.gvas, strict=True) if not g)
        self.copied = {k: set() for k in self.keys}

    def layer(self, layer: int) -> None:
        """Copy layer ``layer``'s slices (on the save thread: copies stay in layer order)."""
        if self.keys:
            self.futures.append(self.pool.submit(self._copy, layer))

    def _copy(self, layer: int) -> None:
        ptrs, sizes = self.plan.pieces(layer, self.block_ids)
        off = self.plan.offsets[layer]
        try:
            rc = self.store.batch_copy_layers([g + off for g in self.gvas], ptrs, sizes, H2G)
        except Exception as exc:
            logger.warning("MemCacheConnector: layer-wise save of layer %d failed: %s", layer, exc)
            rc = None
        if rc != 0:
            if rc is not None:
                logger.warning("MemCacheConnector: layer-wise save of layer %d of %d blocks failed (code %d); "
                               "they are aborted", layer, len(self.keys), rc)
            self.failed.update(self.keys)
            return
        for k in self.keys:
            self.copied[k].add(layer)

    def finish(self, abort_blocks: set[int]) -> list[str]:
        """Wait for the copies; publish every object all of whose layers arrived, abort the rest (and
        the blocks in ``abort_blocks``: computed over a block that failed to load). Returns the keys
        now in the pool (published here, or already there)."""
        for fut in self.futures:
            fut.result()
        n_layers = len(self.plan.layout.layers)
        results = [0 if k not in self.failed and len(self.copied[k]) == n_layers and b not in abort_blocks else 1
                   for k, b in zip(self.keys, self.block_ids, strict=True)]
        codes = [1] * len(self.keys)
        if self.keys:
            try:
                codes = list(self.store.batch_write_finish(self.keys, results))
            except Exception as exc:
                logger.warning("MemCacheConnector: finishing %d layer-wise saved blocks failed: %s (the pool "
                               "reclaims them)", len(self.keys), exc)
        if len(codes) != len(self.keys):
            logger.warning("MemCacheConnector: %d codes for %d layer-wise saved blocks", len(codes), len(self.keys))
            codes = [1] * len(self.keys)
        published = [k for k, r, c in zip(self.keys, results, codes, strict=True) if r == 0 and c == 0]
        saved = len(published)
        failed = len(self.keys) - saved + self.failed_alloc
        self.stats.add(save_blocks=saved, save_bytes=saved * self.plan.layout.block_bytes,
                       save_failed_blocks=failed, save_time_s=time.perf_counter() - self._t0)
        if failed:
            logger.info("MemCacheConnector: %d of %d blocks not saved layer by layer", failed,
                        len(self.keys) + self.skipped + self.failed_alloc)
        return published + self.existing

    def abort(self) -> None:
        """The step ended without ``wait_for_save`` (an exception in the forward): abort everything."""
        for fut in self.futures:
            fut.exception()
        self.finish(set(self.block_ids))


class LayerwiseWorker:
    """The worker's layer-wise half: the step's load and save, and the threads that move them."""

    def __init__(self, store: Any, layout: BlockLayout, ahead: int, stats: StatsRecorder) -> None:
        self.store = store
        self.plan = LayerPlan(layout)
        self.ahead = ahead
        self.lease_ms = LEASE_MS
        self.stats = stats
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="memcache-layer-load")
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="memcache-layer-save")
        self.load: LayerLoad | None = None
        self.save: LayerSave | None = None

    def start_load(self, block_ids: list[int], keys: list[str]) -> None:
        if block_ids:
            self.load = LayerLoad(self.store, self.plan, block_ids, keys, self.ahead, self.lease_ms, self.stats,
                                  self._load_pool)

    def wait_for_layer(self, name: str) -> None:
        layer = self.plan.layer_of(name)
        if self.load is not None and layer is not None:
            self.load.wait(layer)

    def save_layer(self, name: str, jobs: Callable[[], list[tuple[list[int], list[str]]]]) -> None:
        """``jobs()``: the step's (block ids, keys) to save, asked for at the step's first layer."""
        layer = self.plan.layer_of(name)
        if layer is None:
            return
        if self.save is None:
            todo = jobs()
            ids = [b for b_ids, _ in todo for b in b_ids]
            keys = [k for _, ks in todo for k in ks]
            if not ids:
                return
            self.save = LayerSave(self.store, self.plan, ids, keys, self.stats, self._save_pool)
        self.save.layer(layer)

    def finish_load(self) -> set[int]:
        load, self.load = self.load, None
        return load.finish() if load is not None else set()

    def finish_save(self, abort_blocks: set[int]) -> tuple[list[str], list[str]]:
        """The step's save is published; (keys in the pool, keys not saved)."""
        save, self.save = self.save, None
        if save is None:
            return [], []
        saved = save.finish(abort_blocks)
        done = set(saved)
        return saved, [k for k in save.all_keys if k not in done]

    def abandon(self) -> set[int]:
        """A step that never reached ``wait_for_save``: end its load, abort its save; the block ids
        that did not load."""
        failed = self.finish_load()
        save, self.save = self.save, None
        if save is not None:
            logger.warning("MemCacheConnector: a step ended before wait_for_save; aborting its %d "
                           "layer-wise saves", len(save.keys))
            save.abort()
        return failed

    def shutdown(self) -> None:
        self.abandon()
        self._load_pool.shutdown(wait=True)
        self._save_pool.shutdown(wait=True)
