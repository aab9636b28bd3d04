"""Control-plane framing, the leaf both sides share: ``u32 length | u64 request id | msgpack payload``.

A header announcing more than ``MAX_FRAME`` bytes is refused (the peer is dropped); the server reads
frames only after the pool's handshake.
"""

from __future__ import annotations

import errno
import logging
import resource
import struct

logger = logging.getLogger(__name__)

FRAME_HEAD = struct.Struct("<IQ")   # body length, request id: before every control-plane frame
MAX_FRAME = 256 << 20             # a Join of a segment with ~1M objects; only after authentication


def take_frame(buf: bytearray) -> tuple[int, bytes] | None:
    """Cut one whole frame (request id, body) off the front of ``buf``; None until one is complete.
    A header announcing more than ``MAX_FRAME`` bytes raises ValueError (the peer is dropped)."""
    if len(buf) < FRAME_HEAD.size:
        return None
    n, rid = FRAME_HEAD.unpack_from(buf)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    end = FRAME_HEAD.size + n
    if len(buf) < end:
        return None
    body = bytes(buf[FRAME_HEAD.size:end])
    del buf[:end]
    return rid, body


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
