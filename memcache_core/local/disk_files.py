"""The disk tier's files: the lock on ``disk_path``, the direct-I/O probe, and the scan that finds the
records again at start (``disk.py`` uses them)."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os

from ..errors import ConfigError
from . import disk_record as rec

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Record:
    generation: int
    size: int
    checksum: int

    @property
    def footprint(self) -> int:
        return rec.footprint(self.size)


def scan_records(objects_dir: str) -> tuple[list[tuple[float, str, Record]], int]:
    """(mtime, key, record) of every whole record under ``objects_dir``, and how many files were removed
    (temporary files of writes cut short, and files that are not whole records of their key)."""
    found, bad = [], 0
    for sub in sorted(os.listdir(objects_dir)):
        d = os.path.join(objects_dir, sub)
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            path = os.path.join(d, name)
            if name.endswith(".tmp"):
                unlink(path)   # a write cut short by a crash
                continue
            got = _read_record_header(path, os.path.join(sub, name)) if name.endswith(rec.SUFFIX) else None
            if got is None:
                bad += 1
                continue
            found.append(got)
    return found, bad


O_DIRECT = getattr(os, "O_DIRECT", 0)


def _read_record_header(path: str, rel: str) -> tuple[float, str, Record] | None:
    """(mtime, key, record) of a whole, valid record file filed under its own key's name, else None
    (the file is removed: it is torn, foreign or filed under another key)."""
    try:
        with open(path, "rb") as f:
            head = f.read(rec.BLOCK)
            st = os.fstat(f.fileno())
    except OSError as e:
        logger.warning("disk tier: cannot read %s: %s", path, e.strerror)
        return None
    h = rec.unpack_header(head)
    if h is None or rec.name_of(h[0]) != rel or st.st_size < rec.footprint(h[2]):
        logger.warning("disk tier: %s is not a whole record of the key it is filed under; removed", path)
        unlink(path)
        return None
    key, gen, size, checksum = h
    return st.st_mtime, key, Record(gen, size, checksum)


def take_lock(root: str) -> int:
    path = os.path.join(root, "LOCK")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"disk_path: {root} is in use by another provider (pid {holder}); "
                          f"each provider needs a disk_path of its own") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def supports_direct(directory: str) -> bool:
    if not O_DIRECT:
        return False
    probe = os.path.join(directory, f".direct-probe-{os.getpid()}")
    buf = mmap.mmap(-1, rec.BLOCK)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise ConfigError(f"disk_path: cannot write to {directory}: {e.strerror}") from e
        logger.info("disk tier: %s does not take O_DIRECT (tmpfs?); using buffered I/O", directory)
        return False
    finally:
        _close(buf)
        unlink(probe)


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:   # a view is still held (an exception's traceback): the GC frees it
        pass


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
