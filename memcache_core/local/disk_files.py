"""The disk tier's files: the checks that ``disk_path`` is this user's own, the lock on it, the
direct-I/O probe, and the scan that finds the records again at start (``disk.py`` uses them).

Another local user must not be able to prepare the tier: ``disk_path`` and its ``objects`` directory
must be real directories (no symlink) owned by this process's user and writable by no one else, and
every directory above must be owned by this user or root and, if others may write it, sticky (like
/tmp), so no one else can swap a path component. Every file is opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat

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


NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def check_private_dir(path: str) -> None:
    """ConfigError unless ``path`` is a directory of this user's that no one else can change (above)."""
    uid = os.getuid()
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"disk_path: cannot inspect {path}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"disk_path: {path} is not a directory (a symlink or a file); point disk_path at a "
                          f"directory of this user's")
    if st.st_uid != uid:
        raise ConfigError(f"disk_path: {path} belongs to uid {st.st_uid}, not to this process (uid {uid}): "
                          f"another user may have prepared it; use a directory of your own (mode 0700)")
    if st.st_mode & 0o022:
        raise ConfigError(f"disk_path: {path} is writable by other users (mode {st.st_mode & 0o777:o}); "
                          f"chmod 700 it")
    parent = os.path.dirname(path)
    while parent and parent != path:
        try:
            pst = os.stat(parent)
        except OSError as e:
            raise ConfigError(f"disk_path: cannot inspect {parent}: {e.strerror}") from e
        if pst.st_uid not in (0, uid) or (pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX):
            raise ConfigError(f"disk_path: {parent}, above {path}, can be changed by another user (owner uid "
                              f"{pst.st_uid}, mode {pst.st_mode & 0o7777:o}): it could swap the directory; use "
                              f"a disk_path under directories only you (or root) can change")
        path, parent = parent, os.path.dirname(parent)


def scan_records(objects_dir: str, mac_key: bytes | None = None) -> tuple[list[tuple[float, str, Record]], int]:
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
            got = _read_record_header(path, os.path.join(sub, name), mac_key) if name.endswith(rec.SUFFIX) else None
            if got is None:
                bad += 1
                continue
            found.append(got)
    return found, bad


O_DIRECT = getattr(os, "O_DIRECT", 0)


def _read_record_header(path: str, rel: str, mac_key: bytes | None) -> tuple[float, str, Record] | None:
    """(mtime, key, record) of a whole, valid record file of this pool filed under its own key's name,
    else None (the file is removed: it is torn, foreign, another pool's or filed under another key)."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            head = f.read(rec.BLOCK)
            st = os.fstat(f.fileno())
    except OSError as e:
        logger.warning("disk tier: cannot read %s: %s", path, e.strerror)
        unlink(path)   # a symlink (ELOOP) or an unreadable file: not a record of ours
        return None
    h = rec.unpack_header(head, mac_key)
    if h is None or rec.name_of(h[0]) != rel or st.st_size < rec.footprint(h[2]) or not stat.S_ISREG(st.st_mode):
        logger.warning("disk tier: %s is not a whole record of this pool of the key it is filed under; removed",
                       path)
        unlink(path)
        return None
    key, gen, size, checksum = h
    return st.st_mtime, key, Record(gen, size, checksum)


def take_lock(root: str) -> int:
    path = os.path.join(root, "LOCK")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
    except OSError as e:
        raise ConfigError(f"disk_path: cannot open {path} (a symlink?): {e.strerror}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise ConfigError(f"disk_path: {path} is not a file of this user's; remove it")
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
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT | NOFOLLOW, 0o600)
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
