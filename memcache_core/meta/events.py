"""KV events: "blocks stored" / "blocks removed" on a ZeroMQ PUB socket, for KV-aware routers.

The wire format is vLLM's own KV-event format (its ``kv_events`` module), so a router that consumes
vLLM's events consumes these: each message is three frames, ``topic | sequence (8 bytes, big
endian) | msgpack(KVEventBatch)``; a batch is ``[ts, [event, ...]]`` and an event is a tagged
array, ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
or ``["BlockRemoved", block_hashes, medium]``. The structs below are written from that format.

What goes in: ``block_hashes`` holds the object's key (UTF-8 bytes; the key carries the engine's
namespace and block hash), ``medium`` is the tier (``DRAM``), ``block_size`` is
``kv_events_block_size``, ``token_ids`` is empty (the pool never sees tokens). The topic names the
model and where the block lives: ``<kv_events_model_name>|<host>|<segment id>`` (a subscriber
filters by prefix; ``""`` takes everything).

Publishing never blocks the control plane: the MetaService puts events into a bounded queue
(``kv_events_queue_size``) without waiting; when it is full the event is dropped and counted
(``memcache_kv_events_dropped_total``); one thread batches and sends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import msgspec

from ..errors import ConfigError

logger = logging.getLogger(__name__)

MEDIUM = "DRAM"
MAX_BATCH = 1024


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


class EventPublisher:
    """Bounded queue in, one PUB socket out; ``offer`` is what the control plane calls."""

    def __init__(self, endpoint: str, model_name: str, block_size: int, queue_size: int) -> None:
        import zmq
        self.model_name, self.block_size = model_name, block_size
        self.queue: queue.Queue[tuple[bool, str, str, int] | None] = queue.Queue(queue_size)
        self.dropped = 0
        self.published = 0
        self.dropped_stored = 0        # of ``dropped``: BlockStored events
        self.published_stored = 0      # of ``published``: BlockStored events (the rest are BlockRemoved)
        self.batches = 0               # messages sent
        self.queue_size = queue_size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise ConfigError(f"kv_events_endpoint: cannot bind {endpoint}: {e}") from e
        self._seq = 0
        self._hosts: dict[int, str] = {}   # segment -> host, for objects lost with a segment already gone
        self._enc = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="meta-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (model %r, block size %d)", endpoint, model_name, block_size)

    def offer(self, stored: bool, key: str, host: str, segment_id: int) -> None:
        try:
            self.queue.put_nowait((stored, key, host, segment_id))
        except queue.Full:
            self.dropped += 1
            self.dropped_stored += stored

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            items = [item]
            while len(items) < MAX_BATCH:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._send(items)
                    return
                items.append(nxt)
            self._send(items)

    def _send(self, items: list[tuple[bool, str, str, int]]) -> None:
        by_place: dict[tuple[str, int], list[Any]] = {}
        for stored, key, host, sid in items:
            if host:
                self._hosts[sid] = host
            else:
                host = self._hosts.get(sid, "")
            h: list[bytes | int] = [key.encode()]
            ev = BlockStored(h, None, [], self.block_size, None, MEDIUM) if stored else BlockRemoved(h, MEDIUM)
            by_place.setdefault((host, sid), []).append(ev)
        import zmq
        for (host, sid), events in by_place.items():
            self._seq += 1
            frames = [f"{self.model_name}|{host}|{sid}".encode(), self._seq.to_bytes(8, "big"),
                      self._enc.encode(KVEventBatch(time.time(), events))]
            n_stored = sum(isinstance(e, BlockStored) for e in events)
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                self.published += len(events)
                self.published_stored += n_stored
                self.batches += 1
            except zmq.Again:
                self.dropped += len(events)
                self.dropped_stored += n_stored

    def status(self) -> dict[str, Any]:
        """What ``/kv_events/status`` answers, with memcache_hybrid's field names (every event here is
        stored or removed, of medium DRAM; ``cleared`` is never sent)."""
        return {"enabled": True, "publisher_active": self._thread.is_alive(), "queue_size": self.queue.qsize(),
                "queue_capacity": self.queue_size, "published_events": self.published,
                "published_batches": self.batches,
                "published_by_type": {"stored": self.published_stored,
                                      "removed": self.published - self.published_stored, "cleared": 0},
                "published_by_medium": {"hbm": 0, "dram": self.published, "ssd": 0, "unknown": 0},
                "dropped_events": self.dropped, "dropped_stored_events": self.dropped_stored,
                "last_sequence": self._seq}

    def close(self) -> None:
        try:
            self.queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            return   # still sending: the daemon thread ends with the process
        self._sock.close()
        self._ctx.term()
