"""What the two sides of the connector tell each other.

* ``MemCacheHandshake`` (worker -> scheduler, once, after the KV caches are registered): the
  worker's key namespace, computed from the KV caches it really holds; the scheduler looks up
  under exactly that namespace.
* ``MemCacheConnectorMetadata`` (scheduler -> workers, every step): loads, saves, preemptions,
  the namespace epoch, acknowledged load failures and keys to remove.
* ``MemCacheWorkerMetadata`` (workers -> scheduler, every step): each rank's load-failure epoch,
  and the keys its saves finished with (saved or not), for the scheduler's KV events.

Blocks travel as block names (``keys.block_names``); each worker prefixes them with its own rank's
namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from memcache_vllm.keys import Namespace


@dataclass
class MemCacheHandshake(KVConnectorHandshakeMetadata):
    namespace: Namespace


@dataclass
class LoadJob:
    """Load block ``names[i]`` into vLLM block ``block_ids[i]`` for one request."""

    req_id: str
    block_ids: list[int]
    names: list[str]
    is_async: bool


@dataclass
class SaveJob:
    """Save vLLM blocks ``block_ids[i]`` (full, computed) under ``names[i]``."""

    req_id: str
    block_ids: list[int]
    names: list[str]
    context_block_ids: list[int]
    """Every block of the request up to the last one saved: the blocks the computation of the saved
    blocks read. A save is fenced while any of them failed to load."""


@dataclass
class MemCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests whose blocks were freed by preemption this step: their in-flight saves must end
    before the forward that may overwrite those blocks."""
    epoch: str = "0"
    """The namespace epoch of this step's keys (changes on ``reset_cache``)."""
    handled_failures: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Per (tp_rank, pp_rank, pcp_rank): the last load-failure epoch the scheduler has handled (vLLM has
    rescheduled the affected requests); the rank lifts the fence on failures up to it."""
    remove: dict[str, list[str]] = field(default_factory=dict)
    """Block names (per request) saved from steps that may have read a failed block: every rank
    waits for that request's in-flight saves, then removes its keys of these blocks (current
    epoch)."""

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted_req_ids or self.remove)


@dataclass
class MemCacheWorkerMetadata(KVConnectorWorkerMetadata):
    failure_epochs: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Per (tp_rank, pp_rank, pcp_rank): the epoch of the last load failure the rank reported."""
    saved_keys: list[str] = field(default_factory=list)
    """Keys whose saves ended with the object in the pool (written, or already there)."""
    unsaved_keys: list[str] = field(default_factory=list)
    """Keys whose saves ended without it (failed, skipped, fenced)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, MemCacheWorkerMetadata):
            for rank, epoch in other.failure_epochs.items():
                self.failure_epochs[rank] = max(epoch, self.failure_epochs.get(rank, 0))
            self.saved_keys.extend(other.saved_keys)
            self.unsaved_keys.extend(other.unsaved_keys)
        return self
