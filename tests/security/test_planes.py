"""Authentication on every plane: without the pool secret a peer can do nothing but fail the
handshake (and read /health). Each test checks the honest clients' data is intact afterwards."""

from __future__ import annotations

import socket
import struct
import urllib.error
import urllib.request

import pytest

from memcache_core import protocol as p
from memcache_core.auth import DENIED, MAGIC, NONCE, AuthFailed, client_handshake
from tests.security.wire import LAYOUT, addr_of, frame, recv_all

pytestmark = pytest.mark.integration

HELLO = len(MAGIC) + NONCE


def _data_addr(meta, store) -> tuple[str, int]:
    host, port = meta.segment(store("id")["id"]).data_addr.rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("port", ["meta_service_url", "config_store_url"])
def test_control_frames_without_the_handshake_do_nothing(meta, stores, port):
    """Scenario: a peer without the secret connects to the control (or config-store) port and sends a
    raw RemoveAll frame, with no handshake and then after a handshake with a wrong secret. Nothing is
    decoded: the server sends its hello, closes (saying DENIED at most), and every object is still
    there, byte-exact."""
    victim = stores()
    keys = [f"v-{i}" for i in range(4)]
    assert victim("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
    addr = addr_of(getattr(meta, port))
    with socket.create_connection(addr) as s:        # no handshake at all
        s.sendall(frame(p.RemoveAll()) * 8)
        s.sendall(b"\0" * 64)                         # enough bytes to end the handshake, as garbage
        got = recv_all(s, 8)
    # the hello, then the door closes (with DENIED: the bytes were no proof of the secret, unless the
    # reset for the frames left unread overtakes it)
    assert got[:4] == MAGIC and got[HELLO:] in (b"", DENIED), got
    with socket.create_connection(addr) as s:        # a handshake with the wrong secret
        with pytest.raises(AuthFailed):
            client_handshake(s, b"not-the-pool-secret-at-all")
        try:
            s.sendall(frame(p.RemoveAll()))
            assert recv_all(s, 8) == b""
        except OSError:
            pass
    got = victim("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 4 and got["mismatches"] == []


def test_data_port_reads_and_writes_without_the_secret_are_refused(meta, stores):
    """Scenario: a peer without the secret connects to a LocalService's data port and asks to read the
    whole segment, then to overwrite it. The server answers nothing but its hello and closes; an
    honest reader over TCP still gets the owner's bytes, byte-exact."""
    owner = stores(protocol="host_tcp")
    reader = stores(protocol="host_tcp")
    keys = [f"d-{i}" for i in range(4)]
    assert owner("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
    addr = _data_addr(meta, owner)
    read_req = b"MCD2" + struct.pack("<BIQ", 1, 1, 0) + struct.pack("<QQ", 0, 1 << 20)
    write_req = b"MCD2" + struct.pack("<BIQ", 2, 1, 0) + struct.pack("<QQ", 0, 1 << 20) + b"\xAA" * (1 << 20)
    for req in (read_req, write_req):
        with socket.create_connection(addr) as s:
            try:
                s.sendall(req)
            except OSError:
                pass
            got = recv_all(s, 8)
        assert got[HELLO:] in (b"", DENIED), got  # never a status, never a byte of the segment
    with socket.create_connection(addr) as s:
        with pytest.raises(AuthFailed):
            client_handshake(s, b"not-the-pool-secret-at-all")
    got = reader("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 4 and got["mismatches"] == []


def test_admin_routes_need_the_token_and_health_does_not(meta, stores):
    """Scenario: /get_all_keys, /get_all_segments, /metrics and the other routes hand out keys, shm paths
    and pids: without the admin token (or with a wrong one) they answer 401; /health answers 200."""
    victim = stores()
    assert victim("put", keys=["secret-key"], layout=LAYOUT)["codes"] == [0]
    for path in ("/get_all_keys", "/get_all_segments", "/metrics", "/metrics/summary", "/query_key?key=secret-key",
                 "/api/v1/capacity/usage", "/api/v1/segments/status", "/query_segment?segment=1", "/nope"):
        for headers in ({}, {"Authorization": "Bearer 00"}, {"Authorization": "Basic x"}):
            req = urllib.request.Request(meta.metrics_url + path, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 401, path
            assert b"secret-key" not in e.value.read()
    with urllib.request.urlopen(meta.metrics_url + "/health", timeout=5) as r:
        assert r.status == 200
    assert meta.http("/get_all_keys")["keys"] == ["secret-key"]      # with the token it works
    got = victim("get", keys=["secret-key"], layout=LAYOUT)
    assert got["codes"] == [0] and got["mismatches"] == []
