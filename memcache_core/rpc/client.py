"""The client side of the control plane: a small pool of authenticated connections to the MetaService,
fail-fast while it is down, retries of idempotent calls, HA endpoint moves and leader terms
(the package docstring, ``rpc/__init__.py``, tells the whole story)."""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from .. import protocol as p
from ..auth import MAGIC, AuthFailed, AuthMismatch, client_handshake
from ..endpoints import MetaEndpoints
from ..errors import NOT_LEADER, MemCacheError, MetaServiceUnavailable, NotLeader, error_from_code
from ..etcd import EtcdAuth
from .framing import seal_frame, take_frame

logger = logging.getLogger(__name__)

MAX_CLIENT_CONNECTIONS = 8
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


AUTH_ASKED = ("it asks for the pool's authentication, but auth_enable is false here: set auth_enable: true "
              "and auth_secret_path to the pool secret here too (docs/security.md)")


class _Conn:
    def __init__(self, url: str, addr: tuple[str, int], timeout_s: float, secret: bytes | None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.url = url
        self.sock = socket.create_connection(addr, timeout=timeout_s)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                self.sock = tls.wrap_socket(self.sock)
            self.session = client_handshake(self.sock, secret, min(timeout_s, 5.0))
        except BaseException:
            self.sock.close()
            raise
        self.authenticated = secret is not None
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
                 max_connections: int = MAX_CLIENT_CONNECTIONS, tls: ssl.SSLContext | None = None,
                 spin_s: float = 0.0, etcd_auth: EtcdAuth | None = None) -> None:
        self.tls = tls
        self.spin_s = spin_s   # poll for a reply this long before sleeping in recv (``rpc_spin_us``)
        self.endpoints = MetaEndpoints(url, timeout_s, etcd_auth)
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
        self.connects = 0   # connections opened: one more after a MetaService restart (local/gva.py's grants)

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

    def _slow_not_down(self, probe: bool, timeout_s: float) -> bool:
        """A probe (a heartbeat) that waited less than the client timeout and got no answer says the
        MetaService is slow, not down: it must not make other calls fail at once (a CPU-starved but
        live MetaService would turn into failed puts and misses). Those calls still wait at most their
        own timeout, and one that times out marks it down. With several MetaServices to go to (a URL
        list, or an HA leader in etcd) it does mark it, so the client moves on to the next one."""
        single = self.endpoints.count == 1 and not self.endpoints.target.etcd
        return probe and timeout_s < self.timeout_s and single

    def _move_on(self, url: str) -> None:
        """The MetaService at ``url`` failed: the next call goes to the next endpoint, at once."""
        if (self.endpoints.count > 1 or self.endpoints.target.etcd) and self.endpoints.advance(url):
            self._down_at = 0.0

    def call(self, req: p.Request, *, timeout_s: float | None = None, probe: bool = False,
             idempotent: bool = False, meanwhile: Callable[[], None] | None = None) -> p.Reply:
        """Send one request and return its reply; errors come back as MemCacheError subclasses.

        ``probe`` calls (heartbeats, joins) go out even while the MetaService is marked down.
        ``meanwhile`` runs once, on this thread, right after the request is first sent, before the
        reply is read (its time does not count against the call's timeout); not at all where the
        request could not be sent.
        """
        t = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        once = _Once(meanwhile) if meanwhile is not None else None
        try:
            return self._call_moving(req, t, probe, once)
        except MetaServiceUnavailable as e:
            if not idempotent or not self.retry_ms:
                raise
            err = e
        deadline, backoff = start + self.retry_ms / 1000.0, Backoff()   # retries: only when needed
        while time.monotonic() + backoff.cap_s <= deadline:
            time.sleep(backoff.next())
            try:
                return self._call_moving(req, t, probe, once)
            except MetaServiceUnavailable as e:
                err = e
        raise err

    def _call_moving(self, req: p.Request, timeout_s: float, probe: bool, once: _Once | None) -> p.Reply:
        """One exchange; where it reached no MetaService or a standby (so nothing was executed),
        the next endpoint at once, each at most once."""
        for left in range(self.endpoints.count - 1, -1, -1):
            try:
                try:
                    return self._call_once(req, timeout_s, probe, once)
                except _StaleConnection:
                    # this thread's connection was to a MetaService that has since restarted: the request
                    # never reached a live service, so sending it once more on a new connection is safe
                    return self._call_once(req, timeout_s, probe, once)
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
            conn = _Conn(url, addr, timeout_s, self.secret, self.tls)
            with self._cond:
                self.connects += 1
            return conn
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

    def _call_once(self, req: p.Request, timeout_s: float, probe: bool, once: _Once | None = None) -> p.Reply:
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
            c.send(seal_frame(rid, payload, c.session), deadline)
            if once is not None:
                deadline += once.run()
            spin_until = time.perf_counter() + self.spin_s   # a reply usually comes within tens of us
            while True:
                if not c.authenticated and c.buf[:len(MAGIC)] == MAGIC:   # else: "frame of 826360653 bytes"
                    raise AuthMismatch(AUTH_ASKED)
                frame = take_frame(c.buf, c.session)
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
                    if not c.tls and time.perf_counter() < spin_until:
                        chunk = c.sock.recv(1 << 16, socket.MSG_DONTWAIT)
                    else:
                        chunk = c.sock.recv(1 << 16)
                except (TimeoutError, BlockingIOError):   # a slice passed (TLS: Python's timeout), or
                    continue                              # nothing yet while polling (``spin_s``)
                if not chunk:
                    raise ConnectionResetError("MetaService closed the connection")
                c.buf += chunk
        except AuthMismatch as e:   # a failed exchange like the others, its cause kept (is_auth_mismatch)
            self.mark_down(str(e), c.url)
            raise MetaServiceUnavailable(f"MetaService at {c.url}: {e}") from e
        except MemCacheError:
            raise
        except (OSError, ValueError, msgspec.DecodeError) as e:
            stale = c.used and isinstance(e, (ConnectionResetError, BrokenPipeError)) and not c.buf
            if stale:
                raise _StaleConnection(str(e)) from e
            if not (isinstance(e, TimeoutError) and self._slow_not_down(probe, timeout_s)):
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


class _Once:
    """Work to overlap with a call's round trip: run at most once over the call's attempts."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work: Callable[[], None] | None = work

    def run(self) -> float:
        """Run the work if it has not run yet; the seconds it took. An error of the work is logged, not
        raised: it must not pass for a failure of the exchange."""
        work, self._work = self._work, None
        if work is None:
            return 0.0
        t = time.monotonic()
        try:
            work()
        except Exception:
            logger.exception("work overlapped with a control-plane call failed")
        return time.monotonic() - t


class _StaleConnection(MetaServiceUnavailable):
    """A kept-alive connection turned out to be closed by a MetaService that went away."""


class _Unreached(MetaServiceUnavailable):
    """No connection to the MetaService could be made: the request was never sent."""



R = TypeVar("R")


def expect(reply: p.Reply, kind: type[R]) -> R:
    if not isinstance(reply, kind):
        raise MemCacheError(f"unexpected reply {type(reply).__name__}, wanted {kind.__name__}")
    return reply
