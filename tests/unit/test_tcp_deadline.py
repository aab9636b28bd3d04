"""The progress deadline of TCP reads (``transfer/tcp.py``) against a silent peer: a real listening
socket that accepts connections and never answers, as a frozen process's kernel does."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from memcache_core.errors import PeerUnavailable
from memcache_core.testing import wait_for
from memcache_core.transfer.tcp import MIN_PEER_RATE, Deadline, TcpClient


@pytest.fixture
def silent_peer() -> Iterator[str]:
    """An address whose connections are accepted (by the kernel) and never answered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        host, port = listener.getsockname()
        yield f"{host}:{port}"


def test_the_deadline_grows_with_the_bytes_in_flight():
    assert Deadline(1.0, 0).budget_s == 1.0
    assert Deadline(1.0, MIN_PEER_RATE).budget_s == pytest.approx(2.0)
    assert Deadline(0.5, 4 * MIN_PEER_RATE).budget_s == pytest.approx(4.5)


def test_a_read_with_a_deadline_leaves_a_silent_peer_and_marks_it_suspect(silent_peer):
    """Scenario: the client timeout is a minute; a read given a 0.2 s deadline fails with
    PeerUnavailable long before it, says the peer made no progress, and the peer is suspect."""
    client = TcpClient(timeout_s=60.0)
    buf = np.zeros(4096, np.uint8)
    try:
        assert not client.suspect(silent_peer)
        t = time.monotonic()
        with pytest.raises(PeerUnavailable, match="made no progress"):
            client.read(silent_peer, [(0, [(buf.ctypes.data, buf.nbytes)])], stall_s=0.2)
        assert time.monotonic() - t < 30     # the deadline, not the minute of the client timeout
        assert client.suspect(silent_peer)
        client.forget(silent_peer)           # a peer that left is no longer suspect
        assert not client.suspect(silent_peer)
    finally:
        client.close()


def test_forgetting_a_peer_ends_the_reads_waiting_on_it(silent_peer):
    """Scenario: a read without a deadline (the last copy) waits on a silent peer; the peer is declared
    dead (``forget``): the read ends at once with PeerUnavailable, not after the client timeout."""
    client = TcpClient(timeout_s=60.0)
    buf = np.zeros(4096, np.uint8)
    out: dict[str, BaseException | None] = {}

    def read() -> None:
        try:
            client.read(silent_peer, [(0, [(buf.ctypes.data, buf.nbytes)])])
            out["error"] = None
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    t = threading.Thread(target=read, daemon=True)
    try:
        t.start()
        wait_for(lambda: client._busy.get((silent_peer, 0)), 10, "the read to be in flight")
        client.forget(silent_peer)
        t.join(30)
        assert not t.is_alive(), "the read still waits on a forgotten peer"
        assert isinstance(out["error"], PeerUnavailable), out
    finally:
        client.close()
