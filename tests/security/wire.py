"""Raw sockets for the adversarial suite that speak (or fail to speak) the pool's handshake, the way
an attacker on the same host would."""

from __future__ import annotations

import socket
import weakref
from typing import Any

from memcache_core import protocol as p
from memcache_core.auth import NO_SESSION, Session, client_handshake, load_secret, recv_exact
from memcache_core.rpc import FRAME_HEAD, RpcClient, seal_frame, take_frame

HEAD = FRAME_HEAD
LAYOUT = [64 << 10, 16 << 10, 16 << 10]


def secret() -> bytes:
    return load_secret("")


def rpc(ms: Any) -> RpcClient:
    return ms.rpc()


def addr_of(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[-1].rsplit(":", 1)
    return host, int(port)


SESSIONS: weakref.WeakKeyDictionary[socket.socket, Session] = weakref.WeakKeyDictionary()


def frame(req: p.Request, rid: int = 1, s: socket.socket | None = None) -> bytes:
    """A request frame; sealed with the session of ``s`` (an ``authed`` socket) when given."""
    return seal_frame(rid, p.request_encoder.encode(req), SESSIONS[s] if s is not None else NO_SESSION)


def authed(addr: tuple[str, int], key: bytes | None = None, source: str | None = None) -> socket.socket:
    """A connection that passed the handshake (with the pool's secret unless ``key`` is given), from
    the ``source`` address when given (another loopback address: another host, as the server sees it)."""
    s = socket.create_connection(addr, timeout=10, source_address=(source, 0) if source else None)
    SESSIONS[s] = client_handshake(s, secret() if key is None else key)
    return s


def ask(s: socket.socket, req: p.Request) -> p.Reply:
    """One request on an authenticated raw socket; the decoded reply (its MAC checked)."""
    s.sendall(frame(req, s=s))
    head = recv_exact(s, HEAD.size)
    n, _ = HEAD.unpack(head)
    got = take_frame(bytearray(head + recv_exact(s, n + SESSIONS[s].size)), SESSIONS[s])
    assert got is not None
    return p.reply_decoder.decode(got[1])


def recv_all(s: socket.socket, timeout_s: float) -> bytes:
    """Everything the peer sends until it closes (or ``timeout_s`` passes: then AssertionError)."""
    s.settimeout(timeout_s)
    out = bytearray()
    try:
        while chunk := s.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    except TimeoutError as e:
        raise AssertionError(f"the server kept the connection open {timeout_s}s") from e
    return bytes(out)

