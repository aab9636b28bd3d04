"""Cross-host transfers: each LocalService serves its segment over TCP (``DataServer``, in
``tcp_server.py``); peers read and write ranges (``TcpClient``, here).

Every connection first passes the pool's HMAC handshake (``auth.py``), TLS included, within
``HANDSHAKE_TIMEOUT_S`` of its accept: a peer without the secret cannot read or write a byte, and the
server allocates nothing for it. At most ``MAX_PREAUTH_PER_SOURCE`` connections of one address, and
a quarter of ``MAX_CONNECTIONS`` in all, may be in their handshake at once; a new one closes the
oldest (as on the control plane). Bounded: at most
``MAX_CONNECTIONS`` connections (one thread each), ``MAX_RANGES`` ranges per request (validated
against the segment before anything is read from or written to it), ``IDLE_TIMEOUT_S`` of silence.

Wire format (little endian). Request: ``b"MCD2"``, op (1 read, 2 write, 5 fenced write; 3 and 4 are
``disk_wire.py``'s), range count, the segment id the request is for (no wildcard: a joined provider's
server refuses any id it was not given, 0 included; only a bare server, whose owner has not joined,
serves any), for a fenced write the fence token its space was granted under (u64), then
``(offset, length)`` per range, then the session's MAC of all that (``auth.Session``: a relay that
forwarded the handshake cannot inject a request); a write is followed by the ranges' bytes back to
back. Answer: ``(status, length)`` and its MAC; a successful read is followed by the bytes. A server
that serves another segment (a provider restarted on the address of a dead one a reader still
lists) answers ``WRONG_SEGMENT`` and moves nothing: the reader gets ``PeerUnavailable``. A fenced
write lands only while the owner's fence holds that token (``fence.py``); otherwise the answer is
``STALE_GRANT`` and nothing is written (the writer gets ``StaleGrant``). The
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
from typing import TypeVar

from ..auth import AuthFailed, Session, client_handshake
from ..errors import LOCAL_NOT_CONNECTED, STATE_MISMATCH, MemCacheError, PeerUnavailable, TransferFailed
from ..fence import StaleGrant
from ..memory import view_at
from . import disk_wire
from .sealed import recv_exact, recv_sealed

T = TypeVar("T")

logger = logging.getLogger(__name__)

MAGIC = b"MCD2"
OP_READ, OP_WRITE, OP_WRITE_FENCED = 1, 2, 5   # (3 and 4: disk_wire.py)
HEAD = struct.Struct("<4sBIQ")     # magic, op, count, segment id
EPOCH = struct.Struct("<Q")        # a fenced write's: the fence token its space was granted under
WRONG_SEGMENT = LOCAL_NOT_CONNECTED   # the answer's status: this server serves another segment
STALE_GRANT = STATE_MISMATCH          # the answer's status: the write's epoch is not the owner's
RANGE = struct.Struct("<QQ")
ANSWER = struct.Struct("<iQ")
SCATTER_MAX = 64   # pieces moved with one sendmsg / recvmsg_into (below the kernel's IOV_MAX of 1,024)

Op = tuple[int, list[tuple[int, int]]]   # (segment offset, [(local pointer, size), ...])

MIN_PEER_RATE = 64 << 20        # bytes/s below which a read with another replica to go to gives up (Deadline)
SUSPECT_S = 10.0                # a peer that missed a deadline is read last for this long
POOL_IDLE_S = 240.0             # an idle pooled connection older than this is closed, not reused: below
                                # the data server's IDLE_TIMEOUT_S (300 s), after which it closes its end


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


def _answer(sock: socket.socket, session: Session, dest: list[memoryview], deadline: Deadline | None,
            addr: str) -> tuple[int, int]:
    """The answer's status, and how many bytes of the read's payload came with it into ``dest``: one
    ``recvmsg_into`` takes the answer and what of the payload is there (a small read: all of it) where
    the socket has it (not TLS). A payload reaches ``dest`` only behind an answer of status 0."""
    if not dest or len(dest) >= SCATTER_MAX or isinstance(sock, ssl.SSLSocket):
        return ANSWER.unpack(recv_sealed(sock, session, ANSWER.size, f"the answer of {addr}"))[0], 0
    got = bytearray(ANSWER.size + session.size)
    n = sock.recvmsg_into([got, *dest])[0]
    if n == 0:
        raise ConnectionError("peer closed the connection")
    if n < len(got):
        _recv_by(sock, memoryview(got)[n:], deadline)
        n = len(got)
    if not session.check(memoryview(got)[ANSWER.size:], memoryview(got)[:ANSWER.size]):
        raise TransferFailed(f"the answer of {addr} failed the connection's MAC (a relay's or altered bytes)")
    status = ANSWER.unpack_from(got)[0]
    if status != 0 and n > len(got):
        raise TransferFailed(f"data server {addr} sent bytes behind a refusal (status {status})")
    return status, n - len(got)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclasses.dataclass(slots=True, eq=False)
class Link:
    """An authenticated connection to a data server and its session."""

    sock: socket.socket
    session: Session
    pooled: bool = False        # taken from the idle pool (its peer may have closed it meanwhile)
    answered: bool = False      # the current request's answer arrived
    idle_since: float = 0.0     # when it went back to the pool


class _StaleLink(PeerUnavailable):
    """A request failed on a connection taken from the idle pool before any answer arrived, other than
    by a timeout: the peer most likely closed it while it was idle (``IDLE_TIMEOUT_S``). A read or a
    write of whole ranges is idempotent: it is sent again, once, on a fresh connection."""


Peer = tuple[str, int]   # (data server address, segment id): one incarnation of a peer


class TcpClient:
    """Connection pools to peers' data servers, one per peer incarnation: keyed by the address and the
    segment the requests are for (``segment_id``; 0 for a bare data server). A provider killed and
    started again often listens on the same address (its configured ``hcom_url``) under a new segment
    id, sometimes while the old one is still a member: a connection made to the old process is dead,
    and must never carry a request meant for the new one (that request would fail, a hit read as a
    miss), nor may forgetting the old one end the new one's requests.

    A read given a ``Deadline`` (one with another replica to go to) fails with ``PeerUnavailable``
    when the peer misses it, and the peer is then *suspect* for ``SUSPECT_S`` (``suspect``: readers
    try it last). ``forget`` (the peer left the pool, or was declared dead) also ends the requests
    in flight to it at once, not only its idle connections.

    The data server closes a connection silent for ``IDLE_TIMEOUT_S``: a pooled one idle for
    ``POOL_IDLE_S`` is closed rather than reused, and a read, write or disk request that fails on a pooled connection
    before its answer arrived (the send fails, or the answer's receive meets EOF or a reset; never a
    timeout: a frozen peer has its own path) is sent again once, on a fresh connection.
    """

    def __init__(self, timeout_s: float, secret: bytes | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.timeout_s = timeout_s
        self.secret = secret
        self.tls = tls
        self._idle: dict[Peer, list[Link]] = defaultdict(list)
        self._busy: dict[Peer, set[Link]] = defaultdict(set)
        self._missed: dict[Peer, float] = {}     # peer -> when it last missed a deadline
        self._lock = threading.Lock()

    def _acquire(self, peer: Peer, deadline: Deadline | None, fresh: bool = False) -> Link:
        old: list[Link] = []
        with self._lock:
            idle = self._idle[peer]
            while idle and not fresh:
                link = idle.pop()
                if time.monotonic() - link.idle_since < POOL_IDLE_S:
                    link.pooled, link.answered = True, False
                    return link
                old.append(link)   # its peer is about to close it (or did): a fresh one instead
        for link in old:
            link.sock.close()
        addr = peer[0]
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
        tune(s)
        return Link(s, session)

    def _release(self, peer: Peer, s: Link) -> None:
        s.idle_since = time.monotonic()
        with self._lock:
            self._idle[peer].append(s)

    @contextlib.contextmanager
    def _socket(self, peer: Peer, what: str, deadline: Deadline | None = None,
                fresh: bool = False) -> Iterator[Link]:
        """A pooled connection to ``peer`` for one request (a new one when ``fresh``): back to the pool
        when the request went through, closed on any failure (a socket error is ``PeerUnavailable``,
        naming ``what``, ``_StaleLink`` when it came from the pool and no answer had arrived; a missed
        ``deadline`` makes the peer suspect)."""
        addr = peer[0]
        try:
            s = self._acquire(peer, deadline, fresh)
        except PeerUnavailable:
            if deadline is not None and deadline.at <= time.monotonic():
                self._suspect(peer)
            raise
        with self._lock:
            self._busy[peer].add(s)
        ok = False
        try:
            yield s
            ok = True
        except (OSError, ConnectionError) as e:
            if isinstance(e, TimeoutError) and deadline is not None:
                self._suspect(peer)
                raise PeerUnavailable(f"{what} {addr} made no progress: {e}; trying another replica") from e
            if s.pooled and not s.answered and not isinstance(e, TimeoutError):
                raise _StaleLink(f"{what} {addr} failed on a pooled connection: {e}") from e
            raise PeerUnavailable(f"{what} {addr} failed: {e}") from e
        finally:
            with self._lock:
                self._busy[peer].discard(s)
            if ok:
                self._release(peer, s)
            else:
                s.sock.close()

    def _suspect(self, peer: Peer) -> None:
        with self._lock:
            first = peer not in self._missed
            self._missed[peer] = time.monotonic()
        if first:
            logger.warning("data server %s (segment %d) missed a read deadline; reading other replicas first "
                           "for %.0f s", peer[0], peer[1], SUSPECT_S)

    def suspect(self, addr: str, segment_id: int = 0) -> bool:
        """Whether the peer missed a read deadline in the last ``SUSPECT_S`` (a reader tries it last)."""
        peer = (addr, segment_id)
        with self._lock:
            t = self._missed.get(peer)
            if t is not None and time.monotonic() - t > SUSPECT_S:
                del self._missed[peer]
                return False
            return t is not None

    @staticmethod
    def _once_more_if_stale(attempt: Callable[[bool], T]) -> T:
        """``attempt(fresh)``; once more on a fresh connection when a pooled one turned out closed."""
        try:
            return attempt(False)
        except _StaleLink as e:
            logger.debug("%s; sending it again on a fresh connection", e)
            return attempt(True)

    def _request(self, peer: Peer, op: int, ops: list[Op], deadline: Deadline | None = None, epoch: int = 0) -> None:
        self._once_more_if_stale(lambda fresh: self._attempt(peer, op, ops, deadline, fresh, epoch))

    def _attempt(self, peer: Peer, op: int, ops: list[Op], deadline: Deadline | None, fresh: bool,
                 epoch: int = 0) -> None:
        addr = peer[0]
        with self._socket(peer, "transfer with", deadline, fresh) as link:
            s = link.sock
            head = HEAD.pack(MAGIC, OP_WRITE_FENCED if op == OP_WRITE and epoch else op, len(ops), peer[1])
            ranges = (EPOCH.pack(epoch) if op == OP_WRITE and epoch else b"") + b"".join(
                RANGE.pack(off, sum(size for _, size in pieces)) for off, pieces in ops)
            if deadline is not None:
                deadline.arm(s)
            s.sendall(head + ranges + link.session.seal(head, ranges))
            if op == OP_WRITE:
                # (sent whole even when the server refuses: it reads the answer's status after)
                for _, pieces in ops:
                    for ptr, size in pieces:
                        s.sendall(view_at(ptr, size))
            dest = [view_at(ptr, size) for _, pieces in ops for ptr, size in pieces] if op == OP_READ else []
            if deadline is not None:
                deadline.arm(s)     # the answer is a few bytes: one receive
            status, landed = _answer(s, link.session, dest, deadline, addr)
            link.answered = True
            if status == WRONG_SEGMENT:
                raise PeerUnavailable(f"data server {addr} does not serve segment {peer[1]} (it left; another "
                                      f"process listens there now): nothing moved")
            if status == STALE_GRANT:
                raise StaleGrant(f"data server {addr} refused a write granted under fence token {epoch}: its "
                                 f"owner re-joined since (the space may hold another object now); nothing written")
            if status != 0:
                raise TransferFailed(f"data server {addr} refused the request (status {status})")
            for v in dest:   # (a read's) what did not come with the answer
                if landed >= len(v):
                    landed -= len(v)
                    continue
                _recv_by(s, v[landed:], deadline)
                landed = 0
            if deadline is not None:
                s.settimeout(self.timeout_s)   # back in the pool: the next request sets its own

    def read(self, addr: str, ops: list[Op], stall_s: float | None = None, segment_id: int = 0) -> None:
        """Read ``ops`` of segment ``segment_id`` from its data server ``addr``. ``stall_s``: fail after
        ``Deadline(stall_s, bytes)`` rather than the client timeout (the caller has another replica to
        read instead)."""
        deadline = None
        if stall_s is not None:
            deadline = Deadline(stall_s, sum(size for _, pieces in ops for _, size in pieces))
        self._request((addr, segment_id), OP_READ, ops, deadline)

    def disk_request(self, addr: str, op: int, items: list[disk_wire.Item],
                     segment_id: int = 0) -> list[MemCacheError | None]:
        """Read records from (or promote them at) a provider's disk tier; per-object error or None. Sent
        again once on a fresh connection when a pooled one turned out closed (as reads are): the closed
        one carried nothing to the provider."""
        head = HEAD.pack(MAGIC, op, len(items), segment_id)

        def attempt(fresh: bool) -> list[MemCacheError | None]:
            with self._socket((addr, segment_id), "disk request to", fresh=fresh) as link:
                return disk_wire.request(link.sock, link.session, head, op, items,
                                         on_answer=lambda: setattr(link, "answered", True))

        return self._once_more_if_stale(attempt)

    def write(self, addr: str, ops: list[Op], segment_id: int = 0, epoch: int = 0) -> None:
        """Write ``ops`` into segment ``segment_id``; ``epoch``: the fence token the space was granted
        under (the server refuses the write if its owner's fence holds another; 0: not fenced)."""
        self._request((addr, segment_id), OP_WRITE, ops, epoch=epoch)

    def forget(self, addr: str, segment_id: int = 0) -> None:
        """The peer left the pool (or was declared dead): close its idle connections, and end the
        requests in flight to it now (they fail with ``PeerUnavailable``; a reader moves on). Those of
        another segment served at the same address (the peer's next incarnation) are left alone."""
        peer = (addr, segment_id)
        with self._lock:
            conns = self._idle.pop(peer, [])
            busy = list(self._busy.pop(peer, ()))
            self._missed.pop(peer, None)
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
