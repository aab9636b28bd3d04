"""``KVEventSubscriber``: a test's subscriber to a MetaService's KV events (ZeroMQ SUB, and the replay
socket), used by the core's and the vLLM suite's KV-event tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .testing import wait_for


class KVEventSubscriber:
    """A ZeroMQ SUB socket on a MetaService's KV events (needs pyzmq). ``decode`` turns one batch's
    payload into ``(event type, keys, medium)`` triples: the core's tests read the raw msgpack, the
    vLLM suite decodes with vLLM's own structs. ``poll()`` collects what arrived; ``replay(endpoint,
    start)`` asks the replay socket for every batch from ``start`` on, as vLLM's subscribers do."""

    def __init__(self, endpoint: str, decode: Callable[[bytes], list[tuple[str, list[str], str | None]]],
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        import zmq
        self.decode, self.curve = decode, curve   # curve: (our public, our secret, server public)
        self.ctx = zmq.Context()
        self.sock = self._socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.events: list[tuple[str, str, str | None]] = []   # (type, key, medium) in arrival order
        self.topics: set[bytes] = set()
        self.seqs: list[int] = []

    def _socket(self, kind: int) -> Any:
        import zmq
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.curve
        return sock

    def _take(self, payload: bytes) -> None:
        for kind, keys, medium in self.decode(payload):
            self.events += [(kind, k, medium) for k in keys] if keys else [(kind, "", medium)]

    def poll(self) -> None:
        while self.sock.poll(50):
            topic, seq, payload = self.sock.recv_multipart()
            self.topics.add(topic)
            self.seqs.append(int.from_bytes(seq, "big"))
            self._take(payload)

    def keys(self, kind: str) -> list[str]:
        return [k for t, k, _ in self.events if t == kind]

    def wait_until_subscribed(self, put: Callable[[str], object], timeout_s: float = 10.0) -> None:
        """PUB drops what is sent before the subscription reaches it: put probes until one is seen."""
        n = [0]

        def seen() -> bool:
            put(f"probe-{n[0]}")
            n[0] += 1
            self.poll()
            return bool(self.keys("BlockStored"))
        wait_for(seen, timeout_s, "the subscriber to see a first BlockStored")

    def replay(self, endpoint: str, start: int, timeout_s: float = 10.0) -> list[int]:
        """The sequences the replay socket sent from ``start`` on (their events are collected too)."""
        import zmq
        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            seqs: list[int] = []
            deadline = time.monotonic() + timeout_s
            while True:
                if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise AssertionError(f"no end of replay from {endpoint} within {timeout_s}s")
                _, seq, payload = sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return seqs
                seqs.append(int.from_bytes(seq, "big"))
                self._take(payload)
        finally:
            sock.close()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
