"""Scheduler side of the MemCache connector (runs in vLLM's EngineCore process).

It holds a pure pool client (:mod:`memcache_vllm.pool_client`: no pool memory, no payload) and answers
"how many more prompt tokens can be loaded" with one batched existence call per lookup, covering every
rank's key of every candidate block (one key for all TP ranks of an MLA model, ``Namespace.ranks``). The
hit is the longest run of blocks, starting right after vLLM's local hit, whose keys exist for all
ranks; it never includes the last prompt token (vLLM must compute it to sample).

Keys use the namespace the workers computed from the KV caches they hold (``MemCacheHandshake``,
received once before serving); until it arrives every lookup is a miss.

Each step it tells the workers which blocks to load (from ``update_state_after_alloc``) and which newly
filled blocks to save. Save bookkeeping keeps the source blocks alive: a request with saves issued is
freed only when the workers report its saves done (``request_finished`` returns True), and preempted
requests are passed on so the workers finish their in-flight saves before the next forward can
overwrite the freed blocks.

Load failures: when workers report blocks that did not load, vLLM reschedules every request whose
computed blocks include one; afterwards (``update_connector_output``) this side acknowledges the ranks'
failure epochs (lifting their save fences), rewinds those requests' saves to the first failed block, and
names the blocks already handed to saves after it for removal. The failed blocks and every block
computed over them are poisoned (:mod:`memcache_vllm.poison`) until they are rewritten: they are evicted
from vLLM's prefix cache at once (vLLM keeps them there under ``recompute``, and a request that is
aborted or preempted before recomputing them would leave them to the next request with that prefix),
and no save is issued over them.

``kv_load_failure_policy``: the connector makes it ``recompute`` (a block that does not load is a miss
vLLM recomputes) unless its ``load_failure_policy`` is ``fail`` (``config.apply_load_failure_policy``).

KV events (:mod:`memcache_vllm.events`): with vLLM's KV events on, the blocks whose saves every
rank confirmed are announced as ``BlockStored`` (medium ``CPU``) through ``take_events``, on the
engine's own publisher; ``BlockRemoved`` when a lookup finds one gone, or the connector removes it.

``reset_cache`` (``reset_prefix_cache(reset_connector=True)``, e.g. after a weight update) moves to a
new random namespace epoch, so no block written before is ever read again, and removes the old
epochs' keys from the pool.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from memcache_vllm.config import ConnectorConfig, RolePolicy, apply_load_failure_policy
from memcache_vllm.events import PoolEvents
from memcache_vllm.keys import AdapterDigests, Namespace, block_hashes_hex, block_names
from memcache_vllm.layout import check_kv_cache_config
from memcache_vllm.metadata import (
    LoadJob,
    MemCacheConnectorMetadata,
    MemCacheHandshake,
    MemCacheWorkerMetadata,
    SaveJob,
)
from memcache_vllm.poison import PoisonedBlocks, Write
from memcache_vllm.pool_client import PoolClient
from memcache_vllm.request_state import LOOKUP_REUSE_S, Lookup, SaveTracker
from memcache_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm." + __name__)


class MemCacheScheduler:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig,
                 policy: RolePolicy, stats: StatsRecorder) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        check_kv_cache_config(kv_cache_config)
        self.block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if self.block_size % hash_block_size:
            raise ValueError(f"block size {self.block_size} is not a multiple of the hash block size "
                             f"{hash_block_size}")
        self._ratio = self.block_size // hash_block_size
        self._cfg = cfg
        self._policy = policy
        self._stats = stats
        self.namespace: Namespace | None = None
        """The workers' namespace (handshake); None until they sent it: every lookup misses."""
        self.epoch = "0"
        self._stale_heads: list[str] = []
        """Key heads of epochs left by ``reset_cache`` whose keys are not yet removed."""
        self._client = PoolClient(cfg)
        self._adapters = AdapterDigests()
        self._reloaded: set[str] = set()
        """Requests whose adapter reload (``load_inplace``) is already accounted for."""
        self._null_block_id = 0
        self._requests: dict[str, Request] = {}
        self._lookups: dict[str, Lookup] = {}
        self._trackers: dict[str, SaveTracker] = {}
        self._pending_loads: list[LoadJob] = []
        self._handled_failures: dict[tuple[int, ...], int] = {}
        self._pending_removals: dict[str, list[str]] = {}
        self._poisoned = PoisonedBlocks(self.block_size)
        self._block_pool: Any = None
        kec = getattr(vllm_config, "kv_events_config", None)
        self.events = PoolEvents(bool(getattr(kec, "enable_kv_cache_events", False)), self.block_size, self._ratio)
        self.load_failure_policy = apply_load_failure_policy(getattr(vllm_config, "kv_transfer_config", None), cfg,
                                                             policy.can_load)
        logger.info("MemCacheConnector scheduler: load=%s save=%s load_async=%s save_async=%s",
                    policy.can_load, policy.can_save, cfg.load_async, cfg.save_async)

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool
        null = getattr(block_pool, "null_block", None)
        if null is not None:
            self._null_block_id = int(null.block_id)

    def set_handshake(self, metadata: dict[Any, Any]) -> None:
        """The workers' namespaces (one per rank): they must agree."""
        spaces = {m.namespace for m in metadata.values() if isinstance(m, MemCacheHandshake)}
        if len(spaces) != 1:
            raise ValueError(f"MemCacheConnector: workers report {len(spaces)} key namespaces "
                             f"({spaces}); every rank must hold the same KV layout")
        self.namespace = spaces.pop()
        logger.info("MemCacheConnector scheduler: keys %s<block>",
                    self.namespace.rank_prefix(self.epoch, 0, 0))

    # -- names -----------------------------------------------------------------------------

    def _num_hashed_blocks(self, request: Request) -> int:
        return len(request.block_hashes) // self._ratio

    def _adapter_tag(self, request: Request) -> str | None:
        lora = getattr(request, "lora_request", None)
        if not lora:
            return None
        # A load_inplace request makes the workers load the adapter's files again: once per request.
        reload = bool(getattr(lora, "load_inplace", False)) and request.request_id not in self._reloaded
        tag = self._adapters.tag(int(lora.lora_int_id), str(lora.lora_path), reload)
        if reload:
            self._reloaded.add(request.request_id)
        return tag

    def _names(self, request: Request, start: int, end: int) -> list[str]:
        return block_names(block_hashes_hex(request.block_hashes, start, end, self._ratio),
                           self._adapter_tag(request))

    # -- lookups ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if not self._policy.can_load or self.namespace is None:
            return 0, False
        start = num_computed_tokens // self.block_size
        # The last prompt token is always computed, so the block holding it is never loaded.
        end = min((request.num_tokens - 1) // self.block_size, self._num_hashed_blocks(request))
        if end <= start:
            return 0, False
        prev = self._lookups.get(request.request_id)
        if prev is not None and prev.start_block == start and time.monotonic() - prev.at < LOOKUP_REUSE_S:
            hit = prev.hit_blocks
        else:
            hit = self._lookup(request, start, end)
            self._lookups[request.request_id] = Lookup(start, hit)
        tokens = (start + hit) * self.block_size - num_computed_tokens
        if tokens <= 0:
            return 0, False
        return tokens, self._cfg.load_async

    def _lookup(self, request: Request, start: int, end: int) -> int:
        assert self.namespace is not None
        try:
            names = self._names(request, start, end)
        except OSError as exc:
            logger.warning("MemCacheConnector: LoRA adapter of %s cannot be identified (%s): a miss",
                           request.request_id, exc)
            return 0
        ranks = self.namespace.ranks
        keys: list[str] = []
        for rank in ranks:
            keys.extend(self.namespace.keys(self.epoch, names, *rank))
        codes = self._client.exists(keys)
        n = len(names)
        if codes is None:
            self._stats.add(lookups=1, lookup_errors=1)
            return 0
        hit = 0
        while hit < n and all(codes[r * n + hit] == 1 for r in range(len(ranks))):
            hit += 1
        self.events.gone([names[i] for i in range(n) if any(codes[r * n + i] == 0 for r in range(len(ranks)))])
        errors = int(any(c < 0 for c in codes))
        self._stats.add(lookups=1, lookup_errors=errors, hit_blocks=hit, hit_tokens=hit * self.block_size)
        logger.debug("MemCacheConnector: request %s blocks [%d, %d): %d in the pool",
                     request.request_id, start, end, hit)
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        # Admitted: the cached lookup answered a waiting request; once preempted and waiting again,
        # the request must be asked anew (its blocks may have been saved since).
        lookup = self._lookups.pop(rid, None)
        if num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        if lookup is None or num_external_tokens % self.block_size or n > lookup.hit_blocks:
            # vLLM would treat blocks as loaded that nobody loads: refuse rather than serve garbage.
            raise RuntimeError(f"MemCacheConnector: request {rid} was allocated {num_external_tokens} "
                               f"external tokens that no lookup promised ({lookup})")
        start, end = lookup.start_block, lookup.start_block + n
        block_ids = list(blocks.get_block_ids()[0][start:end])
        if self._null_block_id in block_ids:
            raise RuntimeError(f"MemCacheConnector: request {rid} would load into vLLM's null block")
        self._pending_loads.append(LoadJob(rid, block_ids, self._names(request, start, end),
                                           self._cfg.load_async))
        self._poisoned.loaded(block_ids)
        tracker = self._trackers.setdefault(rid, SaveTracker())
        tracker.block_ids = list(blocks.get_block_ids()[0])
        tracker.next_block = max(tracker.next_block, end)

    def update_connector_output(self, invalid_block_ids: set[int],
                                worker_meta: MemCacheWorkerMetadata | None) -> None:
        """Called after vLLM rescheduled the requests that read a block which failed to load.

        Their saves restart at the first failed block (they are saved again once recomputed),
        blocks already handed to saves after it are named for removal, and the ranks' failure
        epochs are acknowledged so that their save fences lift from the next step on. The failed
        blocks, and every block after one in a request holding it, are poisoned and evicted from
        vLLM's prefix cache.
        """
        if invalid_block_ids:
            self._evict(self._poisoned.failed(
                invalid_block_ids, [t.block_ids for t in self._trackers.values()]))
            for rid, tracker in self._trackers.items():
                for i, block_id in enumerate(tracker.block_ids[:tracker.next_block]):
                    if block_id in invalid_block_ids:
                        tracker.next_block = i
                        poisoned = sorted(j for j in tracker.issued if j > i)
                        if poisoned:
                            names = [tracker.issued.pop(j) for j in poisoned]
                            self._pending_removals.setdefault(rid, []).extend(names)
                            self.events.removed(names)
                        break
        if worker_meta is not None:
            for rank, epoch in worker_meta.failure_epochs.items():
                self._handled_failures[rank] = max(epoch, self._handled_failures.get(rank, 0))
            self.events.saves_done(worker_meta.saved_keys, worker_meta.unsaved_keys)

    # -- saves -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MemCacheConnectorMetadata:
        meta = MemCacheConnectorMetadata(loads=self._pending_loads, epoch=self.epoch,
                                         handled_failures=dict(self._handled_failures),
                                         remove=self._pending_removals)
        self._pending_loads = []
        self._pending_removals = {}
        meta.preempted_req_ids = set(scheduler_output.preempted_req_ids or ())
        for rid in meta.preempted_req_ids:
            tracker = self._trackers.get(rid)
            if tracker is not None:
                # The workers finish its in-flight saves before this step's forward.
                tracker.has_saves = False
                tracker.block_ids = []
        # Every scheduled request's blocks are tracked (saves, and the blocks poisoned by a
        # failed load), then what the step computes is applied to the poisoned blocks.
        scheduled = scheduler_output.num_scheduled_tokens
        steps: list[tuple[str, SaveTracker, int]] = []
        writes: list[Write] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.setdefault(new.req_id, SaveTracker())
            tracker.block_ids = list(new.block_ids[0])
            tracker.next_block = max(tracker.next_block, new.num_computed_tokens // self.block_size)
            end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            steps.append((new.req_id, tracker, end))
            writes.append(Write(tracker.block_ids, new.num_computed_tokens, end))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracker = self._trackers.get(rid)
            if tracker is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tracker.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracker.block_ids.extend(new_ids[0])
            end = cached.num_computed_tokens[i] + scheduled.get(rid, 0)
            steps.append((rid, tracker, end))
            writes.append(Write(tracker.block_ids, cached.num_computed_tokens[i], end))
        if len(self._poisoned) and self._block_pool is not None:
            # Poisoned blocks are out of the prefix cache; once nobody holds one, its next owner
            # writes it in full before reading it.
            blocks = self._block_pool.blocks
            self._poisoned.forget(lambda b: blocks[b].ref_cnt > 0)
        self._evict(self._poisoned.step(writes))
        if not self._policy.can_save or self.namespace is None:
            return meta
        for rid, tracker, end in steps:
            self._add_save(meta, rid, tracker, end)
        return meta

    def _evict(self, block_ids: set[int]) -> None:
        """Evict poisoned blocks from vLLM's prefix cache: no request gets a local hit on them."""
        if not block_ids:
            return
        if self._block_pool is None:
            logger.error("MemCacheConnector: %d poisoned blocks cannot be evicted from the prefix "
                         "cache: vLLM bound no block pool", len(block_ids))
            return
        self._block_pool.evict_blocks(block_ids)
        self._stats.add(poisoned_evicted=len(block_ids))
        logger.warning("MemCacheConnector: evicted %d blocks from the prefix cache: they failed to "
                       "load or were computed over one that did", len(block_ids))

    def _add_save(self, meta: MemCacheConnectorMetadata, rid: str, tracker: SaveTracker,
                  computed_after_step: int) -> None:
        request = self._requests.get(rid)
        if request is None:
            return
        limit = min(computed_after_step // self.block_size, self._num_hashed_blocks(request),
                    len(tracker.block_ids))
        if not self._cfg.save_decode_cache:
            limit = min(limit, request.num_prompt_tokens // self.block_size)
        if limit <= tracker.next_block:
            return
        if self._poisoned.any(tracker.block_ids[:limit]):
            # Computed over a block that failed to load and is not rewritten yet: not saved now,
            # tried again once the request computes further (it may be rewritten by then).
            self._stats.add(save_poisoned_blocks=limit - tracker.next_block)
            return
        start = tracker.next_block
        block_ids = tracker.block_ids[start:limit]
        if self._null_block_id in block_ids:
            logger.error("MemCacheConnector: request %s has vLLM's null block among blocks to save; "
                         "not saving them", rid)
            tracker.next_block = limit
            return
        try:
            names = self._names(request, start, limit)
        except OSError as exc:
            logger.warning("MemCacheConnector: LoRA adapter of %s cannot be identified (%s): "
                           "not saving", rid, exc)
            tracker.next_block = limit
            return
        meta.saves.append(SaveJob(rid, block_ids, names, tracker.block_ids[:limit]))
        if self.events.enabled and self.namespace is not None:
            self.events.saves_issued(request, start, names, self.namespace.rank_keys(self.epoch, names))
        tracker.issued.update(zip(range(start, limit), names, strict=True))
        tracker.next_block = limit
        tracker.has_saves = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        self._reloaded.discard(rid)
        tracker = self._trackers.pop(rid, None)
        delay_free = bool(tracker and tracker.has_saves and self._cfg.save_async)
        return delay_free, None

    # -- reset -----------------------------------------------------------------------------

    def reset_cache(self) -> bool:
        """Never read a block written before this call again, and remove the old blocks.

        The namespace moves to a new random epoch at once (the next step's loads, saves and every
        later lookup use it; a random epoch cannot meet another instance's). Then every epoch left
        behind is removed from the pool with one ``remove_by_prefix`` each. Returns True when
        the old keys are gone; False when the removal failed (they stay unreachable for this
        instance, and the next reset retries them).
        """
        if self.namespace is None:
            logger.error("MemCacheConnector: reset_cache before the workers sent their namespace")
            return False
        self._stale_heads.append(self.namespace.epoch_head(self.epoch))
        self.epoch = os.urandom(8).hex()
        self._lookups.clear()
        self.events.cleared()
        self._stats.add(resets=1)
        logger.info("MemCacheConnector: reset_cache: namespace epoch now %s", self.epoch)
        ok = True
        for head in list(self._stale_heads):
            try:
                removed = self._client.remove_by_prefix(head)
            except Exception as exc:
                logger.error("MemCacheConnector: reset_cache could not remove keys under %s: %s",
                             head, exc)
                ok = False
                continue
            if removed < 0:
                logger.error("MemCacheConnector: reset_cache: remove_by_prefix(%s) returned %d",
                             head, removed)
                ok = False
                continue
            logger.info("MemCacheConnector: reset_cache removed %d keys under %s", removed, head)
            self._stale_heads.remove(head)
        return ok

    def shutdown(self) -> None:
        self._client.close()
