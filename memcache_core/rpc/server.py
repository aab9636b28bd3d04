"""The server side of the control plane: one selector loop answering frames, bounded in connections,
handshake time, buffered input and unread replies (``FrameServer``)."""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import time
from collections.abc import Callable

from ..auth import BUSY, DENIED, NO_SESSION, ServerHandshake, refuse_busy, tell
from ..errors import cannot_listen
from .framing import FRAME_HEAD, MAX_FRAME, is_addr_in_use, is_out_of_descriptors, take_frame
from .peer import (
    MAX_BUFFERED_INPUT,
    MAX_PENDING_REPLIES,
    MAX_PENDING_REPLY,
    MAX_PER_SOURCE,
    MAX_PREAUTH_PER_SOURCE,
    PREAUTH_SHARE,
    PREAUTH_TIMEOUT_S,
    Peer,
)
from .pump import Pumped, resolve

__all__ = ["MAX_BUFFERED_INPUT", "MAX_PENDING_REPLIES", "MAX_PENDING_REPLY", "MAX_PER_SOURCE", "MAX_PREAUTH_PER_SOURCE",
           "PREAUTH_TIMEOUT_S", "FrameServer", "is_addr_in_use"]

logger = logging.getLogger(__name__)


class FrameServer:
    """Single-threaded selector loop answering frames with ``handler(payload) -> reply bytes``.

    Bounded: a connection must finish the pool handshake within ``PREAUTH_TIMEOUT_S`` of its accept,
    however it trickles its bytes (nothing it sends before is decoded, and it can make the server hold
    64 bytes); at most ``MAX_PREAUTH_PER_SOURCE`` connections of one address, and a quarter of
    ``max_connections`` in all, may be in their handshake at once (a new one closes the oldest: an
    honest handshake takes milliseconds, so idle or trickling connections cannot hold the slots), so
    the other slots stay for authenticated members; at most ``max_connections`` are open, and at most
    ``max_per_source`` of one address (more are refused: an insider's many connections cannot take
    the slots of members elsewhere); one silent for ``idle_timeout_s`` is closed; a peer that does not
    read its replies is disconnected once ``MAX_PENDING_REPLY`` bytes wait for it, or once the replies
    waiting for all connections together would pass ``MAX_PENDING_REPLIES``; unfinished frames
    of all connections together may hold ``MAX_BUFFERED_INPUT`` bytes (the connection that would go
    over is disconnected: a Join report of a million objects still fits); running out of
    file descriptors pauses accepting instead of spinning.

    ``frame_loop`` (``auto``, ``native``, ``python``): with the native pump (rpc/pump.py), an
    authenticated plain-TCP connection is served by C from its handshake on, under the same bounds.
    """

    def __init__(self, binds: list[tuple[str, int]], handler: Callable[[bytes], bytes],
                 secret: bytes | None = None, max_connections: int = 4096, idle_timeout_s: float = 600.0,
                 tls: ssl.SSLContext | None = None, keys: tuple[str, ...] = (),
                 max_per_source: int = MAX_PER_SOURCE, frame_loop: str = "auto") -> None:
        """``keys`` name the settings of ``binds`` (for the error when one cannot be listened on)."""
        self.handler = handler
        self.max_per_source = max_per_source
        self._open_of: dict[str, int] = {}   # source address -> its connections open
        self.tls = tls
        self.secret = secret
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.sel = selectors.DefaultSelector()
        self.listeners: list[socket.socket] = []
        for i, (host, port) in enumerate(binds):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                for opened in (s, *self.listeners):
                    opened.close()
                raise cannot_listen(keys[i] if i < len(keys) else "port", host, port, e) from e
            s.listen(1024)
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ, None)
            self.listeners.append(s)
        self._peers: dict[socket.socket, Peer] = {}
        self._buffered = 0   # bytes of unfinished frames held for all connections together
        self.max_buffered_input = MAX_BUFFERED_INPUT
        self._pending = 0   # reply bytes waiting for all connections together
        self.max_pending_replies = MAX_PENDING_REPLIES
        self._paused_until = 0.0
        self._next_sweep = time.monotonic() + 1.0
        self.refused = 0
        # connections still in their handshake, oldest first: per source address, and all of them
        self._preauth: dict[str, dict[socket.socket, None]] = {}
        self._preauth_all: dict[socket.socket, None] = {}
        self.max_preauth = max(1, max_connections // PREAUTH_SHARE)
        self.evicted = 0
        self._warned_at = 0.0
        native = resolve(frame_loop) if tls is None else None   # TLS connections stay in Python
        self._pumped = Pumped(native, self.sel.fileno(), handler, MAX_FRAME, MAX_PENDING_REPLY,
                              self._release) if native is not None else None

    def poll(self, timeout_s: float) -> int:
        """Serve what is ready within ``timeout_s``; the number of ready sockets."""
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            for s in self.listeners:
                self.sel.register(s, selectors.EVENT_READ, None)
        if self._pumped is None:
            n = self._select(timeout_s)
        else:
            n, python_ready = self._pumped.poll(timeout_s, self._buffered, self.max_buffered_input, self._pending,
                                                self.max_pending_replies)
            n += self._select(0.0) if python_ready else 0
        if now >= self._next_sweep:
            self._sweep(now)
        return n

    def _select(self, timeout_s: float) -> int:
        ready = self.sel.select(timeout_s)
        for key, events in ready:
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
        return len(ready)

    def _accept(self, lsock: socket.socket) -> None:
        try:
            conn, addr = lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if is_out_of_descriptors(e):
                logger.error("cannot accept connections (%s); pausing accepts for 100 ms", e)
                self._pause_accepting(0.1)
            return
        source = str(addr[0])
        if self.connections >= self.max_connections:
            self._refuse(conn, f"all {self.max_connections} connections are in use")
            return
        if self._open_of.get(source, 0) >= self.max_per_source:
            self._refuse(conn, f"{source} has {self.max_per_source} connections open "
                               f"(max_connections_per_address)")
            return
        preauth = self.secret is not None or self.tls is not None
        if preauth:   # room for this one: the oldest still in its handshake goes (an honest one takes ms)
            mine = self._preauth.get(source, {})
            if len(mine) >= MAX_PREAUTH_PER_SOURCE:
                self._evict(next(iter(mine)), f"{source} has {MAX_PREAUTH_PER_SOURCE} connections in their handshake")
            if len(self._preauth_all) >= self.max_preauth:
                self._evict(next(iter(self._preauth_all)), f"{self.max_preauth} connections are in their handshake "
                                                           f"(the other slots are kept for authenticated members)")
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._pumped is not None and not preauth:   # auth off: no handshake to wait for
            self._open_of[source] = self._open_of.get(source, 0) + 1
            self._pumped.adopt(conn, source, NO_SESSION, b"", b"", self._pending, self.max_pending_replies)
            return
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        hs = ServerHandshake(self.secret) if self.secret is not None else None
        now = time.monotonic()
        self._peers[conn] = peer = Peer(hs, now, source, now, authenticated=not preauth,
                                        tls_pending=self.tls is not None)
        self._open_of[source] = self._open_of.get(source, 0) + 1
        if preauth:
            self._preauth.setdefault(source, {})[conn] = None
            self._preauth_all[conn] = None
        self.sel.register(conn, selectors.EVENT_READ, "conn")
        if peer.tls_pending:
            self._tls_step(conn, peer)
        elif hs is not None:
            self._send(conn, peer, bytearray(hs.hello))

    def _tls_step(self, conn: socket.socket, peer: Peer) -> None:
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
        else:
            self._authenticated(conn, peer)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Close a new connection at once, saying why in the log (at most once a second)."""
        self.refused += 1
        refuse_busy(conn, self.tls is not None)
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            self._warned_at = now
            logger.warning("refusing connections: %s (%d refused so far)", why, self.refused)

    def _evict(self, conn: socket.socket, why: str) -> None:
        """Close a connection still in its handshake to make room for a new one (logged once a second)."""
        self.evicted += 1
        peer = self._peers.get(conn)
        if peer is not None and not peer.tls_pending:
            tell(conn, BUSY)   # an honest client names the slots, not a restart or a wrong secret
        self._close(conn)
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            self._warned_at = now
            logger.warning("closing the oldest connections still in their handshake: %s (%d closed so far)", why,
                           self.evicted)

    def _authenticated(self, conn: socket.socket, peer: Peer) -> None:
        """The peer passed its handshake (or left): it no longer counts against the pre-auth limits."""
        if not peer.authenticated:
            peer.authenticated = True
            self._preauth_all.pop(conn, None)
            mine = self._preauth.get(peer.source)
            if mine is not None:
                mine.pop(conn, None)
                if not mine:
                    del self._preauth[peer.source]

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
                tell(conn, DENIED)   # the client's proof was wrong: it names the secret, and stops waiting
                self._close(conn)
                return
            if not peer.handshake.done:
                return
            peer.session = peer.handshake.session
            peer.handshake = None
            self._authenticated(conn, peer)
            self._send(conn, peer, bytearray(proof))
            if conn not in self._peers:
                return
        if self.buffered_input + len(chunk) > self.max_buffered_input:
            logger.warning("closing a connection: %d bytes of unfinished frames would be buffered server-wide "
                           "(limit %d)", self.buffered_input + len(chunk), self.max_buffered_input)
            self._close(conn)
            return
        if self._pumped is not None:   # authenticated, plain TCP: the native pump serves it from here
            self.sel.unregister(conn)
            del self._peers[conn]
            unsent = bytes(peer.out or b"")
            self._pending -= len(unsent)
            self._pumped.adopt(conn, peer.source, peer.session, chunk, unsent, self._pending, self.max_pending_replies)
            return
        buf = peer.inbuf
        buf += chunk
        self._buffered += len(chunk)
        start = len(buf)
        out = bytearray()
        waiting = len(peer.out) if peer.out is not None else 0
        try:
            while (frame := take_frame(buf, peer.session)) is not None:
                rid, body = frame
                reply = self.handler(body)
                head = FRAME_HEAD.pack(len(reply), rid)
                out += head
                out += reply
                out += peer.session.seal(head, reply)
                if waiting + len(out) > MAX_PENDING_REPLY or self._pending + len(out) > self.max_pending_replies:
                    # one 64 KiB read can hold thousands of small requests for big replies: stop here,
                    # not after building all of them
                    logger.warning("closing a connection that does not read its replies (%d bytes waiting for it, "
                                   "%d for all connections)", waiting + len(out), self._pending + len(out))
                    self._close(conn)
                    return
        except ValueError:
            self._close(conn)
            return
        finally:   # the frames taken (a close took off the rest)
            self._buffered -= start - len(buf)
        if out:
            self._send(conn, peer, out)

    def _send(self, conn: socket.socket, peer: Peer, data: bytearray) -> None:
        if peer.out is not None:
            peer.out += data
            self._pending += len(data)
            if len(peer.out) > MAX_PENDING_REPLY or self.pending_replies > self.max_pending_replies:
                logger.warning("closing a connection that does not read its replies (%d bytes waiting for it, "
                               "%d for all connections)", len(peer.out), self.pending_replies)
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
            self._pending += len(data)
            self.sel.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, "conn")

    def _flush(self, conn: socket.socket, peer: Peer) -> None:
        data, peer.out = peer.out, None
        self.sel.modify(conn, selectors.EVENT_READ, "conn")
        assert data is not None
        self._pending -= len(data)
        self._send(conn, peer, data)

    def _sweep(self, now: float) -> None:
        """Close connections that did not authenticate by their deadline, and idle ones."""
        self._next_sweep = now + 1.0
        for conn, peer in list(self._peers.items()):
            if not peer.authenticated and now - peer.opened > PREAUTH_TIMEOUT_S or now - peer.last > self.idle_timeout_s:
                self._close(conn)
        if self._pumped is not None:
            self._pumped.sweep(self.idle_timeout_s)

    @property
    def connections(self) -> int:
        return len(self._peers) + (self._pumped.connections if self._pumped is not None else 0)

    @property
    def pending_replies(self) -> int:
        return self._pending + (self._pumped.counts()[1] if self._pumped is not None else 0)

    @property
    def buffered_input(self) -> int:
        return self._buffered + (self._pumped.counts()[0] if self._pumped is not None else 0)

    @property
    def native(self) -> bool:
        """Whether authenticated plain-TCP connections are served by the native frame pump."""
        return self._pumped is not None

    def _close(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        peer = self._peers.pop(conn, None)
        if peer is not None:
            self._buffered -= len(peer.inbuf)
            if peer.out is not None:
                self._pending -= len(peer.out)
            self._authenticated(conn, peer)   # no longer in its handshake either way
            self._release(peer.source)
        conn.close()

    def _release(self, source: str) -> None:
        """A connection of ``source`` closed (here, or in the native pump)."""
        n = self._open_of.get(source, 0) - 1
        if n > 0:
            self._open_of[source] = n
        else:
            self._open_of.pop(source, None)

    def close(self) -> None:
        for conn in list(self._peers):
            self._close(conn)
        if self._pumped is not None:
            self._pumped.close()
        for s in self.listeners:
            if not self._paused_until:
                self.sel.unregister(s)
            s.close()
        self.sel.close()
