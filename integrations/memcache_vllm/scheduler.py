"""Scheduler side of the MemCache connector (runs in vLLM's EngineCore process).

It holds a pure pool client (``init(device_id, init_bm=False)``: no pool memory, no payload) and
answers "how many more prompt tokens can be loaded" with one batched existence call per lookup,
covering every rank's key of every candidate block. The hit is the longest run of blocks, starting
right after vLLM's local hit, whose keys exist for all ranks; it never includes the last prompt
token (vLLM must compute it to sample).

Each step it tells the workers which blocks to load (from ``update_state_after_alloc``) and which
newly filled blocks to save. Save bookkeeping keeps the source blocks alive: a request with
saves issued is freed only when the workers report its saves done (``request_finished`` returns
True), and preempted requests are passed on so the workers finish their in-flight saves before
the next forward can overwrite the freed blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memcache_vllm.config import ConnectorConfig, RolePolicy
from memcache_vllm.keys import KeySpace, block_hashes_hex
from memcache_vllm.metadata import LoadJob, MemCacheConnectorMetadata, SaveJob
from memcache_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm." + __name__)

# Longest wait of a scheduler lookup for the MetaService: a slow pool must cost a miss, not a stall.
LOOKUP_TIMEOUT_S = 2.0


# A request that waits (no free blocks yet) is asked about every step; its answer is reused this
# long, so a waiting request costs one existence call, not one per step.
LOOKUP_REUSE_S = 1.0


@dataclass
class _Lookup:
    start_block: int
    hit_blocks: int
    at: float = field(default_factory=time.monotonic)


@dataclass
class _SaveTracker:
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0
    """Blocks below this are computed elsewhere (local or pool hit) or already handed to a save."""
    has_saves: bool = False
    """Saves were issued since the request's last preemption (its free must wait for them)."""


class PoolClient:
    """A metadata-only pool client that turns failures into misses and backs off after them."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self._cfg = cfg
        self._store: Any = None
        self._down_until = 0.0

    def _connect(self) -> Any:
        from memcache_core import DistributedObjectStore

        local = self._cfg.local_config()
        local.client_timeout_seconds = min(float(local.client_timeout_seconds), LOOKUP_TIMEOUT_S)
        store = DistributedObjectStore()
        rc = store.setup(local)
        if rc == 0:
            rc = store.init(0, init_bm=False)
        if rc != 0:
            store.close()
            raise ConnectionError(f"pool client init failed with code {rc}")
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

    def close(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # best effort at shutdown
                logger.debug("MemCacheConnector: closing the lookup client failed", exc_info=True)
            self._store = None


class MemCacheScheduler:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig,
                 policy: RolePolicy, stats: StatsRecorder) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(f"MemCacheConnector supports one KV-cache group, got {len(groups)} "
                             "(hybrid models are not supported)")
        self.block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if self.block_size % hash_block_size:
            raise ValueError(f"block size {self.block_size} is not a multiple of the hash block size "
                             f"{hash_block_size}")
        self._ratio = self.block_size // hash_block_size
        self._cfg = cfg
        self._policy = policy
        self._stats = stats
        self.space = KeySpace.from_vllm_config(vllm_config, self.block_size, cfg.cache_prefix)
        self._client = PoolClient(cfg)
        self._requests: dict[str, Request] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._trackers: dict[str, _SaveTracker] = {}
        self._pending_loads: list[LoadJob] = []
        logger.info("MemCacheConnector scheduler: %s, load=%s save=%s load_async=%s save_async=%s",
                    self.space.rank_prefix(0, 0), policy.can_load, policy.can_save,
                    cfg.load_async, cfg.save_async)

    # -- lookups ---------------------------------------------------------------------------

    def _num_hashed_blocks(self, request: Request) -> int:
        return len(request.block_hashes) // self._ratio

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if not self._policy.can_load:
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
            self._lookups[request.request_id] = _Lookup(start, hit)
        tokens = (start + hit) * self.block_size - num_computed_tokens
        if tokens <= 0:
            return 0, False
        return tokens, self._cfg.load_async

    def _lookup(self, request: Request, start: int, end: int) -> int:
        hashes = block_hashes_hex(request.block_hashes, start, end, self._ratio)
        ranks = self.space.ranks
        keys: list[str] = []
        for tp_rank, pp_rank in ranks:
            keys.extend(self.space.keys(hashes, tp_rank, pp_rank))
        codes = self._client.exists(keys)
        n = len(hashes)
        if codes is None:
            self._stats.add(lookups=1, lookup_errors=1)
            return 0
        hit = 0
        while hit < n and all(codes[r * n + hit] == 1 for r in range(len(ranks))):
            hit += 1
        errors = int(any(c < 0 for c in codes))
        self._stats.add(lookups=1, lookup_errors=errors, hit_blocks=hit, hit_tokens=hit * self.block_size)
        logger.debug("MemCacheConnector: request %s blocks [%d, %d): %d in the pool",
                     request.request_id, start, end, hit)
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        if num_external_tokens <= 0:
            return
        lookup = self._lookups.pop(rid, None)
        n = num_external_tokens // self.block_size
        if lookup is None or num_external_tokens % self.block_size or n > lookup.hit_blocks:
            # vLLM would treat blocks as loaded that nobody loads: refuse rather than serve garbage.
            raise RuntimeError(f"MemCacheConnector: request {rid} was allocated {num_external_tokens} "
                               f"external tokens that no lookup promised ({lookup})")
        start, end = lookup.start_block, lookup.start_block + n
        block_ids = blocks.get_block_ids()[0][start:end]
        hashes = block_hashes_hex(request.block_hashes, start, end, self._ratio)
        self._pending_loads.append(LoadJob(rid, list(block_ids), hashes, self._cfg.load_async))
        tracker = self._trackers.setdefault(rid, _SaveTracker())
        tracker.block_ids = list(blocks.get_block_ids()[0])
        tracker.next_block = max(tracker.next_block, end)

    def update_connector_output(self, invalid_block_ids: set[int]) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them again once they are."""
        if not invalid_block_ids:
            return
        for tracker in self._trackers.values():
            for i, block_id in enumerate(tracker.block_ids[:tracker.next_block]):
                if block_id in invalid_block_ids:
                    tracker.next_block = i
                    break

    # -- saves -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MemCacheConnectorMetadata:
        meta = MemCacheConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.preempted_req_ids = set(scheduler_output.preempted_req_ids or ())
        for rid in meta.preempted_req_ids:
            tracker = self._trackers.get(rid)
            if tracker is not None:
                # The workers finish its in-flight saves before this step's forward.
                tracker.has_saves = False
                tracker.block_ids = []
        if not self._policy.can_save:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.setdefault(new.req_id, _SaveTracker())
            tracker.block_ids = list(new.block_ids[0])
            tracker.next_block = max(tracker.next_block, new.num_computed_tokens // self.block_size)
            self._add_save(meta, new.req_id, tracker,
                           new.num_computed_tokens + scheduled.get(new.req_id, 0))
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
            self._add_save(meta, rid, tracker, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _add_save(self, meta: MemCacheConnectorMetadata, rid: str, tracker: _SaveTracker,
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
        start = tracker.next_block
        meta.saves.append(SaveJob(rid, tracker.block_ids[start:limit],
                                  block_hashes_hex(request.block_hashes, start, limit, self._ratio)))
        tracker.next_block = limit
        tracker.has_saves = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        tracker = self._trackers.pop(rid, None)
        delay_free = bool(tracker and tracker.has_saves and self._cfg.save_async)
        return delay_free, None

    def shutdown(self) -> None:
        self._client.close()
