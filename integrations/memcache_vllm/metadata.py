"""What the scheduler side tells the workers each step (``KVConnectorMetadata``).

Block hashes travel as hex strings; each worker prefixes them with its own rank's namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadJob:
    """Load ``block_hashes[i]`` into vLLM block ``block_ids[i]`` for one request."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[str]
    is_async: bool


@dataclass
class SaveJob:
    """Save vLLM blocks ``block_ids[i]`` (full, computed) under ``block_hashes[i]``."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[str]


@dataclass
class MemCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests whose blocks were freed by preemption this step: their in-flight saves must end
    before the forward that may overwrite those blocks."""

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted_req_ids)
