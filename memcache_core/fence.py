"""The write fence of a segment: no copy granted by an earlier MetaService life (or leader term) lands
in it once its owner has re-joined (docs/design.md, "Failure of the MetaService").

Every segment file ends with one page past its announced size (``FENCE_BYTES``); its first 8 bytes
hold the *fence*: the epoch of the MetaService the owner is joined to, or 0 while it is (re-)joining.
A write into the segment carries the epoch its space was granted in (``CopyOp.epoch``), and may copy
only while the fence holds that same epoch. The check and the copy are one step for the owner's
re-join, through an open-file-description lock (``F_OFD_SETLK``) on the fence page:

* a writer (any process: shared-memory copies, the owner's data server for TCP writes, the owner's
  own copies) takes the lock *shared*, reads the fence, and holds the lock until its copy ended; a
  fence of another epoch refuses the write before a byte moves (a fence of 0, an owner re-joining,
  is waited for up to ``OPEN_WAIT_S`` first);
* the owner, before it re-joins (and so before a new MetaService can allocate its space again),
  sets the fence to 0 and takes the lock *exclusive*, which waits until every write in flight has
  ended; once joined it sets the fence to the new epoch.

So a write granted before the re-join either ended before the owner's Join was sent, or is refused:
no timing is involved (a writer frozen in the middle of its copy holds the owner's re-join until it
ends). The threads of one process share one lock holding (a count), since one open file
description's locks are one lock however many threads take it. Epoch 0 means not fenced (reads,
tools): such a write is never refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator

from .errors import StateMismatch

logger = logging.getLogger(__name__)

FENCE_BYTES = 4096     # the page after a segment's payload space: the fence word, and the lock's range
OPEN_WAIT_S = 2.0      # a writer finding the owner re-joining (fence 0) waits this long for the new epoch
WAIT_LOG_S = 5.0       # the owner says why its re-join waits, every this often


class StaleGrant(StateMismatch):
    """A write granted by another MetaService life than the segment's owner is joined to."""


def _lock(fd: int, kind: int, start: int, wait: bool) -> bool:
    """Take (or with ``F_UNLCK`` drop) an OFD lock on one byte at ``start``; False if it would block."""
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)   # struct flock; l_pid 0 for OFD locks
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
        return True
    except BlockingIOError:
        return False
    except PermissionError:   # (EACCES: some systems' "would block")
        if wait:
            raise
        return False


class Fence:
    """The fence of one mapped segment file in this process (``Mapping.fence``)."""

    def __init__(self, path: str, word_addr: int, start: int) -> None:
        self.path = path
        self._word = ctypes.c_uint64.from_address(word_addr)
        self._start = start            # the byte the lock is taken on (the fence page's first)
        self._fd: int | None = None    # this process's shared holding (opened on first use)
        self._holders = 0
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        return self._word.value

    def _fd_for_writes(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        return self._fd

    @contextlib.contextmanager
    def writing(self, epoch: int, what: str = "write") -> Iterator[None]:
        """Hold the fence open for a write granted in ``epoch`` until the block ends (0: unfenced);
        ``StaleGrant`` if the segment's owner is joined to another MetaService life."""
        if not epoch:
            yield
            return
        self.enter(epoch, what)
        try:
            yield
        finally:
            self.leave()

    def enter(self, epoch: int, what: str = "write") -> None:
        deadline = time.monotonic() + OPEN_WAIT_S
        while True:
            with self._lock:
                if self._holders == 0:
                    _lock(self._fd_for_writes(), fcntl.F_RDLCK, self._start, wait=True)
                self._holders += 1
                now = self._word.value
                if now == epoch:
                    return
                self._release()
            if now != 0 or time.monotonic() >= deadline:
                raise StaleGrant(f"{what} refused: granted by MetaService epoch {epoch}, and the segment's owner "
                                 f"is joined to {'none yet' if now == 0 else f'epoch {now}'} (re-joined since: its "
                                 f"space may hold another object now)")
            time.sleep(0.005)

    def leave(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._fd is not None:
            _lock(self._fd, fcntl.F_UNLCK, self._start, wait=False)

    def move(self, epoch: int) -> None:
        """The owner: set the fence to ``epoch`` and return once no write of any other epoch is in flight
        (every process's shared holding has ended). It waits as long as that takes, saying so."""
        self._word.value = epoch
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            t0 = said = time.monotonic()
            while not _lock(fd, fcntl.F_WRLCK, self._start, wait=False):
                if time.monotonic() - said >= WAIT_LOG_S:
                    said = time.monotonic()
                    logger.warning("segment %s: waiting %.0f s for writes granted by the previous MetaService to "
                                   "end before re-joining (a writer frozen mid-copy holds them)", self.path,
                                   said - t0)
                time.sleep(0.002)
            _lock(fd, fcntl.F_UNLCK, self._start, wait=False)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
