"""The data plane's headers bound to their connection: each request and answer header is followed by
the MAC of its session (``auth.Session``), checked before it is acted on. Payload bytes are not
MAC'd (objects' checksums cover them: docs/security.md)."""

from __future__ import annotations

import socket

from ..auth import Session
from ..errors import TransferFailed


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r


def sealed(session: Session, data: bytes) -> bytes:
    """``data`` followed by its MAC in ``session``."""
    return data + session.seal(data)


def recv_sealed(sock: socket.socket, session: Session, n: int, what: str) -> bytes:
    """``n`` bytes and their MAC; TransferFailed (the caller drops the connection) when it fails."""
    got = bytearray(n + session.size)
    recv_exact(sock, memoryview(got))
    if not session.check(got[n:], got[:n]):
        raise TransferFailed(f"{what} failed the connection's MAC (a relay's or altered bytes)")
    return bytes(got[:n])
