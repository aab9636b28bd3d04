"""Control-plane framing, the leaf both sides share: ``u32 length | u64 request id | msgpack payload``,
then (on an authenticated connection) the session's MAC of both (``auth.Session``).

A header announcing more than ``MAX_FRAME`` bytes is refused (the peer is dropped); the server reads
frames only after the pool's handshake.
"""

from __future__ import annotations

import errno
import logging
import resource
import struct

from ..auth import NO_SESSION, Session

logger = logging.getLogger(__name__)

FRAME_HEAD = struct.Struct("<IQ")   # body length, request id: before every control-plane frame
MAX_FRAME = 256 << 20             # a Join of a segment with ~1M objects; only after authentication


def take_frame(buf: bytearray, session: Session = NO_SESSION) -> tuple[int, bytes] | None:
    """Cut one whole frame (request id, body) off the front of ``buf``; None until one is complete.
    A header announcing more than ``MAX_FRAME`` bytes, or a frame that fails the ``session``'s MAC
    (the ``session.size`` bytes after the body), raises ValueError (the peer is dropped)."""
    if len(buf) < FRAME_HEAD.size:
        return None
    n, rid = FRAME_HEAD.unpack_from(buf)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    end = FRAME_HEAD.size + n
    if len(buf) < end + session.size:
        return None
    if session.size:
        with memoryview(buf) as view:
            ok = session.check(view[end:end + session.size], view[:end])
        if not ok:
            raise ValueError("a frame failed the connection's MAC (injected or altered)")
    body = bytes(buf[FRAME_HEAD.size:end])
    del buf[:end + session.size]
    return rid, body


def seal_frame(rid: int, body: bytes, session: Session = NO_SESSION) -> bytes:
    """One frame: header, ``body``, the ``session``'s MAC of both."""
    head = FRAME_HEAD.pack(len(body), rid)
    return head + body + session.seal(head, body)


def is_addr_in_use(e: OSError) -> bool:
    return e.errno == errno.EADDRINUSE


def is_out_of_descriptors(e: OSError) -> bool:
    """accept() failed for want of a file descriptor or kernel memory: back off, then accept again."""
    return e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_fd_limit() -> None:
    """Every connection is a file descriptor: take the hard limit, not the (often 1,024) soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d: %s", soft, e)
