"""DRAM segments in POSIX shared memory, so that peers on the same host copy with one memcpy.

A segment is a file under /dev/shm named ``memcache-<pid>-<random token>``. Its owner creates it and
unlinks it on close; a peer on the same host maps it by path. The owner holds a shared ``flock`` on its file
while it lives; files nobody holds a lock on (owner killed with ``kill -9``) are unlinked by the next
LocalService that starts on the host, and an owner that exits normally removes its file at exit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import time

from ..errors import ConfigError
from ..host import shm_dir
from ..memory import Mapping

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^memcache-(\d+)-([0-9a-f]+)$")
STALE_AFTER_S = 5.0
MAX_REMOVED = 4096
# Paths of segment files this process removed as left by dead owners: once joined, it tells the
# MetaService of any segment the pool still lists at one of them (membership.py, _sweep_dead_owners).
removed_here: set[str] = set()


def create_segment(size: int) -> Mapping:
    """A new segment file, named by this pid and a random token (ids are issued later, at Join)."""
    cleanup_stale_segments()
    directory = shm_dir()
    path = os.path.join(directory, f"memcache-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        return Mapping(path, size, create=True)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        raise ConfigError(f"MEMCACHE_SHM_DIR: cannot create the segment file in {directory}: {e.strerror}; "
                          f"point MEMCACHE_SHM_DIR at an existing tmpfs directory this user can write "
                          f"(default /dev/shm; in a container, mount one there)") from e


def cleanup_stale_segments() -> int:
    """Unlink segment files whose owner is gone: nobody holds the owner's flock on them, and no
    process of the pid in the name exists here.

    The lock decides for owners in other pid namespaces (a container sharing /dev/shm holds its lock
    just the same, while its pid means nothing here). The pid keeps the live segments of builds that
    predate the lock (a rolling upgrade on one host): they hold no lock but their pid exists.
    """
    n = 0
    directory = shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _NAME_RE.match(name)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_ctime < STALE_AFTER_S:
                continue   # being created: its owner may not hold the lock yet
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue   # the owner is alive
            os.unlink(path)
            n += 1
            if len(removed_here) < MAX_REMOVED:
                removed_here.add(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    if n:
        logger.info("removed %d shared-memory segments left by processes that are gone", n)
    return n
