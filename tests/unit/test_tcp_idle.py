"""Pooled data-plane connections the data server closed for idleness (``transfer/tcp.py``): the server
closes a connection silent for its idle timeout, while the client still holds it in its pool. A read or
write that fails on such a connection before its answer arrived is sent again on a fresh one; a
timeout (a frozen peer) is not."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from memcache_core.auth import server_handshake
from memcache_core.errors import PeerUnavailable
from memcache_core.layout import payload_offset
from memcache_core.local.disk import DiskStore
from memcache_core.local.segment import create_segment
from memcache_core.memory import Mapping
from memcache_core.protocol import ObjectReport
from memcache_core.testing import wait_for
from memcache_core.transfer import tcp
from memcache_core.transfer.disk_wire import OP_DISK_READ
from memcache_core.transfer.sealed import recv_exact, sealed
from memcache_core.transfer.tcp import ANSWER, HEAD, OP_READ, RANGE, Link, TcpClient
from memcache_core.transfer.tcp_server import DataServer

SECRET = b"idle-connections-test-secret-000"
SID = 7


@pytest.fixture
def segment() -> Iterator[Mapping]:
    seg = create_segment(1 << 20)
    seg.view(0, 4096)[:] = bytes(range(256)) * 16
    yield seg
    seg.close()


def _ops(buf: np.ndarray) -> list[tcp.Op]:
    return [(0, [(buf.ctypes.data, buf.nbytes)])]


def _read(client: TcpClient, addr: str, **kw: float) -> bytes:
    out = np.zeros(4096, np.uint8)
    client.read(addr, _ops(out), segment_id=SID, **kw)
    return out.tobytes()


def _closed_by_peer(link: Link) -> bool:
    """Whether the peer closed ``link`` (EOF waits in its receive queue)."""
    try:
        return link.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def _pooled_closed(client: TcpClient, addr: str) -> Link:
    """The client's one pooled connection to ``addr``, once the server has closed its end."""
    (link,) = client._idle[(addr, SID)]
    wait_for(lambda: _closed_by_peer(link), 10, "the data server to close the idle connection")
    return link


def test_a_pooled_connection_the_server_closed_for_idleness_is_replaced(segment, data_server_loop):
    """Scenario: a reader's pooled connection sat idle past the data server's idle timeout, and the
    server closed it. Before, the next read on it failed: a last copy read as a miss, a put's write
    failed. Now the read (and a write) is sent again on a fresh connection, byte-exact; the control
    shows the same request on the closed connection alone fails."""
    server = DataServer(segment, "127.0.0.1", 0, SECRET, idle_timeout_s=0.2, loop=data_server_loop)
    client = TcpClient(timeout_s=10.0, secret=SECRET)
    want = bytes(segment.view(0, 4096))
    try:
        assert _read(client, server.addr) == want
        stale = _pooled_closed(client, server.addr)
        assert _read(client, server.addr) == want          # a hit, not a miss
        assert stale.sock.fileno() == -1, "the closed connection went back to the pool"

        _pooled_closed(client, server.addr)                 # a write after the idle close lands
        src = np.frombuffer(b"\xab" * 4096, np.uint8).copy()
        client.write(server.addr, [(8192, [(src.ctypes.data, src.nbytes)])], segment_id=SID)
        assert bytes(segment.view(8192, 4096)) == src.tobytes()

        # control: without the retry, the request on the server-closed connection fails
        _pooled_closed(client, server.addr)
        out = np.zeros(4096, np.uint8)
        with pytest.raises(PeerUnavailable, match="pooled connection"):
            client._attempt((server.addr, SID), OP_READ, _ops(out), None, fresh=False)
        assert not out.any()

        # and when the fresh connection is refused too, the read fails (PeerUnavailable: a miss)
        assert _read(client, server.addr) == want
        _pooled_closed(client, server.addr)
        server.close()
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            _read(client, server.addr)
    finally:
        client.close()
        server.close()


def test_a_pooled_connection_idle_past_the_bound_is_not_reused(segment, monkeypatch, data_server_loop):
    """A pooled connection idle longer than ``POOL_IDLE_S`` (below the server's idle timeout) is
    closed by the client and the request goes on a new one."""
    server = DataServer(segment, "127.0.0.1", 0, SECRET, loop=data_server_loop)
    client = TcpClient(timeout_s=10.0, secret=SECRET)
    want = bytes(segment.view(0, 4096))
    try:
        assert _read(client, server.addr) == want
        (first,) = client._idle[(server.addr, SID)]
        assert _read(client, server.addr) == want
        assert client._idle[(server.addr, SID)] == [first]   # young enough: reused
        monkeypatch.setattr(tcp, "POOL_IDLE_S", 0.0)
        assert _read(client, server.addr) == want
        assert first.sock.fileno() == -1
        assert client._idle[(server.addr, SID)] != [first]
    finally:
        client.close()
        server.close()


def test_a_disk_request_on_a_pooled_connection_the_server_closed_is_sent_again(segment, tmp_path, data_server_loop):
    """Scenario: a reader's pooled connection to a provider sat idle past the data server's idle
    timeout, and the next read of an object held on the provider's disk tier alone goes out on it.
    Before, the disk read failed (PeerUnavailable: a miss of a stored object); now it is sent again on a
    fresh connection and the record's bytes arrive. The control sends it on the closed one alone."""
    payload = bytes(segment.view(0, 4096))
    segment.view(payload_offset(0), 4096)[:] = payload
    report = ObjectReport("on-disk", 0, 4096, 1, xxhash.xxh3_64_intdigest(payload))
    store = DiskStore(str(tmp_path), 64 << 20)
    server = DataServer(segment, "127.0.0.1", 0, SECRET, disk=store, idle_timeout_s=0.2,
                        loop=data_server_loop)
    server.serve_segment(SID)
    client = TcpClient(timeout_s=10.0, secret=SECRET)

    def disk_read(**kw: bool) -> tuple[list, bytes]:
        out = np.zeros(4096, np.uint8)
        item = [("on-disk", 4096, report.checksum, [(out.ctypes.data, out.nbytes)])]
        if kw:
            head = HEAD.pack(tcp.MAGIC, OP_DISK_READ, 1, SID)
            with client._socket((server.addr, SID), "disk request to", fresh=False) as link:
                return tcp.disk_wire.request(link.sock, link.session, head, OP_DISK_READ, item), out.tobytes()
        return client.disk_request(server.addr, OP_DISK_READ, item, SID), out.tobytes()

    try:
        assert store.offer([report], segment) == 1
        wait_for(lambda: store.holds("on-disk"), 10, "the disk record")
        assert disk_read() == ([None], payload)
        stale = _pooled_closed(client, server.addr)
        assert disk_read() == ([None], payload)            # a hit, not a miss
        assert stale.sock.fileno() == -1, "the closed connection went back to the pool"

        _pooled_closed(client, server.addr)                 # control: the closed connection alone fails
        with pytest.raises(PeerUnavailable, match="pooled connection"):
            disk_read(control=True)
    finally:
        client.close()
        server.close()
        store.close()


class _FreezingPeer:
    """A data server that answers the first read of each connection (zeros), then goes silent, as a
    frozen process's kernel does; it counts the connections it accepted."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        host, port = self.listener.getsockname()[:2]
        self.addr = f"{host}:{port}"
        self.accepted = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            session = server_handshake(conn, SECRET, 10.0)
            assert session is not None
            head = bytearray(HEAD.size)
            recv_exact(conn, memoryview(head))
            n = HEAD.unpack(head)[2]
            raw = bytearray(n * RANGE.size + session.size)
            recv_exact(conn, memoryview(raw))
            total = sum(RANGE.unpack_from(raw, i * RANGE.size)[1] for i in range(n))
            conn.sendall(sealed(session, ANSWER.pack(0, total)) + bytes(total))
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def test_a_timeout_on_a_pooled_connection_is_not_retried():
    """A pooled connection to a peer that stopped answering: the read fails (a missed deadline, or the
    client timeout) without a second connection; a frozen peer is left to its own path."""
    peer = _FreezingPeer()
    client = TcpClient(timeout_s=0.5, secret=SECRET)
    try:
        assert _read(client, peer.addr) == bytes(4096)
        with pytest.raises(PeerUnavailable, match="made no progress"):
            _read(client, peer.addr, stall_s=0.2)
        assert peer.accepted == 1
        assert _read(client, peer.addr) == bytes(4096)      # a new connection: answered once
        assert peer.accepted == 2
        with pytest.raises(PeerUnavailable, match="timed out"):
            _read(client, peer.addr)
        assert peer.accepted == 2
    finally:
        client.close()
        peer.close()
