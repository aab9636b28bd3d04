"""Requests to a provider's disk tier over its data server (``tcp.py``), after the same handshake.

Request: the data server's head (``b"MCD2"``, op, count, segment id), then per object ``(size u64, checksum u64,
key length u16)`` and the key, then the session's MAC of head and items (``sealed.py``). ``OP_DISK_READ``: the owner reads the record, verifies it and answers
per object ``(status i32, length u64)`` and its MAC, followed by the payload when the status is 0, straight into the
reader's buffers (a server serving another segment answers -3018 for each, reading nothing). ``OP_PROMOTE``: the owner brings the objects back into its DRAM segment and answers
``(status, 0)`` per object. A status is a MemCache code (-3007 no such record, -3110 the record failed
its checksum, -3111 disk I/O error). Everything a peer sends is bounded before it is used.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

from ..auth import Session
from ..errors import MAX_KEY_BYTES, MemCacheError, TransferFailed, error_from_code
from ..memory import view_at
from .sealed import recv_exact, recv_sealed, sealed

OP_DISK_READ, OP_PROMOTE = 3, 4
MAX_OBJECT_BYTES = 1 << 40
_ITEM = struct.Struct("<QQH")
_ANSWER = struct.Struct("<iQ")

Item = tuple[str, int, int, list[tuple[int, int]]]   # key, size, checksum, destination pieces


class _Reader:
    """A request's bytes: first those the data server already received with its head, then the socket's."""

    def __init__(self, sock: socket.socket, pre: bytes | bytearray) -> None:
        self.sock, self.pre = sock, bytes(pre)

    def __call__(self, n: int) -> bytes:
        take, self.pre = self.pre[:n], self.pre[n:]
        if len(take) == n:
            return take
        buf = bytearray(n)
        buf[:len(take)] = take
        recv_exact(self.sock, memoryview(buf)[len(take):])
        return bytes(buf)


def read_items(conn: socket.socket, session: Session, head: bytes | bytearray,
               n: int, pre: bytes | bytearray = b"") -> list[tuple[str, int, int]] | None:
    """The (key, size, checksum) a peer asks for, or None when the request is malformed or fails
    the session's MAC; ``pre``: the request's bytes after ``head`` the data server already received."""
    _recv = _Reader(conn, pre)
    items, raw = [], bytearray(head)
    for _ in range(n):
        item = _recv(_ITEM.size)
        size, checksum, klen = _ITEM.unpack(item)
        if not 0 < klen < MAX_KEY_BYTES or not 0 < size <= MAX_OBJECT_BYTES:
            return None
        name = _recv(klen)
        raw += item
        raw += name
        try:
            key = name.decode()
        except UnicodeDecodeError:
            return None
        items.append((key, size, checksum))
    if not session.check(_recv(session.size), raw):
        return None
    return items


def serve(conn: socket.socket, session: Session, head: bytes | bytearray, op: int, n: int, disk: Any,
          refused: int = 0, pre: bytes | bytearray = b"") -> bool:
    """Answer one disk request (``refused``: a code answered for every object instead); False when it
    was malformed (the connection is then closed). ``pre``: its bytes after ``head`` already received."""
    items = read_items(conn, session, head, n, pre)
    if items is None:
        return False
    if disk is None or refused:
        for _ in items:
            conn.sendall(sealed(session, _ANSWER.pack(refused or -3007, 0)))
        return True
    if op == OP_PROMOTE:
        for code in disk.promote_local(items):
            conn.sendall(sealed(session, _ANSWER.pack(code, 0)))
        return True
    for key, size, checksum in items:
        try:
            buf, view = disk.read(key, size, checksum)
        except MemCacheError as e:
            conn.sendall(sealed(session, _ANSWER.pack(e.code, 0)))
            continue
        try:
            conn.sendall(sealed(session, _ANSWER.pack(0, size)))
            conn.sendall(view)
        finally:
            view.release()
            buf.close()
    return True


def request(sock: socket.socket, session: Session, head: bytes, op: int, items: list[Item],
            on_answer: Callable[[], None] | None = None) -> list[MemCacheError | None]:
    """Send one disk request on an authenticated connection; per-object error or None. ``on_answer``
    runs once the first answer has arrived (from then on a failure is not a closed idle connection)."""
    body = b"".join(_ITEM.pack(size, checksum, len(k.encode())) + k.encode() for k, size, checksum, _ in items)
    sock.sendall(sealed(session, head + body))
    out: list[MemCacheError | None] = []
    for key, size, _, pieces in items:
        status, length = _ANSWER.unpack(recv_sealed(sock, session, _ANSWER.size, f"{key!r}: the disk tier's answer"))
        if on_answer is not None and not out:
            on_answer()
        if status != 0:
            out.append(error_from_code(status, f"{key!r}: the disk tier answered {status}"))
            continue
        if op == OP_DISK_READ:
            if length != size:
                raise TransferFailed(f"{key!r}: the disk tier sent {length} bytes for an object of {size}")
            for ptr, n in pieces:
                recv_exact(sock, view_at(ptr, n))
        out.append(None)
    return out
