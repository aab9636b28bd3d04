"""A LocalService's data server (``tcp.py`` describes the wire format and the bounds): one thread per
connection, each past the pool's handshake within ``HANDSHAKE_TIMEOUT_S`` of its accept, then serving
reads and writes of ranges of its segment, and disk-tier requests (``disk_wire.py``). On a plain-TCP
connection the reads are answered by the C loop where it was built (``dataloop.py``,
``data_server_loop``), which hands every other request to ``_request`` here with the bytes of it read."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from ..auth import HANDSHAKE_TIMEOUT_S, Session, refuse_busy, server_handshake
from ..errors import ConfigError
from ..fence import StaleGrant
from ..memory import Mapping
from ..rpc.framing import is_out_of_descriptors
from ..rpc.server import MAX_PREAUTH_PER_SOURCE, PREAUTH_SHARE
from ..tls import tls_handshake
from . import dataloop, disk_wire
from .sealed import recv_exact, sealed
from .tcp import (
    ANSWER,
    EPOCH,
    HEAD,
    MAGIC,
    OP_READ,
    OP_WRITE,
    OP_WRITE_FENCED,
    RANGE,
    SCATTER_MAX,
    STALE_GRANT,
    WRONG_SEGMENT,
    tune,
)

logger = logging.getLogger(__name__)

DISK_OPS = (disk_wire.OP_DISK_READ, disk_wire.OP_PROMOTE)
MAX_CONNECTIONS = 2048
MAX_RANGES = 1 << 16
IDLE_TIMEOUT_S = 300.0
ACCEPT_BACKOFF_S = 0.1   # out of file descriptors: accept again after this pause (never give up)


class DataServer:
    """Serves one segment to peers; one thread per connection. A request names the segment it is for;
    once the owner told ``serve_segment`` its ids, one naming any other id, 0 included (no id is a
    wildcard), is refused (``WRONG_SEGMENT``) before a byte moves. Until then (a bare data server: its
    owner has not joined, so no member's table lists its address yet) any is served."""

    def __init__(self, mapping: Mapping, host: str, port: int, secret: bytes | None = None,
                 tls: ssl.SSLContext | None = None, disk: object = None,
                 served: Callable[[str, bool, int], None] | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, loop: str = "auto") -> None:
        """``loop`` (``data_server_loop``): ``native``, the C loop answers plain-TCP reads (``dataloop.py``;
        ConfigError where it was not built), ``python`` this module's loop, ``auto`` the C one where built."""
        self.loop = dataloop.load() if loop != "python" else None
        if loop == "native" and self.loop is None:
            raise ConfigError("data_server_loop: 'native', but the native data-server loop was not built here "
                              "(no C compiler at install time?) or failed its self-test; use 'auto' or 'python'")
        self._ids = dataloop.SegmentIds()   # the ids again, where the C loop reads them
        self.native_reads = 0               # reads the C loop answered
        self.mapping = mapping
        self.idle_timeout_s = idle_timeout_s   # a connection silent this long is closed
        self.segment_ids: frozenset[int] = frozenset()   # the ids the owner's segment had (empty: bare)
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
        self._version_warned_at = -60.0
        threading.Thread(target=self._accept, name="memcache-data-accept", daemon=True).start()

    def serve_segment(self, segment_id: int) -> None:
        """The owner joined the pool with its segment as ``segment_id`` (every id it held names this
        same memory: ids are random, never handed to another process while this one could be listed)."""
        if segment_id not in self.segment_ids:
            self._ids.add(segment_id)
        self.segment_ids = self.segment_ids | {segment_id}

    def _other_version(self, magic: bytes) -> None:
        """A member of another data-plane version (an older or newer memcache) sent a request: say so
        (once a minute); it is closed unanswered, and the peer reads another replica or misses."""
        now = time.monotonic()
        if now - self._version_warned_at >= 60.0:
            self._version_warned_at = now
            logger.warning("data server %s: a peer speaks data-plane protocol %s, this provider %s (another "
                           "memcache version); its requests are refused, so reads between the two read as "
                           "misses: run one version in the whole pool (docs/operations.md, Upgrades)",
                           self.addr, magic.decode("ascii", "replace"), MAGIC.decode())

    def _refuses(self, segment_id: int) -> bool:
        ids = self.segment_ids
        return bool(ids) and segment_id not in ids

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
                if self._stop:
                    conn.close()   # closing: a client reads it as a server stopping or restarting
                else:
                    refuse_busy(conn, self.tls is not None)
                self._refused(why)
                continue
            for v in victims:
                v.cut()
            if victims:
                self._refused(f"closed {len(victims)} connection(s) still in their handshake to make room "
                              f"({MAX_PREAUTH_PER_SOURCE} per address, {MAX_CONNECTIONS // PREAUTH_SHARE} in all)")
            tune(conn)
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
        try:
            conn, session = self._handshake(conn, pending)
            if session is None:
                return
            conn.settimeout(self.idle_timeout_s)
            if self.tls is None and self.loop is not None:
                self._serve_native(conn, session, self.loop)
                return
            # the smallest request (one range) is read with one receive; every request is at least that long,
            # so the bytes read belong to this request whatever it turns out to be
            first = bytearray(HEAD.size + RANGE.size + session.size)
            while (got := conn.recv_into(first)) and self._request(conn, session, first, got):
                pass
        except (OSError, ConnectionError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_native(self, conn: socket.socket, session: Session, loop: dataloop.DataLoop) -> None:
        """The C loop answers the plain reads; each request it hands back (with the bytes of it read so
        far) is served here, then the connection goes back to it. It returns now and then with counts."""
        buf = (ctypes.c_char * loop.buf_size)()
        view = memoryview(buf).cast("B")
        while True:
            with self.mapping.view(0, self.mapping.size):   # the mapping stays while C reads it
                code, st = loop.serve(conn.fileno(), session, self.mapping.addr, self.mapping.size, self._ids,
                                      MAGIC, self.idle_timeout_s, buf)
            if st.reads:
                self.native_reads += st.reads
                if self.served is not None:
                    self.served("host_tcp", True, st.bytes)
            if code == dataloop.HANDBACK:
                if not self._request(conn, session, view, st.got):
                    return
            elif code != dataloop.COUNT:
                return   # closed, idle past the timeout, or a socket error: close it

    def _request(self, conn: socket.socket, session: Session, first: bytearray | memoryview, got: int) -> bool:
        """Serve the request of which ``got`` bytes are in ``first`` (at least one); False: close."""
        if got < HEAD.size:
            recv_exact(conn, memoryview(first)[got:HEAD.size])
            got = HEAD.size
        magic, op, n, sid = HEAD.unpack_from(first)
        if magic != MAGIC or op not in (OP_READ, OP_WRITE, OP_WRITE_FENCED, *DISK_OPS) or not 0 < n <= MAX_RANGES:
            if magic != MAGIC and magic[:3] == MAGIC[:3]:
                self._other_version(bytes(magic))
            return False
        if op in DISK_OPS:
            return disk_wire.serve(conn, session, bytes(first[:HEAD.size]), op, n, self.disk,
                                   WRONG_SEGMENT if self._refuses(sid) else 0, bytes(first[HEAD.size:got]))
        fenced = op == OP_WRITE_FENCED
        end = HEAD.size + n * RANGE.size + (EPOCH.size if fenced else 0)   # where the MAC starts
        req = first
        if got < end + session.size:
            if end + session.size > len(first):
                req = bytearray(end + session.size)
                req[:got] = first[:got]
            recv_exact(conn, memoryview(req)[got:end + session.size])
        view = memoryview(req)
        if not session.check(view[end:end + session.size], view[:end]):
            logger.warning("data server %s: a request failed the connection's MAC (injected or altered); "
                           "closing the connection", self.addr)
            return False
        at = HEAD.size + (EPOCH.size if fenced else 0)
        ranges = [RANGE.unpack_from(req, at + i * RANGE.size) for i in range(n)]
        total = sum(length for _, length in ranges)
        if self._refuses(sid):
            conn.sendall(sealed(session, ANSWER.pack(WRONG_SEGMENT, 0)))
            return False  # the write payload (if any) is not drained: close the connection
        size = self.mapping.size
        if any(off + length > size for off, length in ranges):
            conn.sendall(sealed(session, ANSWER.pack(-1, 0)))
            return False  # the write payload (if any) is not drained: close the connection
        if op == OP_READ:
            _send_read(conn, sealed(session, ANSWER.pack(0, total)),
                       [self.mapping.view(off, length) for off, length in ranges], self.tls is None)
        elif not self._write(conn, session, ranges, total, EPOCH.unpack_from(req, HEAD.size)[0] if fenced else 0):
            return True   # refused (nothing written, the payload read and dropped)
        if self.served is not None:
            self.served("host_tcp", op == OP_READ, total)
        return True

    def _write(self, conn: socket.socket, session: Session, ranges: list[tuple[int, int]], total: int,
               epoch: int) -> bool:
        """Receive a write into the segment, holding its fence open for ``epoch`` (0: not fenced) until
        the last byte landed: the owner's re-join waits for it. A write of another MetaService life is
        read into a scratch buffer and dropped, and answered ``STALE_GRANT``; False then."""
        try:
            with self.mapping.fence.writing(epoch, f"write from a peer into segment {sorted(self.segment_ids)}"):
                for off, length in ranges:
                    recv_exact(conn, self.mapping.view(off, length))
        except StaleGrant as e:
            logger.info("data server %s: %s", self.addr, e)
            scratch = memoryview(bytearray(min(total, 1 << 20)))
            left = total
            while left:
                k = min(left, len(scratch))
                recv_exact(conn, scratch[:k])
                left -= k
            conn.sendall(sealed(session, ANSWER.pack(STALE_GRANT, 0)))
            return False
        conn.sendall(sealed(session, ANSWER.pack(0, total)))
        return True

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


def _send_read(conn: socket.socket, answer: bytes, views: list[memoryview], scatter: bool) -> None:
    """The answer and the ranges' bytes, with one ``sendmsg`` when it takes them all (the usual small read);
    what it did not take, and anything on a TLS socket, with ``sendall``."""
    if scatter and len(views) < SCATTER_MAX:
        sent = conn.sendmsg([answer, *views])
        if sent == len(answer) + sum(len(v) for v in views):
            return
        for part in (memoryview(answer), *views):
            if sent >= len(part):
                sent -= len(part)
                continue
            conn.sendall(part[sent:])
            sent = 0
        return
    conn.sendall(answer)
    for v in views:
        conn.sendall(v)


@dataclasses.dataclass(slots=True, eq=False)
class _Handshaking:
    """A data-server connection still in its handshake (its socket is replaced once TLS wraps it)."""

    sock: socket.socket
    source: str

    def cut(self) -> None:
        """End the handshake now: its thread's next receive fails."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
