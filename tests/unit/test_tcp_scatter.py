"""The data server's read in one receive and one ``sendmsg``, the client's answer and payload in one
``recvmsg_into`` (``transfer/tcp_server.py``, ``transfer/tcp.py``): what those calls do not take whole
(a payload larger than the socket takes at once, more ranges than one call carries, a request that
arrives a few bytes at a time) still moves byte for byte."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from memcache_core.auth import client_handshake
from memcache_core.local.segment import create_segment
from memcache_core.memory import Mapping
from memcache_core.transfer.sealed import recv_sealed, sealed
from memcache_core.transfer.tcp import ANSWER, HEAD, MAGIC, OP_READ, RANGE, SCATTER_MAX, TcpClient
from memcache_core.transfer.tcp_server import DataServer

SECRET = b"scatter-and-gather-test-secret-0"
SID = 11
SIZE = 8 << 20


@pytest.fixture
def served(data_server_loop: str) -> Iterator[tuple[Mapping, DataServer]]:
    seg = create_segment(SIZE)
    seg.view(0, SIZE)[:] = np.random.default_rng(5).integers(0, 256, SIZE, np.uint8).tobytes()
    server = DataServer(seg, "127.0.0.1", 0, secret=SECRET, loop=data_server_loop)
    server.serve_segment(SID)
    yield seg, server
    server.close()
    seg.close()


def test_a_read_larger_than_one_send_arrives_whole(served):
    seg, server = served
    client = TcpClient(10.0, secret=SECRET)
    try:
        for size in (1, 4096, 6 << 20):   # 6 MiB: more than the socket takes in one sendmsg
            out = np.zeros(size, np.uint8)
            client.read(server.addr, [(123, [(out.ctypes.data, size)])], segment_id=SID)
            assert out.tobytes() == bytes(seg.view(123, size))
    finally:
        client.close()


def test_reads_of_many_ranges_and_pieces_arrive_in_order(served):
    seg, server = served
    client = TcpClient(10.0, secret=SECRET)
    try:
        for count in (2, SCATTER_MAX - 1, SCATTER_MAX, 3 * SCATTER_MAX):
            out = np.zeros((count, 2, 100), np.uint8)   # each range into two pieces of 100 bytes
            ops = [(i * 1000, [(out[i, 0].ctypes.data, 100), (out[i, 1].ctypes.data, 100)]) for i in range(count)]
            client.read(server.addr, ops, segment_id=SID)
            for i in range(count):
                assert out[i].tobytes() == bytes(seg.view(i * 1000, 200))
    finally:
        client.close()


def test_a_request_sent_a_few_bytes_at_a_time_is_served(served):
    seg, server = served
    host, port = server.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = client_handshake(s, SECRET)
        for n in (1, 3):
            head = HEAD.pack(MAGIC, OP_READ, n, SID)
            ranges = b"".join(RANGE.pack(500 + 64 * i, 64) for i in range(n))
            request = sealed(session, head + ranges)
            for i in range(0, len(request), 5):   # cut inside the head, the ranges and the MAC
                s.sendall(request[i:i + 5])
                time.sleep(0.002)
            status, total = ANSWER.unpack(recv_sealed(s, session, ANSWER.size, "the answer"))
            assert (status, total) == (0, 64 * n)
            got = bytearray()
            while len(got) < total:
                got += s.recv(total - len(got))
            assert bytes(got) == b"".join(bytes(seg.view(500 + 64 * i, 64)) for i in range(n))
