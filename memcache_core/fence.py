"""The write fence of a segment: no copy granted before its owner's latest join lands in it once the
owner has (re-)joined: not one granted by an earlier MetaService life or leader term, nor one granted
by the same MetaService before the owner was declared dead and re-joined it (docs/design.md,
"Failure of the MetaService").

Every segment file ends with one page past its announced size (``FENCE_BYTES``); its first 8 bytes
hold the *fence*: the *token* of the owner's current join, or 0 while it is (re-)joining. The
MetaService draws a fresh token (``new_token``: random, 63 bits, never 0) at every ``Join`` of a
segment and answers it in ``Joined.fence``; every grant of space in the segment carries the token
of the join it was made in (``AllocResult.fences``, ``DrainMove.fence``, ``InfoReply.fences``). A
write into the segment carries its grant's token (``CopyOp.epoch``), and may copy only while the
fence holds that same token. (A MetaService of a build before join tokens answers none: the owner
fences by its epoch and writers carry the epoch, as they did then; ``tokens``.) The check and the
copy are one step for the owner's re-join, through an open-file-description lock (``F_OFD_SETLK``)
on the fence page:

* a writer (any process: shared-memory copies, the owner's data server for TCP writes, the owner's
  own copies) takes the lock *shared*, reads the fence, and holds the lock until its copy ended; a
  fence of another token refuses the write before a byte moves (a fence of 0, an owner re-joining,
  is waited for up to ``OPEN_WAIT_S`` first);
* the owner, before every join (a re-join after a MetaService restart, or after it was declared dead,
  and so before the MetaService can allocate its space again), sets the fence to 0 and takes the
  lock *exclusive*, which waits until every write in flight has ended; once joined it sets the fence
  to the new join's token. It does the same, without a join, to *rotate* the fence to a token the
  MetaService sends when it reclaimed a grant here whose writer may be frozen (``local/hold.py``).

So a write granted before the re-join either ended before the owner's Join was sent, or is refused:
no timing is involved. A writer frozen in the middle of its copy (or any process of the host holding
a shared lock on the fence page) would hold the owner's exclusive lock for as long as it likes, so the
owner waits at most ``fence_wait_ms`` (``move``'s ``wait_s``); past it, it joins with its segment
*held* (``local/hold.py``): the fence stays 0, so every earlier grant is still refused, the MetaService
places nothing new in the segment, and a thread of the owner waits on (``drained``) and then ``open``s
the fence to the current join's token. The threads of one process share one lock holding (a count),
since one open file description's locks are one lock however many threads take it. Token 0 means not
fenced (reads, tools): such a write is never refused.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator

from .errors import InvalidParameter, StateMismatch

logger = logging.getLogger(__name__)

FENCE_BYTES = 4096     # the page after a segment's payload space: the fence word, and the lock's range
OPEN_WAIT_S = 2.0      # a writer finding the owner re-joining (fence 0) waits this long for the new epoch
MAX_TOKEN = (1 << 63) - 1


def new_token() -> int:
    """A fresh fence token for one join of a segment (the MetaService's): random, so that no two
    joins share one across MetaService lives and leader terms either (odds 2^-63 a pair)."""
    return secrets.randbits(63) or 1


def tokens(fences: list[int], n: int, epoch: int, what: str) -> list[int]:
    """The fence tokens a grant of ``n`` places carries (one per place), as a writer puts them in
    ``CopyOp.epoch``; a grant with none (a MetaService before join tokens): the ``epoch`` of the
    session it came in. A token out of bounds, or a list of another length, is refused."""
    if not fences:
        return [epoch] * n
    if len(fences) != n or not all(0 < f <= MAX_TOKEN for f in fences):
        raise InvalidParameter(f"{what}: the MetaService answered fence tokens {fences[:4]} for {n} places")
    return list(fences)


class StaleGrant(StateMismatch):
    """A write granted before the segment's owner (re-)joined (another join token than its fence's)."""


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
        """The token of the owner's current join (0: joining)."""
        return self._word.value

    def _fd_for_writes(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        return self._fd

    @contextlib.contextmanager
    def writing(self, epoch: int, what: str = "write") -> Iterator[None]:
        """Hold the fence open for a write granted under join token ``epoch`` until the block ends (0:
        unfenced); ``StaleGrant`` if the segment's owner has (re-)joined since that grant."""
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
                raise StaleGrant(f"{what} refused: granted under fence token {epoch}, and the segment's owner "
                                 f"is in {'no join yet' if now == 0 else f'the join of token {now}'} (re-joined "
                                 f"since: its space may hold another object now)")
            time.sleep(0.005)

    def leave(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._fd is not None:
            _lock(self._fd, fcntl.F_UNLCK, self._start, wait=False)

    def move(self, epoch: int, wait_s: float | None = None) -> bool:
        """The owner: set the fence to ``epoch`` (a join's token, or 0) and wait until no write of another
        token is in flight (every process's shared holding has ended): True once none is, False if
        ``wait_s`` passed first (None: no bound). The fence holds ``epoch`` either way."""
        self._word.value = epoch
        return self.drained(wait_s)

    def open(self, epoch: int) -> None:
        """The owner, once the fence was 0 and ``drained``: let the writes of join token ``epoch`` in. (No
        wait: a writer of another token that took its lock since saw 0 or ``epoch``, and lands never.)"""
        self._word.value = epoch

    def drained(self, wait_s: float | None = None, poll_s: float = 0.002) -> bool:
        """True once this process had the lock exclusive (no shared holding was left), dropped at once;
        False if ``wait_s`` passed first (None: no bound)."""
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            deadline = None if wait_s is None else time.monotonic() + wait_s
            while not _lock(fd, fcntl.F_WRLCK, self._start, wait=False):
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(poll_s)
            _lock(fd, fcntl.F_UNLCK, self._start, wait=False)
            return True
        finally:
            os.close(fd)

    def holders(self) -> list[int]:
        """The processes holding a lock on the fence byte, as far as this kernel names them (its
        ``/proc/locks``: an OFD lock's process is the one that took it; some kernels name none)."""
        try:
            ino = os.stat(self.path).st_ino
            with open("/proc/locks", encoding="ascii") as f:
                rows = [line.split() for line in f]
        except OSError:
            return []
        return sorted({int(r[4]) for r in rows if len(r) >= 8 and r[1] == "OFDLCK" and r[5].endswith(f":{ino}")
                       and r[6] == str(self._start) and int(r[4]) > 0})

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
