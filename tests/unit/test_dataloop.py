"""The data server's C request loop (``transfer/dataloop.c``) answers as its Python loop does: each test
runs on both (``data_server_loop``) over real sockets, a raw client speaking the wire format of
``transfer/tcp.py``, and expects the same answers, codes, payload bytes and closes. Every answer's MAC
is checked with the client's session, so the sequence counters of the two loops stay in step."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from memcache_core.auth import Session, client_handshake
from memcache_core.local.segment import create_segment
from memcache_core.memory import Mapping
from memcache_core.transfer import disk_wire
from memcache_core.transfer.sealed import recv_exact, recv_sealed, sealed
from memcache_core.transfer.tcp import ANSWER, HEAD, MAGIC, OP_READ, OP_WRITE, RANGE, WRONG_SEGMENT
from memcache_core.transfer.tcp_server import MAX_RANGES, DataServer
from tests.loops import DATA_SERVER_LOOPS

SECRET = b"native-data-loop-test-secret-000"
SID = 21
SIZE = 1 << 20

pytestmark = pytest.mark.parametrize("loop", DATA_SERVER_LOOPS)


@pytest.fixture
def segment() -> Iterator[Mapping]:
    seg = create_segment(SIZE)
    seg.view(0, SIZE)[:] = np.random.default_rng(7).integers(0, 256, SIZE, np.uint8).tobytes()
    yield seg
    seg.close()


def start(segment: Mapping, loop: str, secret: bytes | None = SECRET, **kw: object) -> DataServer:
    server = DataServer(segment, "127.0.0.1", 0, secret=secret, loop=loop, **kw)  # type: ignore[arg-type]
    server.serve_segment(SID)
    return server


class Peer:
    """A raw client connection: requests built by hand, answers read and their MACs checked."""

    def __init__(self, server: DataServer, secret: bytes | None = SECRET) -> None:
        host, port = server.addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.session: Session = client_handshake(self.sock, secret)

    def request(self, op: int, ranges: list[tuple[int, int]], sid: int = SID, n: int | None = None) -> bytes:
        frame = HEAD.pack(MAGIC, op, len(ranges) if n is None else n, sid) + b"".join(RANGE.pack(*r) for r in ranges)
        return sealed(self.session, frame)

    def answer(self) -> tuple[int, int]:
        return ANSWER.unpack(recv_sealed(self.sock, self.session, ANSWER.size, "answer"))

    def read(self, ranges: list[tuple[int, int]], sid: int = SID) -> tuple[int, bytes]:
        self.sock.sendall(self.request(OP_READ, ranges, sid))
        status, length = self.answer()
        payload = bytearray(length if status == 0 else 0)
        recv_exact(self.sock, memoryview(payload))
        return status, bytes(payload)

    def closed(self, within_s: float = 5.0) -> bool:
        """Whether the server closes the connection (within ``within_s``) without sending a byte more."""
        self.sock.settimeout(within_s)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def expected(segment: Mapping, ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(bytes(segment.view(off, length)) for off, length in ranges)


def test_reads_of_one_and_many_ranges(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        for count in (1, 2, 50, 64, 65, 300):   # past 64 ranges the C loop hands the read to Python
            ranges = [(i * 3001 % (SIZE - 500), 1 + i % 400) for i in range(count)]
            assert peer.read(ranges) == (0, expected(segment, ranges))
        assert peer.read([(SIZE - 10, 10), (0, 0)]) == (0, expected(segment, [(SIZE - 10, 10)]))
        assert (server.native_reads > 0) == (loop == "native")
    finally:
        peer.close()
        server.close()


def test_auth_off_reads(segment, loop):
    server = start(segment, loop, secret=None)
    peer = Peer(server, secret=None)
    try:
        for _ in range(3):
            assert peer.read([(5, 4096)]) == (0, expected(segment, [(5, 4096)]))
    finally:
        peer.close()
        server.close()


def test_a_read_past_the_segment_end_is_refused_and_closed(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        assert peer.read([(0, 10)])[0] == 0
        assert peer.read([(0, 10), (SIZE - 5, 6)]) == (-1, b"")
        assert peer.closed()
    finally:
        peer.close()
        server.close()


def test_a_wrong_segment_id_is_refused_and_a_new_one_served(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        assert peer.read([(0, 10)])[0] == 0
        server.serve_segment(99)           # the owner joined again, while the connection waits in its loop
        assert peer.read([(0, 10)], sid=99) == (0, expected(segment, [(0, 10)]))
        assert peer.read([(0, 10)], sid=98) == (WRONG_SEGMENT, b"")
        assert peer.closed()
    finally:
        peer.close()
        server.close()


def test_a_request_failing_its_mac_closes_the_connection_unanswered(segment, loop, caplog):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        assert peer.read([(0, 10)])[0] == 0
        frame = bytearray(peer.request(OP_READ, [(0, 10)]))
        frame[-1] ^= 1
        peer.sock.sendall(frame)
        assert peer.closed()
        assert "failed the connection's MAC" in caplog.text
    finally:
        peer.close()
        server.close()


def test_a_request_sent_byte_by_byte(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for ranges in ([(100, 64)], [(7, 9), (1000, 3000), (SIZE - 1, 1)]):
            for b in peer.request(OP_READ, ranges):
                peer.sock.sendall(bytes([b]))
                time.sleep(0.0005)
            status, length = peer.answer()
            got = bytearray(length)
            recv_exact(peer.sock, memoryview(got))
            assert (status, bytes(got)) == (0, expected(segment, ranges))
    finally:
        peer.close()
        server.close()


def test_writes_between_reads_keep_the_counters_in_step(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        for i in range(5):
            payload = bytes([i + 1]) * 3000
            assert peer.read([(4000, 3000)])[0] == 0
            peer.sock.sendall(peer.request(OP_WRITE, [(4000, 1000), (5000, 2000)]) + payload)
            assert peer.answer() == (0, 3000)
            assert peer.read([(4000, 3000)]) == (0, payload)
    finally:
        peer.close()
        server.close()


def test_a_disk_op_between_reads(segment, loop):
    server = start(segment, loop)   # no disk tier: each object is answered -3007
    peer = Peer(server)
    try:
        assert peer.read([(0, 10)])[0] == 0
        head = HEAD.pack(MAGIC, disk_wire.OP_DISK_READ, 2, SID)
        out = np.zeros(8, np.uint8)
        items = [(k, 8, 0, [(out.ctypes.data, 8)]) for k in ("a", "bb")]
        errors = disk_wire.request(peer.sock, peer.session, head, disk_wire.OP_DISK_READ, items)
        assert [getattr(e, "code", None) for e in errors] == [-3007, -3007]
        assert peer.read([(20, 30)]) == (0, expected(segment, [(20, 30)]))
    finally:
        peer.close()
        server.close()


def test_idle_connections_are_closed(segment, loop):
    server = start(segment, loop, idle_timeout_s=0.3)
    peers = [Peer(server) for _ in range(3)]
    try:
        assert peers[0].read([(0, 10)])[0] == 0     # idle after a read
        peers[1].sock.sendall(peers[1].request(OP_READ, [(0, 10)])[:20])   # idle inside a request
        t = time.monotonic()
        assert all(p.closed() for p in peers)
        assert time.monotonic() - t < 3
    finally:
        for p in peers:
            p.close()
        server.close()


def test_close_ends_a_connection_waiting_in_the_loop(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        assert peer.read([(0, 10)])[0] == 0
        time.sleep(0.1)
        t = time.monotonic()
        server.close()
        assert peer.closed(2.0)
        deadline = time.monotonic() + 2.0
        while any(th.name == "memcache-data" for th in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(th.name == "memcache-data" for th in threading.enumerate())
        assert time.monotonic() - t < 2.0
    finally:
        peer.close()


def test_range_counts_past_the_bound_close_unanswered(segment, loop):
    server = start(segment, loop)
    peers = [Peer(server) for _ in range(2)]
    try:
        assert peers[0].read([(i, 1) for i in range(MAX_RANGES)])[0] == 0   # the bound itself is served
        peers[1].sock.sendall(peers[1].request(OP_READ, [(0, 1)], n=MAX_RANGES + 1))
        assert peers[1].closed()
        peers[0].sock.sendall(peers[0].request(OP_READ, [(0, 1)], n=0))
        assert peers[0].closed()
    finally:
        for p in peers:
            p.close()
        server.close()


def test_a_peer_announcing_the_most_ranges_then_stopping_is_timed_out(segment, loop):
    server = start(segment, loop, idle_timeout_s=0.3)
    peer = Peer(server)
    try:
        peer.sock.sendall(HEAD.pack(MAGIC, OP_READ, MAX_RANGES, SID) + RANGE.pack(0, 1))
        t = time.monotonic()
        assert peer.closed()
        assert time.monotonic() - t < 3
    finally:
        peer.close()
        server.close()


def test_another_magic_closes_unanswered(segment, loop):
    server = start(segment, loop)
    peer = Peer(server)
    try:
        peer.sock.sendall(b"XXXX" + peer.request(OP_READ, [(0, 1)])[4:])
        assert peer.closed()
    finally:
        peer.close()
        server.close()


def test_the_served_counts_reach_the_owner(segment, loop):
    counts: list[tuple[str, bool, int]] = []
    server = start(segment, loop, served=lambda *a: counts.append(a))
    peer = Peer(server)
    try:
        for i in range(300):   # more than the C loop serves between two returns
            assert peer.read([(i, 1000)])[0] == 0
        deadline = time.monotonic() + 2
        while sum(n for _, _, n in counts) < 300_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {(p, r) for p, r, _ in counts} == {("host_tcp", True)}
        assert sum(n for _, _, n in counts) == 300_000
    finally:
        peer.close()
        server.close()


def test_ids_past_the_loops_table_are_served(segment, loop):
    """A provider that joined more often than the C loop's table holds (``dataloop.IDS``): the newest
    ids are served in C, the oldest ones by Python, any other id is still refused."""
    from memcache_core.transfer.dataloop import IDS
    server = start(segment, loop)   # joined as SID, then IDS + 5 more times
    for i in range(IDS + 5):
        server.serve_segment(1000 + i)
    peer = Peer(server)
    try:
        for sid in (SID, 1000, 1004, 1005, 1000 + IDS + 4):
            assert peer.read([(sid, 100)], sid=sid) == (0, expected(segment, [(sid, 100)]))
        assert peer.read([(0, 10)], sid=0) == (WRONG_SEGMENT, b"")
        assert peer.closed()
    finally:
        peer.close()
        server.close()
