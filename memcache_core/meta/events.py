"""KV events: "blocks stored" / "blocks removed" / "all cleared" on ZeroMQ, for KV-aware routers.

The wire format is vLLM's own KV-event format (``vllm/distributed/kv_events.py``), checked by a test
that decodes every batch with the installed vLLM's decoder: each message is three frames, ``topic |
sequence (8 bytes, big endian) | msgpack(KVEventBatch)``; a batch is an array ``[ts, [event, ...], data_parallel_rank (null)]``
and each event a map tagged by its class name, ``{"type": "BlockStored", "block_hashes": [...], ...}``.
The structs below carry every field vLLM's decoder requires (``lora_name`` included, as null);
the optional ones it added (``extra_keys``, ``group_idx``, the cache-spec fields) are left out.

What goes in: ``block_hashes`` holds the object's key (UTF-8 bytes; the key carries the engine's
namespace and block hash), ``medium`` is ``"CPU"`` (vLLM's ``MEDIUM_CPU``, host memory: the pool's DRAM),
``block_size`` is ``kv_events_block_size``, ``token_ids`` is empty (the pool never sees tokens). The
topic names the model and where the block lives: ``<kv_events_model_name>|<host>|<segment id>`` (a
subscriber filters by prefix; ``""`` takes everything). A new object table (a MetaService that
starts, an HA leader that takes over) first publishes ``AllBlocksCleared`` on ``<model>||``: what a
subscriber knew is gone, and the objects the members report back follow as ``BlockStored``.

Replay, as vLLM's publisher offers it: with ``kv_events_replay_endpoint`` a ROUTER socket answers a
request ``[b"", start_seq (8 bytes)]`` with every kept batch from that sequence on, each as ``[b"",
seq, payload]``, then ``[b"", -1 (8 bytes, signed), b""]``; the last ``kv_events_buffer_steps``
batches are kept. Replays are served by a thread of their own within rate bounds (``replay.py``): the
sending thread only adds each batch to the kept ones, and never waits for a replay. With
``zmq_enable_curve`` both sockets speak CURVE: encrypted, and only the subscribers whose public keys
are in ``zmq_curve_client_keys_dir`` get in.

Publishing never blocks the control plane: the MetaService puts events into a bounded queue
(``kv_events_queue_size``) without waiting; when it is full the event is dropped and counted
(``memcache_kv_events_dropped_total``); one thread batches and sends (ZeroMQ sockets belong to one
thread).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ConfigError
from .replay import KeptBatches, ReplayLimits, ReplayServer

logger = logging.getLogger(__name__)

MEDIUM = "CPU"   # vLLM's medium for host memory (its offloading connector's CPU tier); the pool is DRAM
MAX_BATCH = 1024


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None   # required by vLLM's decoder: sent even as None (omit_defaults leaves it)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# What the control plane offers: (kind, key, host, segment id); kind is one of these.
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
Item = tuple[str, str, str, int]


@dataclass(frozen=True)
class Curve:
    """The server's CURVE key pair (Z85) and the folder of subscribers' public certificates."""
    public: bytes
    secret: bytes
    client_keys_dir: str


def load_curve(server_key_file: str, client_keys_dir: str) -> Curve:
    """Read ``zmq_curve_server_key_file`` (a secret certificate as ``zmq.auth`` writes it)."""
    import zmq
    import zmq.auth
    if not zmq.has("curve"):
        raise ConfigError("zmq_enable_curve: this libzmq has no CURVE support; install pyzmq's wheel")
    try:
        public, secret = zmq.auth.load_certificate(server_key_file)
    except (OSError, ValueError) as e:
        raise ConfigError(f"zmq_curve_server_key_file: cannot read a CURVE certificate from "
                          f"{server_key_file!r}: {e}; make a pair with python -c \"import zmq.auth; "
                          f"zmq.auth.create_certificates('DIR', 'server')\"") from e
    if secret is None:
        raise ConfigError(f"zmq_curve_server_key_file: {server_key_file!r} holds no secret key "
                          f"(give the .key_secret file, not the public .key)")
    return Curve(public, secret, client_keys_dir)


class EventPublisher:
    """Bounded queue in, one PUB socket (and a ROUTER for replays) out; ``offer`` is what the control
    plane calls."""

    def __init__(self, endpoint: str, model_name: str, block_size: int, queue_size: int,
                 replay_endpoint: str = "", buffer_steps: int = 10_000, curve: Curve | None = None,
                 replay_limits: ReplayLimits | None = None) -> None:
        import zmq
        self.model_name, self.block_size = model_name, block_size
        self.queue: queue.Queue[Item | None] = queue.Queue(queue_size)
        self.dropped = 0
        self.published = 0
        self.dropped_stored = 0        # of ``dropped``: BlockStored events
        self.published_stored = 0      # of ``published``: BlockStored events (the rest are BlockRemoved)
        self.batches = 0               # messages sent
        self.queue_size = queue_size
        self.by_type: collections.Counter[str] = collections.Counter()
        self.last_sequence = -1
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._replay: ReplayServer | None = None
        self._kept = KeptBatches(buffer_steps) if replay_endpoint else None
        try:
            if curve is not None:
                from zmq.auth.thread import ThreadAuthenticator
                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=curve.client_keys_dir)
            self._sock = self._bind(zmq.PUB, endpoint, "kv_events_endpoint", curve, {zmq.SNDHWM: 100_000})
            if self._kept is not None:
                router = self._bind(zmq.ROUTER, replay_endpoint, "kv_events_replay_endpoint", curve,
                                    ReplayServer.socket_options())
                self._replay = ReplayServer(router, self._kept, replay_limits or ReplayLimits())
        except BaseException:
            self._close_sockets()
            raise
        self._seq = 0
        self._hosts: dict[int, str] = {}   # segment -> host, for objects lost with a segment already gone
        self._enc = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="meta-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay %s, CURVE %s, model %r, block size %d)", endpoint,
                    replay_endpoint or "off", "on" if curve else "off", model_name, block_size)

    def _bind(self, kind: int, endpoint: str, key: str, curve: Curve | None, options: dict[int, int]) -> Any:
        import zmq
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in options.items():
            sock.setsockopt(option, value)
        if curve is not None:
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
            sock.curve_server = True
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise ConfigError(f"{key}: cannot bind {endpoint}: {e}; free the port or choose another") from e
        return sock

    def offer(self, stored: bool, key: str, host: str, segment_id: int) -> None:
        self._put((STORED if stored else REMOVED, key, host, segment_id))

    def offer_cleared(self) -> None:
        """Everything a subscriber knew is gone (a new object table)."""
        self._put((CLEARED, "", "", -1))

    def _put(self, item: Item) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            self.dropped_stored += item[0] == STORED

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

    def _send(self, items: list[Item]) -> None:
        by_place: dict[tuple[str, int], list[Any]] = {}
        for kind, key, host, sid in items:
            if kind == CLEARED:
                by_place.setdefault(("", -1), []).append(AllBlocksCleared())
                continue
            if host:
                self._hosts[sid] = host
            else:
                host = self._hosts.get(sid, "")
            h: list[bytes | int] = [key.encode()]
            ev = BlockStored(h, None, [], self.block_size, None, MEDIUM, None) if kind == STORED else BlockRemoved(h, MEDIUM)
            by_place.setdefault((host, sid), []).append(ev)
        import zmq
        for (host, sid), events in by_place.items():
            place = "|" if sid < 0 else f"{host}|{sid}"
            seq = self._seq
            self._seq += 1
            n_stored = sum(isinstance(e, BlockStored) for e in events)
            payload = self._enc.encode(KVEventBatch(time.time(), events))
            if self._kept is not None:
                self._kept.append(seq, payload)   # kept for replay even when the PUB socket drops it
            self.last_sequence = seq
            try:
                self._sock.send_multipart([f"{self.model_name}|{place}".encode(), seq.to_bytes(8, "big"), payload],
                                          flags=zmq.NOBLOCK)
                self.published += len(events)
                self.published_stored += n_stored
                self.batches += 1
                for ev in events:
                    self.by_type[type(ev).__name__] += 1
            except zmq.Again:
                self.dropped += len(events)
                self.dropped_stored += n_stored

    def status(self) -> dict[str, Any]:
        """What ``/kv_events/status`` answers, with memcache_hybrid's field names (every event here is of
        the pool's DRAM, sent with vLLM's medium name ``CPU``)."""
        return {"enabled": True, "publisher_active": self._thread.is_alive(), "queue_size": self.queue.qsize(),
                "queue_capacity": self.queue_size, "published_events": self.published,
                "published_batches": self.batches,
                "published_by_type": {"stored": self.by_type["BlockStored"], "removed": self.by_type["BlockRemoved"],
                                      "cleared": self.by_type["AllBlocksCleared"]},
                "published_by_medium": {"hbm": 0, "dram": self.published - self.by_type["AllBlocksCleared"], "ssd": 0,
                                        "unknown": 0},
                "dropped_events": self.dropped, "dropped_stored_events": self.dropped_stored,
                "last_sequence": self.last_sequence,
                "replay": None if self._replay is None else self._replay.stats()}

    def replay_counts(self) -> tuple[int, int]:
        """(replays sent whole, replay requests and replays dropped): 0, 0 without a replay endpoint."""
        if self._replay is None:
            return 0, 0
        return self._replay.served, sum(self._replay.dropped.values())

    def _close_sockets(self) -> None:
        if self._replay is not None and not self._replay.close():
            return   # its thread still holds the ROUTER socket: the daemon thread ends with the process
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def close(self) -> None:
        try:
            self.queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            return   # still sending: the daemon thread ends with the process
        self._close_sockets()
