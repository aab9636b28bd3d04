"""Control plane over plain TCP: length-prefixed msgspec frames over authenticated connections.

Frame: ``u32 length | u64 request id | msgpack payload``. The MetaService answers every request on
the connection it came from, in order, with the same id. Each connection first passes the pool's
HMAC handshake (``auth.py``); a client keeps a small pool of connections (at most
``MAX_CLIENT_CONNECTIONS``), not one per thread forever. (ZeroMQ was measured first: its I/O thread
hop cost ~110 µs per round trip on a loaded 2-core host against ~20 µs for a plain socket, and an
existence probe has to stay well under 60 µs.)

A MetaService that is down costs a clear error quickly, never a hang: every call waits at most
``timeout_s``; once a call or the heartbeat has seen the MetaService fail, later calls fail at once
with ``MetaServiceUnavailable`` (one call in ``RETRY_DOWN_S`` tries the MetaService again) until an
exchange gets through again, and calls already waiting are woken by that too. Only idempotent calls (lookup, exist) are retried, within ``retry_ms``.

HA: the URL may name several MetaServices or the leader key in etcd (``endpoints.py``). A call that
reached no MetaService, or one that answered "not the leader", moves on to the next at once (the
request was not executed). Every reply carries the leader's term; the client keeps the highest seen
and refuses a reply of an older term, so a paused old leader that wakes up is never believed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from . import protocol as p
from .auth import AuthFailed, ServerHandshake, client_handshake
from .endpoints import MetaEndpoints
from .errors import NOT_LEADER, MemCacheError, MetaServiceUnavailable, NotLeader, error_from_code

logger = logging.getLogger(__name__)

FRAME_HEAD = struct.Struct("<IQ")   # body length, request id: before every control-plane frame
MAX_FRAME = 256 << 20             # a Join of a segment with ~1M objects; only after authentication
MAX_CLIENT_CONNECTIONS = 8
MAX_PENDING_REPLY = 64 << 20     # reply bytes a server buffers for a connection that does not read
MAX_BUFFERED_INPUT = 512 << 20   # bytes of unfinished frames a server holds for all connections together
PREAUTH_TIMEOUT_S = 5.0
RETRY_DOWN_S = 0.2                # a MetaService seen down: calls fail at once, but one tries every 0.2 s
_SLICE_S = 0.05
SMALL_FRAME = 1 << 16             # sent without changing the socket's timeout


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, 0.001)   # a zero timeval would mean no timeout at all
    return struct.pack("@ll", int(seconds), int(seconds % 1 * 1e6))


class Backoff:
    """Exponential backoff with a cap: 2 ms, 4 ms, 8 ms ... ``cap_s``."""

    def __init__(self, base_s: float = 0.001, cap_s: float = 0.1) -> None:
        self.base_s, self.cap_s, self.attempt = base_s, cap_s, 0

    def next(self) -> float:
        self.attempt += 1
        return min(self.cap_s, self.base_s * (1 << min(self.attempt, 20)))


class _Conn:
    def __init__(self, url: str, addr: tuple[str, int], timeout_s: float, secret: bytes | None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.url = url
        self.sock = socket.create_connection(addr, timeout=timeout_s)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                self.sock = tls.wrap_socket(self.sock)
            client_handshake(self.sock, secret, min(timeout_s, 5.0))
        except BaseException:
            self.sock.close()
            raise
        self.tls = tls is not None
        if self.tls:
            self.sock.settimeout(_SLICE_S)
        else:
            # blocking, with kernel timeouts: one syscall per send and per receive (a Python timeout
            # polls before each); a receive slice ends with EAGAIN (BlockingIOError)
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(_SLICE_S))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))
        self.buf = bytearray()
        self.next_id = 1
        self.used = False

    def send(self, frame: bytes, deadline: float) -> None:
        """The whole frame, within ``deadline``: a small frame on a plain socket in one syscall (the
        kernel bounds it by the call's timeout), others with a Python timeout over the whole send."""
        if not self.tls and len(frame) <= SMALL_FRAME:
            self.sock.sendall(frame)
            return
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self.sock.sendall(frame)
        finally:
            self.sock.settimeout(_SLICE_S if self.tls else None)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class RpcClient:
    def __init__(self, url: str, timeout_s: float, retry_ms: int = 0, secret: bytes | None = None,
                 max_connections: int = MAX_CLIENT_CONNECTIONS, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.endpoints = MetaEndpoints(url, timeout_s)
        self.max_term = 0   # highest HA leader term seen in a reply
        self.timeout_s = timeout_s
        self.retry_ms = retry_ms
        self.secret = secret
        self._max = max_connections
        self._idle: list[_Conn] = []
        self._open = 0
        self._cond = threading.Condition()
        self._waiting = 0   # threads waiting in _conn for a free connection
        self._down = False
        self._down_at = 0.0
        self._closed = False

    @property
    def url(self) -> str:
        """The MetaService this client talks to now (empty: no HA leader known)."""
        return self.endpoints.url

    @property
    def down(self) -> bool:
        """True after a failed exchange and until one succeeds again."""
        return self._down

    def mark_down(self, why: str, url: str | None = None) -> None:
        if not self._down:
            logger.warning("MetaService at %s is unreachable (%s); calls fail fast until it answers",
                           self.url, why)
        self._down = True
        self._down_at = time.monotonic()
        self._move_on(self.url if url is None else url)

    def _move_on(self, url: str) -> None:
        """The MetaService at ``url`` failed: the next call goes to the next endpoint, at once."""
        if (self.endpoints.count > 1 or self.endpoints.target.etcd) and self.endpoints.advance(url):
            self._down_at = 0.0

    def call(self, req: p.Request, *, timeout_s: float | None = None, probe: bool = False,
             idempotent: bool = False) -> p.Reply:
        """Send one request and return its reply; errors come back as MemCacheError subclasses.

        ``probe`` calls (heartbeats, joins) go out even while the MetaService is marked down.
        """
        t = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        try:
            return self._call_moving(req, t, probe)
        except MetaServiceUnavailable as e:
            if not idempotent or not self.retry_ms:
                raise
            err = e
        deadline, backoff = start + self.retry_ms / 1000.0, Backoff()   # retries: only when needed
        while time.monotonic() + backoff.cap_s <= deadline:
            time.sleep(backoff.next())
            try:
                return self._call_moving(req, t, probe)
            except MetaServiceUnavailable as e:
                err = e
        raise err

    def _call_moving(self, req: p.Request, timeout_s: float, probe: bool) -> p.Reply:
        """One exchange; where it reached no MetaService or a standby (so nothing was executed),
        the next endpoint at once, each at most once."""
        for left in range(self.endpoints.count - 1, -1, -1):
            try:
                try:
                    return self._call_once(req, timeout_s, probe)
                except _StaleConnection:
                    # this thread's connection was to a MetaService that has since restarted: the request
                    # never reached a live service, so sending it once more on a new connection is safe
                    return self._call_once(req, timeout_s, probe)
            except (NotLeader, _Unreached, _StaleConnection):
                if left == 0:
                    raise
                probe = True
        raise AssertionError("unreachable")

    def _conn(self, timeout_s: float) -> _Conn:
        """An idle connection, a new one while fewer than the cap are open, else wait for one."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._idle and self._open >= self._max:
                left = deadline - time.monotonic()
                self._waiting += 1
                try:
                    woken = left > 0 and not self._closed and self._cond.wait(left)
                finally:
                    self._waiting -= 1
                if not woken:
                    raise MetaServiceUnavailable(f"no connection to the MetaService at {self.url} free in "
                                                 f"{timeout_s:g}s")
            if self._closed:
                raise MetaServiceUnavailable("client is closed")
            while self._idle:
                c = self._idle.pop()
                if c.url == self.endpoints.url:
                    return c
                self._open -= 1   # to a MetaService this client has moved away from
                c.close()
            self._open += 1
        url, addr = self.endpoints.url, self.endpoints.addr
        try:
            if addr is None:
                raise OSError("no HA leader is known (etcd holds no leader key, or is unreachable)")
            return _Conn(url, addr, timeout_s, self.secret, self.tls)
        except (OSError, AuthFailed) as e:
            self._discard(None)
            self.mark_down(str(e), url)
            raise _Unreached(f"cannot connect to MetaService at {url or '(none)'}: {e}") from e

    def _give_back(self, c: _Conn) -> None:
        with self._cond:
            if self._closed or c.url != self.endpoints.url:
                c.close()
                self._open -= 1
            else:
                self._idle.append(c)
            if self._waiting:   # Condition.notify costs a microsecond even with no one waiting
                self._cond.notify()

    def _discard(self, c: _Conn | None) -> None:
        with self._cond:
            self._open -= 1
            self._cond.notify()
        if c is not None:
            c.close()

    def _call_once(self, req: p.Request, timeout_s: float, probe: bool) -> p.Reply:
        if self._down and not probe:
            if time.monotonic() - self._down_at < RETRY_DOWN_S:
                raise MetaServiceUnavailable(f"MetaService at {self.url} is unreachable")
            probe = True   # try again now and then, without waiting for a heartbeat to get through
            self._down_at = time.monotonic()
        deadline = time.monotonic() + timeout_s
        c = self._conn(timeout_s)
        rid = c.next_id
        c.next_id += 1
        payload = p.request_encoder.encode(req)
        ok = False
        try:
            c.send(FRAME_HEAD.pack(len(payload), rid) + payload, deadline)
            while True:
                frame = take_frame(c.buf)
                if frame is not None:
                    got_id, body = frame
                    if got_id != rid:
                        continue  # cannot happen on an in-order connection; be safe anyway
                    reply = p.reply_decoder.decode(body)
                    ok = True
                    self._check_term(reply, c.url)
                    self._down = False
                    if isinstance(reply, p.Error):
                        raise error_from_code(reply.code, reply.message)
                    return reply
                if (self._down and not probe) or time.monotonic() > deadline:
                    raise TimeoutError(f"no answer within {timeout_s:g}s")
                try:
                    chunk = c.sock.recv(1 << 16)
                except (TimeoutError, BlockingIOError):   # a slice passed (TLS: Python's timeout)
                    continue
                if not chunk:
                    raise ConnectionResetError("MetaService closed the connection")
                c.buf += chunk
        except MemCacheError:
            raise
        except (OSError, ValueError, msgspec.DecodeError) as e:
            stale = c.used and isinstance(e, (ConnectionResetError, BrokenPipeError)) and not c.buf
            if stale:
                raise _StaleConnection(str(e)) from e
            self.mark_down(str(e), c.url)
            raise MetaServiceUnavailable(f"MetaService at {c.url}: {e}") from e
        finally:
            c.used = True
            if ok and not c.buf:
                self._give_back(c)
            else:
                self._discard(c)

    def _check_term(self, reply: p.Reply, url: str) -> None:
        """Refuse a reply of an older leader term, and move on from a MetaService that is no leader."""
        if reply.term < self.max_term:
            self._move_on(url)
            raise NotLeader(f"MetaService at {url} answered with term {reply.term}, older than term "
                            f"{self.max_term} already seen: a deposed leader; ignored")
        self.max_term = reply.term
        if isinstance(reply, p.Error) and reply.code == NOT_LEADER:
            self._move_on(url)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for c in idle:
            c.close()


class _StaleConnection(MetaServiceUnavailable):
    """A kept-alive connection turned out to be closed by a MetaService that went away."""


class _Unreached(MetaServiceUnavailable):
    """No connection to the MetaService could be made: the request was never sent."""


def take_frame(buf: bytearray) -> tuple[int, bytes] | None:
    """Cut one whole frame (request id, body) off the front of ``buf``; None until one is complete.
    A header announcing more than ``MAX_FRAME`` bytes raises ValueError (the peer is dropped)."""
    if len(buf) < FRAME_HEAD.size:
        return None
    n, rid = FRAME_HEAD.unpack_from(buf)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    end = FRAME_HEAD.size + n
    if len(buf) < end:
        return None
    body = bytes(buf[FRAME_HEAD.size:end])
    del buf[:end]
    return rid, body


R = TypeVar("R")


def expect(reply: p.Reply, kind: type[R]) -> R:
    if not isinstance(reply, kind):
        raise MemCacheError(f"unexpected reply {type(reply).__name__}, wanted {kind.__name__}")
    return reply


@dataclasses.dataclass(slots=True, eq=False)
class _Peer:
    """A server-side connection: its handshake (until done), input, unsent output, last activity."""

    handshake: ServerHandshake | None
    last: float
    tls_pending: bool = False
    inbuf: bytearray = dataclasses.field(default_factory=bytearray)
    out: bytearray | None = None


class FrameServer:
    """Single-threaded selector loop answering frames with ``handler(payload) -> reply bytes``.

    Bounded: a connection must finish the pool handshake within ``PREAUTH_TIMEOUT_S`` (nothing it
    sends before is decoded, and it can make the server hold 64 bytes); at most ``max_connections``
    are open (more are refused); one silent for ``idle_timeout_s`` is closed; a peer that does not
    read its replies is disconnected once ``MAX_PENDING_REPLY`` bytes wait for it; unfinished frames
    of all connections together may hold ``MAX_BUFFERED_INPUT`` bytes (the connection that would go
    over is disconnected: a Join report of a million objects still fits); running out of
    file descriptors pauses accepting instead of spinning.
    """

    def __init__(self, binds: list[tuple[str, int]], handler: Callable[[bytes], bytes],
                 secret: bytes | None = None, max_connections: int = 4096, idle_timeout_s: float = 600.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.secret = secret
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.sel = selectors.DefaultSelector()
        self.listeners: list[socket.socket] = []
        for host, port in binds:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(1024)
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ, None)
            self.listeners.append(s)
        self._peers: dict[socket.socket, _Peer] = {}
        self._buffered = 0   # bytes of unfinished frames held for all connections together
        self.max_buffered_input = MAX_BUFFERED_INPUT
        self._paused_until = 0.0
        self._next_sweep = time.monotonic() + 1.0
        self.refused = 0

    def poll(self, timeout_s: float) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            for s in self.listeners:
                self.sel.register(s, selectors.EVENT_READ, None)
        for key, events in self.sel.select(timeout_s):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if key.data is None:
                self._accept(sock)
                continue
            peer = self._peers.get(sock)
            if peer is not None and peer.tls_pending:
                self._tls_step(sock, peer)
                continue
            if events & selectors.EVENT_READ:
                self._read(sock)
            peer = self._peers.get(sock)
            if events & selectors.EVENT_WRITE and peer is not None and peer.out is not None:
                self._flush(sock, peer)
        if now >= self._next_sweep:
            self._sweep(now)

    def _accept(self, lsock: socket.socket) -> None:
        try:
            conn, _ = lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                logger.error("cannot accept connections (%s); pausing accepts for 100 ms", e)
                self._pause_accepting(0.1)
            return
        if len(self._peers) >= self.max_connections:
            self.refused += 1
            conn.close()
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        hs = ServerHandshake(self.secret) if self.secret is not None else None
        self._peers[conn] = peer = _Peer(hs, time.monotonic(), tls_pending=self.tls is not None)
        self.sel.register(conn, selectors.EVENT_READ, "conn")
        if peer.tls_pending:
            self._tls_step(conn, peer)
        elif hs is not None:
            self._send(conn, peer, bytearray(hs.hello))

    def _tls_step(self, conn: socket.socket, peer: _Peer) -> None:
        """Advance a TLS handshake without blocking; once done, start the pool's own handshake."""
        assert isinstance(conn, ssl.SSLSocket)
        try:
            conn.do_handshake()
        except ssl.SSLWantReadError:
            self.sel.modify(conn, selectors.EVENT_READ, "conn")
            return
        except ssl.SSLWantWriteError:
            self.sel.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, "conn")
            return
        except (ssl.SSLError, OSError):
            self._close(conn)
            return
        peer.tls_pending = False
        self.sel.modify(conn, selectors.EVENT_READ, "conn")
        if peer.handshake is not None:
            self._send(conn, peer, bytearray(peer.handshake.hello))

    def _pause_accepting(self, seconds: float) -> None:
        if not self._paused_until:
            for s in self.listeners:
                self.sel.unregister(s)
        self._paused_until = time.monotonic() + seconds

    def _read(self, conn: socket.socket) -> None:
        peer = self._peers.get(conn)
        if peer is None:
            return
        try:
            chunk = conn.recv(1 << 16)
            while isinstance(conn, ssl.SSLSocket) and conn.pending():
                chunk += conn.recv(conn.pending())   # decrypted bytes the selector does not report
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        peer.last = time.monotonic()
        if peer.handshake is not None:
            proof, chunk = peer.handshake.feed(chunk)
            if peer.handshake.failed:
                self._close(conn)
                return
            if not peer.handshake.done:
                return
            peer.handshake = None
            self._send(conn, peer, bytearray(proof))
            if conn not in self._peers:
                return
        if self._buffered + len(chunk) > self.max_buffered_input:
            logger.warning("closing a connection: %d bytes of unfinished frames would be buffered server-wide "
                           "(limit %d)", self._buffered + len(chunk), self.max_buffered_input)
            self._close(conn)
            return
        buf = peer.inbuf
        before = len(buf)
        buf += chunk
        out = bytearray()
        waiting = len(peer.out) if peer.out is not None else 0
        try:
            while (frame := take_frame(buf)) is not None:
                rid, body = frame
                reply = self.handler(body)
                out += FRAME_HEAD.pack(len(reply), rid)
                out += reply
                if waiting + len(out) > MAX_PENDING_REPLY:
                    # one 64 KiB read can hold thousands of small requests for big replies: stop here,
                    # not after building all of them
                    logger.warning("closing a connection that does not read its replies (%d bytes waiting)",
                                   waiting + len(out))
                    self._close(conn)
                    return
        except ValueError:
            self._close(conn)
            return
        finally:
            if conn in self._peers:
                self._buffered += len(buf) - before
        if out:
            self._send(conn, peer, out)

    def _send(self, conn: socket.socket, peer: _Peer, data: bytearray) -> None:
        if peer.out is not None:
            peer.out += data
            if len(peer.out) > MAX_PENDING_REPLY:
                logger.warning("closing a connection that does not read its replies (%d bytes waiting)",
                               len(peer.out))
                self._close(conn)
            return
        try:
            n = conn.send(data)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            n = 0
        except OSError:
            self._close(conn)
            return
        if n < len(data):
            del data[:n]          # keep the rest in place: no second copy of a large reply
            peer.out = data
            self.sel.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, "conn")

    def _flush(self, conn: socket.socket, peer: _Peer) -> None:
        data, peer.out = peer.out, None
        self.sel.modify(conn, selectors.EVENT_READ, "conn")
        assert data is not None
        self._send(conn, peer, data)

    def _sweep(self, now: float) -> None:
        """Close connections that never authenticated in time, and idle ones."""
        self._next_sweep = now + 1.0
        for conn, peer in list(self._peers.items()):
            limit = PREAUTH_TIMEOUT_S if peer.handshake is not None else self.idle_timeout_s
            if now - peer.last > limit:
                self._close(conn)

    @property
    def connections(self) -> int:
        return len(self._peers)

    @property
    def buffered_input(self) -> int:
        return self._buffered

    def _close(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        peer = self._peers.pop(conn, None)
        if peer is not None:
            self._buffered -= len(peer.inbuf)
        conn.close()

    def close(self) -> None:
        for conn in list(self._peers):
            self._close(conn)
        for s in self.listeners:
            if not self._paused_until:
                self.sel.unregister(s)
            s.close()
        self.sel.close()


def is_addr_in_use(e: OSError) -> bool:
    return e.errno == errno.EADDRINUSE
