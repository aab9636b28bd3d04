"""Slowloris guard of the admin HTTP server: connections still sending their request line and headers.

Each such connection must finish its headers within ``HEADER_DEADLINE_S`` of its start, however it
trickles them (the socket timeout alone is an idle timer that each byte resets); at most
``MAX_READING_PER_ADDRESS`` of one address may be at it at once, and a new one closes the oldest (an
honest request's headers take a millisecond); when every handler slot is taken, the oldest one still
reading its headers is closed to make room. So trickling connections, even from the operators' or the
probes' own address, cannot keep ``/health`` and ``/livez`` from being answered.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from .tls import tls_handshake

logger = logging.getLogger(__name__)

HEADER_DEADLINE_S = 10.0
MAX_READING_PER_ADDRESS = 64
SWEEP_S = 0.5
MAX_CONNECTIONS = 1024
TLS_HANDSHAKE_TIMEOUT_S = 5.0


class HeaderGuard:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._reading: dict[int, list] = {}   # handler thread -> [deadline, address, socket], oldest first
        self._warned_at = 0.0
        self.closed = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sweep, name="http-guard", daemon=True).start()

    def start(self, sock: socket.socket, address: str) -> None:
        """This thread's connection starts reading its headers; the oldest of its address may go."""
        with self._mu:
            mine = [e for e in self._reading.values() if e[1] == address]
            victim = mine[0] if len(mine) >= MAX_READING_PER_ADDRESS else None
            self._reading[threading.get_ident()] = [time.monotonic() + HEADER_DEADLINE_S, address, sock]
        if victim is not None:
            self._cut(victim, f"{address} has {MAX_READING_PER_ADDRESS} connections still sending their headers")

    def wrapped(self, sock: socket.socket) -> None:
        """This thread's connection is now ``sock`` (TLS wrapped it)."""
        with self._mu:
            entry = self._reading.get(threading.get_ident())
            if entry is not None:
                entry[2] = sock

    def done(self) -> None:
        """This thread's connection has sent its headers (or ended)."""
        with self._mu:
            self._reading.pop(threading.get_ident(), None)

    def make_room(self) -> bool:
        """Every slot is taken: close the oldest connection still sending its headers; False if none is."""
        with self._mu:
            victim = next(iter(self._reading.values()), None)
        if victim is None:
            return False
        self._cut(victim, "every handler slot is taken")
        return True

    def close(self) -> None:
        self._stop.set()

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_S):
            now = time.monotonic()
            with self._mu:
                late = [e for e in self._reading.values() if e[0] < now]
            for e in late:
                self._cut(e, f"headers not complete within {HEADER_DEADLINE_S:g} s")

    def _cut(self, entry: list, why: str) -> None:
        with contextlib.suppress(OSError):
            entry[2].shutdown(socket.SHUT_RDWR)   # its thread's next read ends
        self.closed += 1
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            self._warned_at = now
            logger.warning("admin HTTP: closing connections that do not send their request: %s (%d so far)", why,
                           self.closed)


class GuardedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server with a real listen backlog, at most ``max_connections`` threads (one per
    connection, from the accept on), the slowloris guard above, and the TLS handshake (HTTPS) in the
    connection's thread with a deadline. The admin server of the MetaService and a LocalService's
    metrics port."""

    daemon_threads = True
    request_queue_size = 1024   # the listen backlog (socketserver's default is 5: a burst of idle
                                # connections made honest ones wait for SYN retransmits)

    def __init__(self, addr: tuple[str, int], handler: type, tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        # set before binding: a bind that fails (port in use) calls server_close, which closes the guard
        self._slots = threading.BoundedSemaphore(max_connections)
        self.tls = tls   # HTTPS: the handshake runs in the connection's thread, never in the accept loop
        self.guard = HeaderGuard()   # slowloris: a deadline for the headers, a cap per address
        super().__init__(addr, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            return super().finish_request(request, client_address)
        conn = self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        self.guard.wrapped(conn)
        try:
            # a peer that never finishes its handshake holds this one thread for 5 s at most
            if tls_handshake(conn, time.monotonic() + TLS_HANDSHAKE_TIMEOUT_S):
                super().finish_request(conn, client_address)
        finally:
            conn.close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not (self.guard.make_room() and self._slots.acquire(timeout=1.0)):
            self.shutdown_request(request)   # too many connections at once, all of them busy: refuse this one
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self.guard.start(request, str(client_address[0]))
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.guard.done()
            self._slots.release()

    def server_close(self) -> None:
        self.guard.close()
        super().server_close()
