"""The disk tier's files: the checks that ``disk_path`` is this user's own, the lock on it, the
direct-I/O probe, and the scan that finds the records again at start (``disk.py`` uses them).

Another local user must not be able to prepare the tier, nor redirect it later. ``open_private_dir``
walks ``disk_path`` from ``/`` one component at a time, each opened relative to the one above with
``O_NOFOLLOW``: every directory on the way must be owned by this user or root and, if others may write
it, sticky (like /tmp); a symlink on the way is followed only if this user or root owns it (in a sticky
directory no one else can replace it); ``disk_path`` and its ``objects`` directory must be real
directories owned by this process's user and writable by no one else. The tier then keeps the
directory descriptors it found and opens, renames and deletes every file relative to them (``Dirs``),
so nothing done to a path component after the start can move the tier. Every file is opened with
``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
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


MAX_LINKS = 40   # symlinks followed while opening disk_path, as the kernel's own limit
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW


@dataclasses.dataclass(frozen=True, slots=True)
class Dirs:
    """The tier's directories, held open: every file operation is relative to these descriptors."""

    root: str        # the path, for messages only
    root_fd: int
    objects_fd: int

    def close(self) -> None:
        for fd in (self.objects_fd, self.root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def open_tier_dirs(path: str) -> Dirs:
    """``disk_path`` and its ``objects`` directory, created if missing and opened safely (above)."""
    root = os.path.abspath(path)
    root_fd = open_private_dir(root)
    try:
        objects_fd = _open_child(root_fd, "objects", os.path.join(root, "objects"), create=True)
        try:
            _check_own(objects_fd, os.path.join(root, "objects"))
        except BaseException:
            os.close(objects_fd)
            raise
    except BaseException:
        os.close(root_fd)
        raise
    return Dirs(root, root_fd, objects_fd)


def open_private_dir(path: str) -> int:
    """A descriptor of directory ``path`` (created, mode 0700, where missing) that no other user could
    have prepared or can swap; ConfigError naming the component otherwise."""
    uid = os.getuid()
    fd = os.open("/", DIR_FLAGS)
    todo = [c for c in path.split("/") if c]
    where, links = "/", 0
    try:
        _check_above(fd, where, uid)
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            if name == "..":   # taken lexically, after links: abspath already folded the caller's own
                parent = os.path.dirname(where.rstrip("/")) or "/"
                nfd = os.open("..", DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd, where = nfd, parent
                _check_above(fd, where, uid, path)
                continue
            here = os.path.join(where, name)
            st = _lstat_at(fd, name, here)
            if stat.S_ISLNK(st.st_mode):
                if not todo:
                    raise ConfigError(f"disk_path: {here} is not a directory (a symlink); point disk_path at a "
                                      f"directory of this user's")
                if st.st_uid not in (0, uid):
                    raise ConfigError(f"disk_path: {here}, on the way to {path}, is a symlink of uid {st.st_uid}: "
                                      f"another user could re-point it and redirect the tier; use a path without "
                                      f"it (or a link of your own)")
                links += 1
                if links > MAX_LINKS:
                    raise ConfigError(f"disk_path: too many symlinks on the way to {path}")
                target = os.readlink(name, dir_fd=fd)
                todo[:0] = [c for c in target.split("/") if c]
                if target.startswith("/"):
                    os.close(fd)
                    fd, where = os.open("/", DIR_FLAGS), "/"
                continue
            nfd = _open_child(fd, name, here, create=False)
            os.close(fd)
            fd, where = nfd, here
            if todo:
                _check_above(fd, where, uid, path)
        _check_own(fd, path)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _lstat_at(fd: int, name: str, here: str) -> os.stat_result:
    """The entry ``name`` of ``fd``, not followed; a missing one is made, a directory of mode 0700."""
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    _mkdir_at(fd, name, here)
    return os.stat(name, dir_fd=fd, follow_symlinks=False)


def _mkdir_at(fd: int, name: str, here: str) -> None:
    try:
        os.mkdir(name, 0o700, dir_fd=fd)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"disk_path: cannot create {here}: {e.strerror}") from e


def _open_child(fd: int, name: str, here: str, create: bool) -> int:
    if create:
        _mkdir_at(fd, name, here)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError(f"disk_path: {here} is not a directory (a symlink or a file); point disk_path at "
                              f"a directory of this user's") from e
        raise ConfigError(f"disk_path: cannot open {here}: {e.strerror}") from e


def _check_above(fd: int, where: str, uid: int, path: str = "") -> None:
    st = os.fstat(fd)
    if st.st_uid not in (0, uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise ConfigError(f"disk_path: {where}, above {path or 'it'}, can be changed by another user (owner uid "
                          f"{st.st_uid}, mode {st.st_mode & 0o7777:o}): it could swap the directory; use "
                          f"a disk_path under directories only you (or root) can change")


def _check_own(fd: int, path: str) -> None:
    uid = os.getuid()
    st = os.fstat(fd)
    if st.st_uid != uid:
        raise ConfigError(f"disk_path: {path} belongs to uid {st.st_uid}, not to this process (uid {uid}): "
                          f"another user may have prepared it; use a directory of your own (mode 0700)")
    if st.st_mode & 0o022:
        raise ConfigError(f"disk_path: {path} is writable by other users (mode {st.st_mode & 0o777:o}); "
                          f"chmod 700 it")


def scan_records(objects_fd: int, where: str, mac_key: bytes | None = None,
                 ) -> tuple[list[tuple[float, str, Record]], int]:
    """(mtime, key, record) of every whole record in the ``objects`` directory open as ``objects_fd``
    (``where`` names it in messages), and how many files were removed (temporary files of writes cut
    short, and files that are not whole records of their key)."""
    found, bad = [], 0
    for sub in sorted(os.listdir(objects_fd)):
        try:
            dfd = os.open(sub, DIR_FLAGS, dir_fd=objects_fd)
        except OSError:
            continue   # not a directory of ours (a file, a symlink): no record is filed there
        try:
            for name in os.listdir(dfd):
                rel = os.path.join(sub, name)
                if name.endswith(".tmp"):
                    unlink(objects_fd, rel)   # a write cut short by a crash
                    continue
                got = _read_record_header(objects_fd, rel, where, mac_key) if name.endswith(rec.SUFFIX) else None
                if got is None:
                    bad += 1
                    continue
                found.append(got)
        finally:
            os.close(dfd)
    return found, bad


O_DIRECT = getattr(os, "O_DIRECT", 0)


def _read_record_header(objects_fd: int, rel: str, where: str, mac_key: bytes | None,
                        ) -> tuple[float, str, Record] | None:
    """(mtime, key, record) of a whole, valid record file of this pool filed under its own key's name,
    else None (the file is removed: it is torn, foreign, another pool's or filed under another key)."""
    path = os.path.join(where, rel)
    try:
        fd = os.open(rel, os.O_RDONLY | NOFOLLOW, dir_fd=objects_fd)
        with os.fdopen(fd, "rb") as f:
            head = f.read(rec.BLOCK)
            st = os.fstat(f.fileno())
    except OSError as e:
        logger.warning("disk tier: cannot read %s: %s", path, e.strerror)
        unlink(objects_fd, rel)   # a symlink (ELOOP) or an unreadable file: not a record of ours
        return None
    h = rec.unpack_header(head, mac_key)
    if h is None or rec.name_of(h[0]) != rel or st.st_size < rec.footprint(h[2]) or not stat.S_ISREG(st.st_mode):
        logger.warning("disk tier: %s is not a whole record of this pool of the key it is filed under; removed",
                       path)
        unlink(objects_fd, rel)
        return None
    key, gen, size, checksum = h
    return st.st_mtime, key, Record(gen, size, checksum)


def take_lock(dirs: Dirs) -> int:
    root = dirs.root
    path = os.path.join(root, "LOCK")
    try:
        fd = os.open("LOCK", os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600, dir_fd=dirs.root_fd)
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


def supports_direct(dir_fd: int, directory: str) -> bool:
    if not O_DIRECT:
        return False
    probe = f".direct-probe-{os.getpid()}"
    buf = mmap.mmap(-1, rec.BLOCK)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT | NOFOLLOW, 0o600, dir_fd=dir_fd)
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
        unlink(dir_fd, probe)


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:   # a view is still held (an exception's traceback): the GC frees it
        pass


def unlink(dir_fd: int, rel: str) -> None:
    """Delete the file ``rel`` of the directory open as ``dir_fd``, if it is there."""
    try:
        os.unlink(rel, dir_fd=dir_fd)
    except OSError:
        pass
