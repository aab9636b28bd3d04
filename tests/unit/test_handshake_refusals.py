"""What a member says when a server closes a connection before its handshake ends, over real
sockets: a server out of connection slots says so before it closes (``BUSY``); one that closes
without a word, before its challenge or after our proof, is stopping or restarting (a MetaService
restart), neither out of slots nor holding another secret; a server that refuses our proof says so
(``DENIED``): another pool secret."""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest

from memcache_core import protocol as p
from memcache_core.auth import MAGIC, NONCE, AuthFailed, AuthMismatch, client_handshake, is_auth_mismatch
from memcache_core.errors import MetaServiceUnavailable
from memcache_core.rpc import FrameServer, RpcClient
from memcache_core.testing import polling

SECRET = b"s" * 32


def _ok(body: bytes) -> bytes:
    return p.request_encoder.encode(p.Ok())


def test_a_server_out_of_slots_says_so_before_it_closes(frame_loop):
    """Scenario: a MetaService whose one connection slot is taken refuses a second connection: the
    client's error names the slots, and it is not taken for a wrong secret."""
    with polling(FrameServer([("127.0.0.1", 0)], _ok, secret=SECRET, max_connections=1, frame_loop=frame_loop)) as server:
        port = server.listeners[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as first:
            client_handshake(first, SECRET)   # holds the one slot
            with socket.create_connection(("127.0.0.1", port)) as second:
                with pytest.raises(AuthFailed) as e:
                    client_handshake(second, SECRET)
    assert "out of connection slots" in str(e.value) and not is_auth_mismatch(e.value)


def test_a_server_that_closes_before_its_challenge_is_restarting(caplog):
    """Scenario: the MetaService restarts; a member connects while it is going away (the connection
    is accepted, then closed without a challenge). The member logs that the server is stopping or
    restarting, never that it is out of connection slots."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def closing() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=closing, daemon=True)
    thread.start()
    client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_s=5, secret=SECRET)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s, pytest.raises(ConnectionError) as e:
            client_handshake(s, SECRET)
        assert "stopping or restarting" in str(e.value)
        with caplog.at_level(logging.WARNING, logger="memcache_core.rpc.client"), \
                pytest.raises(MetaServiceUnavailable) as unavailable:
            client.call(p.Heartbeat(1, b"", 0, []), probe=True)
        assert "stopping or restarting" in caplog.text and "connection slots" not in caplog.text, caplog.text
        assert not is_auth_mismatch(unavailable.value)
    finally:
        client.close()
        stop.set()
        listener.close()
        thread.join(5)


def test_a_server_with_another_secret_is_a_mismatch(frame_loop):
    """Scenario: a member holds a secret that is not the pool's: the error is an ``AuthMismatch`` (a
    provider stops on it rather than waiting forever), through the control-plane client too."""
    with polling(FrameServer([("127.0.0.1", 0)], _ok, secret=SECRET, frame_loop=frame_loop)) as server:
        port = server.listeners[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as s, pytest.raises(AuthMismatch):
            client_handshake(s, b"t" * 32)
        client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_s=5, secret=b"t" * 32)
        try:
            with pytest.raises(MetaServiceUnavailable) as e:
                client.call(p.Heartbeat(1, b"", 0, []), probe=True)
        finally:
            client.close()
    assert is_auth_mismatch(e.value) and "wrong pool secret" in str(e.value)


def test_a_server_that_closes_after_our_proof_without_a_word_is_restarting():
    """Scenario: the MetaService goes away between its challenge and its proof (it read ours, then
    its process ended). That is a restart to wait out, not a wrong secret: a provider must not stop
    on it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def challenge_then_close() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(MAGIC + os.urandom(NONCE))
            got = b""
            while len(got) < NONCE + 32 and (chunk := conn.recv(NONCE + 32 - len(got))):
                got += chunk

    thread = threading.Thread(target=challenge_then_close, daemon=True)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname()) as s, pytest.raises(ConnectionError) as e:
            client_handshake(s, SECRET)
        assert "stopping or restarting" in str(e.value) and not is_auth_mismatch(e.value), e.value
    finally:
        thread.join(5)
        listener.close()
