"""Same-host transfers: map the owner's shared-memory segment and memmove (releases the GIL).

Mappings are keyed by the segment file's path, never by a segment id: ids are issued by the
MetaService and can change when a member re-joins, a path names one file for its whole life. A peer
file is mapped only if it lies in this host's segment directory, has a segment file's name, is a
regular file of this user (no links) and is as large as announced. A copy pins the mapping it uses:
a peer that leaves meanwhile is unmapped when the last copy ends, never under it. A same-host
segment whose file cannot be mapped here (another ``MEMCACHE_SHM_DIR``, another user) is logged once
and left to TCP (``reachable``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from collections.abc import Iterator

from ..errors import PeerUnavailable
from ..host import shm_dir
from ..memory import Mapping, owner_alive
from ..records import SegmentInfo

logger = logging.getLogger(__name__)

memmove = ctypes.memmove

_NAME_RE = re.compile(r"^memcache-\d+-[0-9a-f]+$")


class ShmTransport:
    def __init__(self, own: Mapping | None) -> None:
        self._own = own
        self._maps: dict[str, Mapping] = {}
        if own is not None:
            self._maps[own.path] = own
        self._unreachable: set[str] = set()   # same-host segment files this process cannot map
        self._lock = threading.Lock()

    def reachable(self, seg: SegmentInfo) -> bool:
        """Whether a segment of this host can be copied through shared memory here: mapped now (kept
        for the copies), or not at all (its file lies outside this process's ``MEMCACHE_SHM_DIR``,
        say). The first failure per file is logged, once, with the path and the remedy; the caller
        then moves its bytes through the owner's TCP data server."""
        with self._lock:
            if seg.shm_path in self._maps:
                return True
            if seg.shm_path in self._unreachable:
                return False
            try:
                self._maps[seg.shm_path] = self._map(seg)
                return True
            except PeerUnavailable as e:
                self._unreachable.add(seg.shm_path)
                why = str(e)
        if os.path.dirname(seg.shm_path) != os.path.realpath(shm_dir()):
            logger.warning("%s; copying to and from it over its TCP data server %s instead. Every process "
                           "of a host should see the same MEMCACHE_SHM_DIR (here %r) to copy through shared "
                           "memory", why, seg.data_addr, shm_dir())
        else:   # the file is gone (its owner died) or not ours
            logger.info("%s; trying its TCP data server %s instead", why, seg.data_addr)
        return False

    def is_own(self, seg: SegmentInfo) -> bool:
        return self._own is not None and seg.shm_path == self._own.path

    @contextlib.contextmanager
    def pinned(self, seg: SegmentInfo) -> Iterator[Mapping]:
        """The segment's mapping (``addr``: its first byte; ``fence``), valid until the block ends."""
        with self._lock:
            m = self._maps.get(seg.shm_path)
            if m is None:
                m = self._map(seg)
                self._maps[seg.shm_path] = m
            m.refs += 1
        try:
            yield m
        finally:
            with self._lock:
                m.refs -= 1
                close = m.retired and m.refs == 0
            if close:
                m.close()

    def _map(self, seg: SegmentInfo) -> Mapping:
        path = seg.shm_path
        if os.path.dirname(path) != os.path.realpath(shm_dir()) or not _NAME_RE.match(os.path.basename(path)):
            raise PeerUnavailable(f"segment {seg.segment_id}: {path!r} is not a segment file of this host")
        try:
            return Mapping(path, seg.size, create=False)
        except OSError as e:
            raise PeerUnavailable(f"cannot map segment {seg.segment_id} ({path}): {e}") from e

    def owner_gone(self, seg: SegmentInfo) -> bool:
        """Whether a peer segment's owner is known dead: its file's owner lock is no longer held (or
        the file is gone). Our own segment, and a segment of a build whose owner holds no such lock,
        never are. The file outlives a killed owner, so a copy into it succeeds: a writer asks this
        after its commit, before it reports the put stored."""
        if self.is_own(seg) or not seg.owner_lock:
            return False
        try:
            return not owner_alive(seg.shm_path)
        except OSError as e:   # (not a file we may open: not ours to judge)
            logger.debug("cannot ask whether segment %d's owner lives (%s)", seg.segment_id, e)
            return False

    def forget(self, seg: SegmentInfo) -> None:
        """Unmap a peer's segment (the peer left or died) once no copy uses it."""
        if self.is_own(seg):
            return
        with self._lock:
            self._unreachable.discard(seg.shm_path)
            m = self._maps.pop(seg.shm_path, None)
            if m is None:
                return
            m.retired = True
            close = m.refs == 0
        if close:
            m.close()

    def mapped(self) -> list[str]:
        with self._lock:
            return list(self._maps)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for m in maps.values():
            if m is not self._own:
                m.retired = True
                if m.refs == 0:
                    m.close()
