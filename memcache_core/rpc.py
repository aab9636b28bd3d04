"""Control-plane client: one ZeroMQ DEALER socket per calling thread, typed msgspec messages.

A MetaService that is down must cost a clear error quickly, never a hang: every call waits at most
``timeout_s``, and once the heartbeat (or any call) has seen the MetaService fail, later calls fail at
once with ``MetaServiceUnavailable`` until a heartbeat gets through again. Calls already waiting are
woken by that too. Only idempotent calls (lookup, exist) are retried, and only within
``retry_ms``; commit and free are never retried blindly.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import zmq

from . import protocol as p
from .errors import MemCacheError, MetaServiceUnavailable, error_from_code

logger = logging.getLogger(__name__)

_POLL_SLICE_MS = 50


class Backoff:
    """Exponential backoff with a cap: 1 ms, 2 ms, 4 ms ... ``cap_s``."""

    def __init__(self, base_s: float = 0.001, cap_s: float = 0.1) -> None:
        self.base_s, self.cap_s, self.attempt = base_s, cap_s, 0

    def next(self) -> float:
        self.attempt += 1
        return min(self.cap_s, self.base_s * (1 << min(self.attempt, 20)))


class RpcClient:
    def __init__(self, url: str, timeout_s: float, retry_ms: int = 0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_ms = retry_ms
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._down = False
        self._closed = False

    @property
    def down(self) -> bool:
        """True after a failed exchange and until one succeeds again."""
        return self._down

    def mark_down(self) -> None:
        if not self._down:
            logger.warning("MetaService at %s is unreachable; calls fail fast until it answers", self.url)
        self._down = True

    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            if self._closed:
                raise MetaServiceUnavailable("client is closed")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)     # don't queue on a pipe that isn't connected
            sock.connect(self.url)
            self._local.sock = sock
            with self._sockets_lock:
                self._sockets.append(sock)
        return sock

    def _drop_socket(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            self._local.sock = None
            with self._sockets_lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close(linger=0)

    def call(self, req: p.Request, *, timeout_s: float | None = None, probe: bool = False,
             idempotent: bool = False) -> p.Reply:
        """Send one request and return its reply; errors come back as MemCacheError subclasses.

        ``probe`` calls (heartbeats, joins) go out even while the MetaService is marked down.
        """
        deadline = time.monotonic() + self.retry_ms / 1000.0
        backoff = Backoff()
        while True:
            try:
                return self._call_once(req, timeout_s if timeout_s is not None else self.timeout_s, probe)
            except MetaServiceUnavailable:
                if not idempotent or time.monotonic() + backoff.cap_s > deadline:
                    raise
                time.sleep(backoff.next())

    def _call_once(self, req: p.Request, timeout_s: float, probe: bool) -> p.Reply:
        if self._down and not probe:
            raise MetaServiceUnavailable(f"MetaService at {self.url} is unreachable")
        sock = self._socket()
        rid = next(self._ids).to_bytes(8, "little")
        started = time.monotonic()
        try:
            sock.send_multipart([rid, p.request_encoder.encode(req)], flags=zmq.NOBLOCK)
        except zmq.Again:
            # IMMEDIATE: no connected peer; wait for a connection within the timeout
            if not self._wait_connect(sock, rid, req, started + timeout_s, probe):
                self._fail(timeout_s)
        while True:
            remaining = started + timeout_s - time.monotonic()
            if remaining <= 0 or (self._down and not probe):
                self._fail(timeout_s)
            if not sock.poll(min(_POLL_SLICE_MS, max(1, int(remaining * 1000)))):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2 or frames[0] != rid:
                continue  # a late answer to an earlier, abandoned request
            reply = p.reply_decoder.decode(frames[1])
            self._down = False
            if isinstance(reply, p.Error):
                raise error_from_code(reply.code, reply.message)
            return reply

    def _wait_connect(self, sock: zmq.Socket, rid: bytes, req: p.Request, deadline: float,
                      probe: bool) -> bool:
        payload = p.request_encoder.encode(req)
        while time.monotonic() < deadline and not (self._down and not probe):
            try:
                sock.send_multipart([rid, payload], flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                time.sleep(0.005)
        return False

    def _fail(self, timeout_s: float) -> None:
        self._drop_socket()  # a DEALER that lost its request may still get a stale answer later
        if not self._down:
            self.mark_down()
        raise MetaServiceUnavailable(f"no answer from MetaService at {self.url} within {timeout_s:g}s")

    def close(self) -> None:
        self._closed = True
        with self._sockets_lock:
            socks, self._sockets = self._sockets, []
        for s in socks:
            try:
                s.close(linger=0)
            except zmq.ZMQError:
                pass


def expect(reply: p.Reply, kind: type) -> p.Reply:
    if not isinstance(reply, kind):
        raise MemCacheError(f"unexpected reply {type(reply).__name__}, wanted {kind.__name__}")
    return reply
