"""DRAM segments in POSIX shared memory, so that peers on the same host copy with one memcpy.

A segment is a file under /dev/shm named ``memcache-<pid>-<segment id>``. Its owner creates it and
unlinks it on close; a peer on the same host maps it by path. Segments whose owner died (``kill -9``)
are unlinked by the next LocalService that starts on the host.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re

from ..config import shm_dir

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^memcache-(\d+)-(\d+)$")


class Mapping:
    """A mapped segment file: ``addr`` is the address of its first byte in this process."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise OSError(f"segment file {path} is smaller than {size} bytes")
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._anchor: ctypes.Array | None = (ctypes.c_char * size).from_buffer(self._mm)
        self.addr = ctypes.addressof(self._anchor)
        self.owner = create

    def view(self, offset: int, length: int) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)[offset:offset + length]

    def close(self) -> None:
        if self._mm is None:
            return
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:
            logger.debug("segment %s still has views; leaving the mapping to the GC", self.path)
        self._mm = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def create_segment(segment_id: int, size: int) -> Mapping:
    cleanup_stale_segments()
    path = os.path.join(shm_dir(), f"memcache-{os.getpid()}-{segment_id}")
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
