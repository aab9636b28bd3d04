"""KV events for routers: what the pool holds, announced on the engine's own KV-event stream.

A KV-aware router matches a request's block hashes (vLLM's ``hash_block_tokens`` chain) against
what each engine announced; it never sees pool keys. So the scheduler side announces the blocks
the connector saved through vLLM's hook (``KVConnectorBase_V1.take_events``, drained by vLLM's
scheduler every step and published by the engine's publisher on the engine's topic), as vLLM's
``OffloadingConnector`` does for its tiers:

* ``BlockStored`` once a block's save is confirmed by every rank that stores a share of it
  (``Namespace.ranks``: all TP/PP ranks, TP rank 0 only for MLA's one shared copy), so one
  announcement per block, never one per rank. It carries vLLM's hash of the block (at the engine's
  block size, ``maybe_convert_block_hash``: an int, its last 8 bytes, unless
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``),
  its parent's hash (None for a prompt's first block), its token ids, the engine's block size,
  ``lora_id``/``lora_name`` and the extra keys vLLM hashed, and ``medium`` ``CPU``
  (``MEDIUM_CPU``): the pool is host memory the engine loads from, the tier vLLM's CPU offloading
  announces with the same constant (``GPU`` would claim the block sits in this engine's KV cache).
* ``BlockRemoved`` (medium ``CPU``) for an announced block once this scheduler learns the pool no
  longer holds it: a lookup found it missing (evicted, or its provider died), the connector removed
  it (saved over a block that failed to load), or ``reset_cache`` left it behind.

A block already announced is not announced again by a later save; one that is saved but never
confirmed (a failed or fenced save on any rank) is not announced at all. The pool's eviction is
seen at the next lookup that covers the block, not at the moment it happens: a router may count
an evicted block a while longer, and the engine then reads it as a miss and recomputes it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm." + __name__)

MEDIUM = MEDIUM_CPU
MAX_PENDING_BLOCKS = 100_000
"""Blocks whose saves are issued but not yet confirmed by every rank; beyond this the oldest are
forgotten (never announced) rather than held without bound."""


@dataclass
class _Pending:
    name: str
    event: BlockStored
    keys: set[str] = field(default_factory=set)
    """The pool keys (one per rank) not yet confirmed saved."""


class PoolEvents:
    """The scheduler's record of what it announced, and the events not yet taken by vLLM."""

    def __init__(self, enabled: bool, block_size: int, ratio: int) -> None:
        self.enabled = enabled
        self.block_size = block_size
        self._ratio = ratio
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        """Block name -> its announcement, waiting for every rank's save."""
        self._by_key: dict[str, str] = {}
        """Pool key -> block name, for the keys in ``_pending``."""
        self._announced: dict[str, Any] = {}
        """Block name -> the hash announced for it (as published)."""
        self._out: list[KVCacheEvent] = []

    def _hash(self, request: Request, index: int) -> Any:
        return maybe_convert_block_hash(request.block_hashes[(index + 1) * self._ratio - 1])

    def saves_issued(self, request: Request, start: int, names: list[str], keys: list[list[str]]) -> None:
        """Blocks ``start, start + 1, ...`` of ``request`` are being saved under ``names``, block
        ``i``'s share of each rank under ``keys[i]``."""
        if not self.enabled:
            return
        lora = getattr(request, "lora_request", None)
        for i, (name, block_keys) in enumerate(zip(names, keys, strict=True), start):
            if name in self._announced or name in self._pending:
                continue
            begin, end = i * self.block_size, (i + 1) * self.block_size
            extra, _ = generate_block_hash_extra_keys(request, begin, end, 0)
            event = BlockStored(
                block_hashes=[self._hash(request, i)],
                parent_block_hash=self._hash(request, i - 1) if i > 0 else None,
                token_ids=list(request.all_token_ids[begin:end]), block_size=self.block_size,
                lora_id=lora.adapter_id if lora else None, medium=MEDIUM,
                lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys([extra]))
            self._pending[name] = _Pending(name, event, set(block_keys))
            self._by_key.update((k, name) for k in block_keys)
        while len(self._pending) > MAX_PENDING_BLOCKS:
            self._forget(next(iter(self._pending)))

    def _forget(self, name: str) -> _Pending | None:
        pending = self._pending.pop(name, None)
        if pending is not None:
            for key in pending.keys:
                self._by_key.pop(key, None)
        return pending

    def saves_done(self, saved: Iterable[str], unsaved: Iterable[str]) -> None:
        """Keys the workers saved (or found already in the pool), and keys they did not save: a
        block is announced once every rank's key is saved, and never when one is not."""
        for key in unsaved:
            name = self._by_key.get(key)
            if name is not None:
                self._forget(name)
        for key in saved:
            name = self._by_key.pop(key, None)
            if name is None:
                continue
            pending = self._pending[name]
            pending.keys.discard(key)
            if not pending.keys:
                del self._pending[name]
                self._announced[name] = pending.event.block_hashes[0]
                self._out.append(pending.event)

    def gone(self, names: Iterable[str]) -> None:
        """Blocks a lookup found missing from the pool: announced ones are announced removed (a
        save in flight of one still announces it when it ends)."""
        hashes = [self._announced.pop(n) for n in names if n in self._announced]
        if hashes:
            self._out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM))

    def removed(self, names: Iterable[str]) -> None:
        """Blocks the connector removes from the pool: never announced, or announced removed."""
        names = list(names)
        for name in names:
            self._forget(name)
        self.gone(names)

    def cleared(self) -> None:
        """Every block announced so far is gone (``reset_cache``); saves in flight are not announced."""
        self.removed(list(self._announced))
        self._pending.clear()
        self._by_key.clear()

    def take(self) -> list[KVCacheEvent]:
        out, self._out = self._out, []
        return out
