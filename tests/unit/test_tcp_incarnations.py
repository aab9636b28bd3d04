"""Connections pooled per peer incarnation (``transfer/tcp.py``): a provider killed and started again
listens on the same address (its ``hcom_url``) under a new segment id, often while the old one is
still a member. A connection made to the old process must not carry a request for the new one, and
forgetting the old one must leave the new one's requests alone."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from memcache_core.errors import PeerUnavailable
from memcache_core.local.segment import create_segment
from memcache_core.memory import Mapping
from memcache_core.testing import wait_for
from memcache_core.transfer.disk_wire import OP_DISK_READ
from memcache_core.transfer.tcp import HEAD, OP_READ, RANGE, TcpClient
from memcache_core.transfer.tcp_server import DataServer

OLD, NEW = 11, 12   # the segment ids of two incarnations of one provider


@pytest.fixture
def segments() -> Iterator[list[Mapping]]:
    segs = [create_segment(1 << 20) for _ in range(2)]
    for i, seg in enumerate(segs):
        seg.view(0, 4096)[:] = bytes([i + 1]) * 4096
    yield segs
    for seg in segs:
        seg.close()


def _read(client: TcpClient, addr: str, sid: int) -> bytes:
    out = np.zeros(4096, np.uint8)
    client.read(addr, [(0, [(out.ctypes.data, out.nbytes)])], segment_id=sid)
    return out.tobytes()


def test_a_restarted_peer_on_the_same_address_is_read_on_a_connection_of_its_own(segments, data_server_loop):
    """Scenario: a reader read segment OLD over TCP (its connection is pooled); OLD's process dies and
    its next incarnation (segment NEW, other bytes) listens on the same address. Before, the read of
    NEW took the pooled connection to the dead process and failed: every object asked of NEW in that
    batch (a provider's whole disk tier after a quick restart) read as a miss. Now NEW is read on a
    connection of its own, byte-exact, however often this happens."""
    old = DataServer(segments[0], "127.0.0.1", 0, loop=data_server_loop)
    addr = old.addr
    client = TcpClient(timeout_s=10.0)
    try:
        assert _read(client, addr, OLD) == b"\x01" * 4096
        for _ in range(3):   # the old incarnation dies, the new one binds its port; and again
            old.close()
            new = DataServer(segments[1], "127.0.0.1", int(addr.rsplit(":", 1)[1]), loop=data_server_loop)
            assert new.addr == addr, "the new incarnation did not get the old one's port"
            assert _read(client, addr, NEW) == b"\x02" * 4096
            client.forget(addr, OLD)         # the old one is declared dead: NEW's connection stays
            assert _read(client, addr, NEW) == b"\x02" * 4096
            new.close()
            old = DataServer(segments[0], "127.0.0.1", int(addr.rsplit(":", 1)[1]), loop=data_server_loop)
            assert old.addr == addr
            client.forget(addr, NEW)
            assert _read(client, addr, OLD) == b"\x01" * 4096
        old.close()
    finally:
        client.close()


def test_forgetting_an_old_incarnation_leaves_the_new_ones_reads_in_flight():
    """Scenario: a read of segment NEW waits on its data server; the reader learns that OLD, which
    had the same address, was declared dead (``forget(addr, OLD)``): the read of NEW is not ended.
    Forgetting NEW itself ends it at once with PeerUnavailable."""
    with socket.socket() as listener:   # accepts (in the kernel) and never answers: a read stays in flight
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        host, port = listener.getsockname()
        addr = f"{host}:{port}"
        client = TcpClient(timeout_s=60.0)
        out: dict[str, BaseException | None] = {}

        def read() -> None:
            try:
                _read(client, addr, NEW)
                out["error"] = None
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                out["error"] = e

        t = threading.Thread(target=read, daemon=True)
        try:
            t.start()
            wait_for(lambda: client._busy.get((addr, NEW)), 10, "the read to be in flight")
            client.forget(addr, OLD)
            t.join(0.5)
            assert t.is_alive() and "error" not in out, out
            client.forget(addr, NEW)
            t.join(30)
            assert not t.is_alive(), "the read still waits on a forgotten peer"
            assert isinstance(out["error"], PeerUnavailable), out
        finally:
            client.close()


def test_a_request_for_a_segment_the_server_does_not_serve_is_refused(segments, data_server_loop):
    """Scenario: a reader still lists segment OLD (dead) at an address where NEW's data server now
    listens, and opens a fresh connection there. Before, it read NEW's bytes as OLD's (caught only by a
    checksum, when verified). Now NEW's server refuses the request: PeerUnavailable, nothing read or
    written; the request for NEW is served byte-exact, and one naming segment 0 is refused too (no
    wildcard)."""
    server = DataServer(segments[1], "127.0.0.1", 0, loop=data_server_loop)
    server.serve_segment(NEW)
    client = TcpClient(timeout_s=10.0)
    try:
        out = np.zeros(4096, np.uint8)
        with pytest.raises(PeerUnavailable, match=f"does not serve segment {OLD}"):
            client.read(server.addr, [(0, [(out.ctypes.data, out.nbytes)])], segment_id=OLD)
        assert not out.any(), "a refused read wrote into the destination"
        src = np.full(4096, 0xEE, np.uint8)
        with pytest.raises(PeerUnavailable, match=f"does not serve segment {OLD}"):
            client.write(server.addr, [(0, [(src.ctypes.data, src.nbytes)])], segment_id=OLD)
        assert bytes(segments[1].view(0, 4096)) == b"\x02" * 4096, "a refused write reached the segment"
        errs = client.disk_request(server.addr, OP_DISK_READ, [("k", 4096, 0, [(out.ctypes.data, 4096)])], OLD)
        assert [type(e) for e in errs] == [PeerUnavailable] and not out.any()
        assert _read(client, server.addr, NEW) == b"\x02" * 4096
        with pytest.raises(PeerUnavailable, match="does not serve segment 0"):
            _read(client, server.addr, 0)
        server.serve_segment(13)   # a re-join under another id: the same memory, both ids served
        assert _read(client, server.addr, 13) == b"\x02" * 4096
        assert _read(client, server.addr, NEW) == b"\x02" * 4096
    finally:
        client.close()
        server.close()
    bare = DataServer(segments[0], "127.0.0.1", 0, loop=data_server_loop)   # no owner told it an id: serves any
    client = TcpClient(timeout_s=10.0)
    try:
        assert _read(client, bare.addr, OLD) == b"\x01" * 4096
    finally:
        client.close()
        bare.close()


def test_a_request_of_another_data_plane_version_is_refused_and_said_so(segments, caplog, data_server_loop):
    """Scenario: during an upgrade, a member of another memcache version (data plane ``MCD1``) sends
    this provider a read. It is closed unanswered (the reader misses; nothing of the segment is sent),
    and the provider's log names both versions once, not per request; its own version's reads go on."""
    server = DataServer(segments[0], "127.0.0.1", 0, loop=data_server_loop)
    client = TcpClient(timeout_s=10.0)
    try:
        host, port = server.addr.rsplit(":", 1)
        for _ in range(2):
            with socket.create_connection((host, int(port))) as s:   # auth off: no handshake
                s.sendall(HEAD.pack(b"MCD1", OP_READ, 1, 0) + RANGE.pack(0, 4096) + bytes(64))
                s.settimeout(10.0)
                try:
                    answer = s.recv(1)
                except ConnectionResetError:   # closed with the request's unread bytes: a reset
                    answer = b""
                assert answer == b"", "a request of another version was answered"
        wait_for(lambda: "speaks data-plane protocol" in caplog.text, 10, "the version warning")
        assert caplog.text.count("a peer speaks data-plane protocol MCD1, this provider MCD2") == 1
        assert _read(client, server.addr, 0) == b"\x01" * 4096
    finally:
        client.close()
        server.close()
