"""DRAM segments in POSIX shared memory, so that peers on the same host copy with one memcpy.

A segment is a file under /dev/shm named ``memcache-<pid>-<random token>``. Its owner creates it and
unlinks it on close; a peer on the same host maps it by path. Segments whose owner died (``kill -9``)
are unlinked by the next LocalService that starts on the host.
"""

from __future__ import annotations

import logging
import os
import re
import secrets

from ..config import shm_dir
from ..memory import Mapping

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^memcache-(\d+)-([0-9a-f]+)$")


def create_segment(size: int) -> Mapping:
    """A new segment file, named by this pid and a random token (ids are issued later, at Join)."""
    cleanup_stale_segments()
    path = os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(8)}")
    return Mapping(path, size, create=True)


def cleanup_stale_segments() -> int:
    """Unlink segment files whose owning process no longer exists on this host."""
    n = 0
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return 0
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(os.path.join(shm_dir(), name))
            n += 1
        except OSError:
            pass
    if n:
        logger.info("removed %d shared-memory segments left by dead processes", n)
    return n
