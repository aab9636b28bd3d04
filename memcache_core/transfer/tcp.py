"""Cross-host transfers: each LocalService serves its segment over TCP; peers read and write ranges.

Every connection first passes the pool's HMAC handshake (``auth.py``), TLS included, within
``HANDSHAKE_TIMEOUT_S`` of its accept: a peer without the secret cannot read or write a byte, and the
server allocates nothing for it. At most ``MAX_PREAUTH_PER_SOURCE`` connections of one address, and
a quarter of ``MAX_CONNECTIONS`` in all, may be in their handshake at once; a new one closes the
oldest (as on the control plane). Bounded: at most
``MAX_CONNECTIONS`` connections (one thread each), ``MAX_RANGES`` ranges per request (validated
against the segment before anything is read from or written to it), ``IDLE_TIMEOUT_S`` of silence.

Wire format (little endian). Request: ``b"MCD1"``, op (1 read, 2 write), range count, then
``(offset, length)`` per range, then the session's MAC of all that (``auth.Session``: a relay that
forwarded the handshake cannot inject a request); a write is followed by the ranges' bytes back to
back. Answer: ``(status, length)`` and its MAC; a successful read is followed by the bytes. The
payload bytes carry no MAC (it would cost more than the copy: docs/security.md): every object's
checksum, verified by its readers, makes altered bytes a miss. The server sends from and receives
into the segment memory itself, and the client receives straight into the destination buffers:
the kernel's socket copies are the only copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import ssl
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from ..auth import HANDSHAKE_TIMEOUT_S, AuthFailed, Session, client_handshake, server_handshake
from ..errors import MemCacheError, PeerUnavailable, TransferFailed
from ..memory import Mapping, view_at
from ..rpc.framing import is_out_of_descriptors
from ..rpc.server import MAX_PREAUTH_PER_SOURCE, PREAUTH_SHARE
from ..tls import tls_handshake
from . import disk_wire
from .sealed import recv_exact, recv_sealed, sealed

logger = logging.getLogger(__name__)

MAGIC = b"MCD1"
OP_READ, OP_WRITE = 1, 2
DISK_OPS = (disk_wire.OP_DISK_READ, disk_wire.OP_PROMOTE)
_HEAD = struct.Struct("<4sBI")
_RANGE = struct.Struct("<QQ")
_ANSWER = struct.Struct("<iQ")

Op = tuple[int, list[tuple[int, int]]]   # (segment offset, [(local pointer, size), ...])

MAX_CONNECTIONS = 2048
MAX_RANGES = 1 << 16
IDLE_TIMEOUT_S = 300.0
MIN_PEER_RATE = 64 << 20        # bytes/s below which a read with another replica to go to gives up (Deadline)
SUSPECT_S = 10.0                # a peer that missed a deadline is read last for this long
ACCEPT_BACKOFF_S = 0.1   # out of file descriptors: accept again after this pause (never give up)


class Deadline:
    """When a transfer must have ended: ``base_s`` plus its bytes at ``MIN_PEER_RATE``. It bounds
    every wait on the peer (connect, handshake, each send and receive), so a peer that stops moving
    bytes (frozen by SIGSTOP, a GC pause, a stuck NIC) costs at most that long."""

    __slots__ = ("at", "budget_s")

    def __init__(self, base_s: float, nbytes: int) -> None:
        self.budget_s = base_s + nbytes / MIN_PEER_RATE
        self.at = time.monotonic() + self.budget_s

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {self.budget_s:.2f} s")
        return left

    def arm(self, sock: socket.socket) -> None:
        sock.settimeout(self.left())


def _recv_by(sock: socket.socket, view: memoryview, deadline: Deadline | None) -> None:
    """``recv_exact``, each receive bounded by what is left of ``deadline`` (when there is one)."""
    if deadline is None:
        recv_exact(sock, view)
        return
    got, n = 0, len(view)
    while got < n:
        deadline.arm(sock)
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class DataServer:
    """Serves one segment to peers; one thread per connection."""

    def __init__(self, mapping: Mapping, host: str, port: int, secret: bytes | None = None,
                 tls: ssl.SSLContext | None = None, disk: object = None,
                 served: Callable[[str, bool, int], None] | None = None) -> None:
        self.mapping = mapping
        self.served = served      # (path, read?, bytes): the owner's count of what peers moved here
        self.disk = disk          # the owner's disk tier (local/tier.py), for disk_wire requests
        self.secret = secret
        self.tls = tls
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.bind((host, 0))   # another LocalService on this host has the configured port
        self._sock.listen(1024)
        host_, port_ = self._sock.getsockname()[:2]
        self.addr = f"{host_}:{port_}"
        self._stop = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        # connections still in their handshake, oldest first: per source address, and all of them
        self._preauth: dict[str, dict[_Handshaking, None]] = {}
        self._preauth_all: dict[_Handshaking, None] = {}
        self.refused = 0
        self._warned_at = 0.0
        threading.Thread(target=self._accept, name="memcache-data-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._stop or not is_out_of_descriptors(e):
                    return   # closed
                # the connections in the backlog stay there; once descriptors free up they are served
                logger.error("data server %s cannot accept connections (%s); retrying in %g s", self.addr, e,
                             ACCEPT_BACKOFF_S)
                time.sleep(ACCEPT_BACKOFF_S)
                continue
            source = str(peer[0])
            pending = _Handshaking(conn, source)
            victims: list[_Handshaking] = []
            with self._lock:
                why = ("server closing" if self._stop else
                       f"all {MAX_CONNECTIONS} connections in use" if len(self._conns) >= MAX_CONNECTIONS else "")
                if not why:   # room for this one: the oldest still in its handshake goes (an honest one takes ms)
                    mine = self._preauth.setdefault(source, {})
                    if len(mine) >= MAX_PREAUTH_PER_SOURCE:
                        victims.append(self._forget_preauth(next(iter(mine))))
                    if len(self._preauth_all) >= MAX_CONNECTIONS // PREAUTH_SHARE:
                        victims.append(self._forget_preauth(next(iter(self._preauth_all))))
                    self._conns.add(conn)
                    self._preauth.setdefault(source, {})[pending] = None
                    self._preauth_all[pending] = None
            if why:
                conn.close()
                self._refused(why)
                continue
            for v in victims:
                v.cut()
            if victims:
                self._refused(f"closed {len(victims)} connection(s) still in their handshake to make room "
                              f"({MAX_PREAUTH_PER_SOURCE} per address, {MAX_CONNECTIONS // PREAUTH_SHARE} in all)")
            _tune(conn)
            threading.Thread(target=self._serve, args=(conn, pending), name="memcache-data", daemon=True).start()

    def _forget_preauth(self, pending: _Handshaking) -> _Handshaking:
        """Take ``pending`` out of the pre-auth counts (under the lock)."""
        self._preauth_all.pop(pending, None)
        mine = self._preauth.get(pending.source)
        if mine is not None:
            mine.pop(pending, None)
            if not mine:
                del self._preauth[pending.source]
        return pending

    def _refused(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            self._warned_at = now
            logger.warning("data server %s refusing connections: %s (%d refused so far)", self.addr, why,
                           self.refused)

    def _handshake(self, conn: socket.socket, pending: _Handshaking) -> tuple[socket.socket, Session | None]:
        """TLS (if on) and the pool's handshake, both within ``HANDSHAKE_TIMEOUT_S`` of the accept
        however slowly the peer sends; then the peer no longer counts as pre-auth."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            if self.tls is not None:
                tls_conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    self._conns.discard(conn)
                    self._conns.add(tls_conn)
                conn = pending.sock = tls_conn
                if not tls_handshake(tls_conn, deadline):
                    return conn, None
            return conn, server_handshake(conn, self.secret, deadline - time.monotonic())
        finally:
            with self._lock:
                self._forget_preauth(pending)

    def _serve(self, conn: socket.socket, pending: _Handshaking) -> None:
        head = bytearray(_HEAD.size)
        try:
            conn, session = self._handshake(conn, pending)
            if session is None:
                return
            conn.settimeout(IDLE_TIMEOUT_S)
            tag = bytearray(session.size)
            while True:
                recv_exact(conn, memoryview(head))
                magic, op, n = _HEAD.unpack(head)
                if magic != MAGIC or op not in (OP_READ, OP_WRITE, *DISK_OPS) or not 0 < n <= MAX_RANGES:
                    return
                if op in DISK_OPS:
                    if not disk_wire.serve(conn, session, head, op, n, self.disk):
                        return
                    continue
                raw = bytearray(n * _RANGE.size)
                recv_exact(conn, memoryview(raw))
                recv_exact(conn, memoryview(tag))
                if not session.check(tag, head, raw):
                    logger.warning("data server %s: a request failed the connection's MAC (injected or altered); "
                                   "closing the connection", self.addr)
                    return
                ranges = [_RANGE.unpack_from(raw, i * _RANGE.size) for i in range(n)]
                total = sum(length for _, length in ranges)
                if any(off + length > self.mapping.size for off, length in ranges):
                    conn.sendall(sealed(session, _ANSWER.pack(-1, 0)))
                    return  # the write payload (if any) is not drained: close the connection
                if op == OP_READ:
                    conn.sendall(sealed(session, _ANSWER.pack(0, total)))
                    for off, length in ranges:
                        conn.sendall(self.mapping.view(off, length))
                else:
                    for off, length in ranges:
                        recv_exact(conn, self.mapping.view(off, length))
                    conn.sendall(sealed(session, _ANSWER.pack(0, total)))
                if self.served is not None:
                    self.served("host_tcp", op == OP_READ, total)
        except (OSError, ConnectionError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes the accept thread; the port is released
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


@dataclasses.dataclass(slots=True, eq=False)
class _Handshaking:
    """A data-server connection still in its handshake (its socket is replaced once TLS wraps it)."""

    sock: socket.socket
    source: str

    def cut(self) -> None:
        """End the handshake now: its thread's next receive fails."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


@dataclasses.dataclass(slots=True, eq=False)
class Link:
    """An authenticated connection to a data server and its session."""

    sock: socket.socket
    session: Session


class TcpClient:
    """Connection pools to peers' data servers.

    A read given a ``Deadline`` (one with another replica to go to) fails with ``PeerUnavailable``
    when the peer misses it, and the peer is then *suspect* for ``SUSPECT_S`` (``suspect``: readers
    try it last). ``forget`` (the peer left the pool, or was declared dead) also ends the requests
    in flight to it at once, not only its idle connections.
    """

    def __init__(self, timeout_s: float, secret: bytes | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.timeout_s = timeout_s
        self.secret = secret
        self.tls = tls
        self._idle: dict[str, list[Link]] = defaultdict(list)
        self._busy: dict[str, set[Link]] = defaultdict(set)
        self._missed: dict[str, float] = {}     # peer -> when it last missed a deadline
        self._lock = threading.Lock()

    def _acquire(self, addr: str, deadline: Deadline | None) -> Link:
        with self._lock:
            if self._idle[addr]:
                return self._idle[addr].pop()
        host, port = addr.rsplit(":", 1)
        bound = min(self.timeout_s, 5.0)
        try:
            s = socket.create_connection((host, int(port)),
                                         timeout=bound if deadline is None else min(bound, deadline.left()))
        except OSError as e:
            raise PeerUnavailable(f"cannot connect to data server {addr}: {e}") from e
        try:
            if self.tls is not None:
                s = self.tls.wrap_socket(s)
            session = client_handshake(s, self.secret, bound if deadline is None else min(bound, deadline.left()))
        except (OSError, AuthFailed) as e:
            s.close()
            raise PeerUnavailable(f"data server {addr} refused authentication: {e}") from e
        s.settimeout(self.timeout_s)
        _tune(s)
        return Link(s, session)

    def _release(self, addr: str, s: Link) -> None:
        with self._lock:
            self._idle[addr].append(s)

    @contextlib.contextmanager
    def _socket(self, addr: str, what: str, deadline: Deadline | None = None) -> Iterator[Link]:
        """A pooled connection to ``addr`` for one request: back to the pool when the request went
        through, closed on any failure (a socket error is ``PeerUnavailable``, naming ``what``; a
        missed ``deadline`` makes the peer suspect)."""
        try:
            s = self._acquire(addr, deadline)
        except PeerUnavailable:
            if deadline is not None and deadline.at <= time.monotonic():
                self._suspect(addr)
            raise
        with self._lock:
            self._busy[addr].add(s)
        ok = False
        try:
            yield s
            ok = True
        except (OSError, ConnectionError) as e:
            if isinstance(e, TimeoutError) and deadline is not None:
                self._suspect(addr)
                raise PeerUnavailable(f"{what} {addr} made no progress: {e}; trying another replica") from e
            raise PeerUnavailable(f"{what} {addr} failed: {e}") from e
        finally:
            with self._lock:
                self._busy[addr].discard(s)
            if ok:
                self._release(addr, s)
            else:
                s.sock.close()

    def _suspect(self, addr: str) -> None:
        with self._lock:
            first = addr not in self._missed
            self._missed[addr] = time.monotonic()
        if first:
            logger.warning("data server %s missed a read deadline; reading other replicas first for %.0f s",
                           addr, SUSPECT_S)

    def suspect(self, addr: str) -> bool:
        """Whether ``addr`` missed a read deadline in the last ``SUSPECT_S`` (a reader tries it last)."""
        with self._lock:
            t = self._missed.get(addr)
            if t is not None and time.monotonic() - t > SUSPECT_S:
                del self._missed[addr]
                return False
            return t is not None

    def _request(self, addr: str, op: int, ops: list[Op], deadline: Deadline | None = None) -> None:
        with self._socket(addr, "transfer with", deadline) as link:
            s = link.sock
            head = _HEAD.pack(MAGIC, op, len(ops))
            ranges = b"".join(_RANGE.pack(off, sum(size for _, size in pieces)) for off, pieces in ops)
            if deadline is not None:
                deadline.arm(s)
            s.sendall(head + ranges + link.session.seal(head, ranges))
            if op == OP_WRITE:
                for _, pieces in ops:
                    for ptr, size in pieces:
                        s.sendall(view_at(ptr, size))
            if deadline is not None:
                deadline.arm(s)     # the answer is a few bytes: one receive
            status, _total = _ANSWER.unpack(recv_sealed(s, link.session, _ANSWER.size, f"the answer of {addr}"))
            if status != 0:
                raise TransferFailed(f"data server {addr} refused the request (status {status})")
            if op == OP_READ:
                for _, pieces in ops:
                    for ptr, size in pieces:
                        _recv_by(s, view_at(ptr, size), deadline)
            if deadline is not None:
                s.settimeout(self.timeout_s)   # back in the pool: the next request sets its own

    def read(self, addr: str, ops: list[Op], stall_s: float | None = None) -> None:
        """Read ``ops`` from ``addr``. ``stall_s``: fail after ``Deadline(stall_s, bytes)`` rather
        than the client timeout (the caller has another replica to read instead)."""
        deadline = None
        if stall_s is not None:
            deadline = Deadline(stall_s, sum(size for _, pieces in ops for _, size in pieces))
        self._request(addr, OP_READ, ops, deadline)

    def disk_request(self, addr: str, op: int, items: list[disk_wire.Item]) -> list[MemCacheError | None]:
        """Read records from (or promote them at) a provider's disk tier; per-object error or None."""
        with self._socket(addr, "disk request to") as link:
            return disk_wire.request(link.sock, link.session, _HEAD.pack(MAGIC, op, len(items)), op, items)

    def write(self, addr: str, ops: list[Op]) -> None:
        self._request(addr, OP_WRITE, ops)

    def forget(self, addr: str) -> None:
        """The peer left the pool (or was declared dead): close its idle connections, and end the
        requests in flight to it now (they fail with ``PeerUnavailable``; a reader moves on)."""
        with self._lock:
            conns = self._idle.pop(addr, [])
            busy = list(self._busy.pop(addr, ()))
            self._missed.pop(addr, None)
        for c in conns:
            c.sock.close()
        for c in busy:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)   # wakes the thread blocked on it; that thread closes it

    def close(self) -> None:
        with self._lock:
            pools, self._idle = self._idle, defaultdict(list)
        for conns in pools.values():
            for c in conns:
                c.sock.close()
