"""Raw memory: mapped segment files, views and addresses. A leaf: ``local/`` and ``transfer/`` both use it.

A segment is a file (POSIX shared memory, /dev/shm) mapped read-write; ``Mapping.addr`` is the address
of its first byte in this process. Payload copies work on addresses (``ctypes.memmove`` releases the
GIL); ``view_at`` and ``array_at`` give Python views over such addresses for sockets and hashing.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from .fence import FENCE_BYTES, Fence

logger = logging.getLogger(__name__)

_LIVE: set[Mapping] = set()   # segments this process owns: their files are removed at exit

# struct flock (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len, l_pid
_FLOCK = "hhqqi4x"
# The owner's lock covers one byte far past the end of any segment file (a lock may lie beyond the end),
# so it never overlaps the write fence's locks on the fence page (fence.py), which writers take shared.
OWNER_LOCK_AT = 1 << 62
_OWNER_BYTE = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, OWNER_LOCK_AT, 1, 0)


def hold_owner_lock(fd: int, path: str) -> bool:
    """Take the owner's lock on a segment file: an open-file-description (OFD) write lock on one byte
    (``OWNER_LOCK_AT``, clear of the write fence's range), which the kernel drops when the owner's last descriptor of it closes, so when it dies,
    however it dies. Unlike a classic POSIX lock it survives the owner opening and closing the file
    elsewhere; unlike a flock it can be tested without being taken (``owner_alive``). False (logged)
    where the file system refuses it: the segment then says so (``SegmentInfo.owner_lock``)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OWNER_BYTE)
        return True
    except OSError as e:
        logger.warning("cannot hold the owner lock on %s (%s): writers of this host learn that this process "
                       "died only when the MetaService declares it dead (heartbeat_timeout_ms)", path, e)
        return False


def owner_alive(path: str) -> bool:
    """Whether the segment file's owner still holds its lock (``hold_owner_lock``), asked of this
    host's kernel: nothing is taken, so any number of processes may ask at once. A file that no
    longer exists has no owner. Proof of death needs no clock and no pid (pids are reused and mean
    nothing across pid namespaces)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)   # (never waits on a FIFO)
    except FileNotFoundError:
        return False
    try:
        held = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _OWNER_BYTE)
    finally:
        os.close(fd)
    return struct.unpack(_FLOCK, held)[0] != fcntl.F_UNLCK


@atexit.register
def _remove_owned_segments() -> None:
    for m in list(_LIVE):
        try:
            os.unlink(m.path)
        except OSError:
            pass


class Mapping:
    """A mapped segment file: ``addr`` is the address of its first byte in this process. The file is
    ``FENCE_BYTES`` longer than ``size``: the page after the segment's space holds its write fence
    (``fence.py``)."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        """``create``: make the file (its space reserved with fallocate, so a full /dev/shm fails here
        and not as a SIGBUS in a later copy) and hold a shared flock (for ``segment.py``'s clean-up of
        files left by dead owners) and the owner's lock (``hold_owner_lock``: writers test it) on it for
        the mapping's life, which tell other processes the owner is alive. Otherwise map a peer's
        existing file, refusing links, non-regular files, files of another user and files smaller than
        announced."""
        self.path = path
        self.size = size
        self.owner = create
        self.owner_lock = False   # we hold the owner lock (hold_owner_lock) on our own file
        self._lock_fd: int | None = None
        self.refs = 0
        self.retired = False
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                fcntl.flock(fd, fcntl.LOCK_SH)
                self.owner_lock = hold_owner_lock(fd, path)
                try:
                    os.posix_fallocate(fd, 0, size + FENCE_BYTES)
                except OSError as e:
                    os.unlink(path)
                    raise OSError(e.errno, f"dram_size: cannot reserve {size} bytes in {os.path.dirname(path)} "
                                           f"({e.strerror}); give it more room (e.g. docker --shm-size) or "
                                           f"lower dram_size") from e
            else:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < size + FENCE_BYTES:
                    raise OSError(f"{path} is not a segment file of this user of at least {size} bytes "
                                  f"(and its fence page)")
            self._mm: mmap.mmap | None = mmap.mmap(fd, size + FENCE_BYTES, mmap.MAP_SHARED,
                                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if create:
            self._lock_fd = fd
            _LIVE.add(self)
        else:
            os.close(fd)
        self._anchor: ctypes.Array | None = (ctypes.c_char * (size + FENCE_BYTES)).from_buffer(self._mm)
        self.addr = ctypes.addressof(self._anchor)
        self.fence = Fence(path, self.addr + size, size)

    def view(self, offset: int, length: int) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)[offset:offset + length]

    def close(self) -> None:
        if self._mm is None:
            return
        self.fence.close()
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:
            logger.debug("segment %s still has views; leaving the mapping to the GC", self.path)
        self._mm = None
        if self.owner:
            _LIVE.discard(self)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def data_extents(self) -> Iterator[tuple[int, int]]:
        """(start, end) of the file's ranges that hold data (never-written holes are skipped)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pos = 0
            while pos < self.size:
                try:
                    start = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError:
                    return   # no data after pos (ENXIO)
                end = min(os.lseek(fd, start, os.SEEK_HOLE), self.size)
                if start >= self.size:
                    return
                yield start, end
                pos = end
        finally:
            os.close(fd)

    def array(self) -> np.ndarray:
        """The whole mapping as a uint8 array (no copy)."""
        return array_at(self.addr, self.size)


def buffer_address(buf: Any) -> tuple[int, int, Any]:
    """(address, length, keepalive) of any contiguous bytes-like object, read-only ones included."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, arr


def view_at(ptr: int, size: int) -> memoryview:
    """A writable memoryview over raw memory (the caller has checked the range)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def array_at(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 array over raw memory (no copy; the caller has checked the range)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))
