"""Same-host transfers: map the owner's shared-memory segment and memmove (releases the GIL).

Mappings are keyed by the segment file's path, never by a segment id: ids are issued by the
MetaService and can change when a member re-joins, a path names one file for its whole life. A peer
file is mapped only if it lies in this host's segment directory, has a segment file's name, is a
regular file of this user (no links) and is as large as announced. A copy pins the mapping it uses:
a peer that leaves meanwhile is unmapped when the last copy ends, never under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Iterator

from ..config import shm_dir
from ..errors import PeerUnavailable
from ..memory import Mapping
from ..protocol import SegmentInfo

memmove = ctypes.memmove

_NAME_RE = re.compile(r"^memcache-\d+-[0-9a-f]+$")


class ShmTransport:
    def __init__(self, own: Mapping | None) -> None:
        self._own = own
        self._maps: dict[str, Mapping] = {}
        if own is not None:
            self._maps[own.path] = own
        self._lock = threading.Lock()

    def is_own(self, seg: SegmentInfo) -> bool:
        return self._own is not None and seg.shm_path == self._own.path

    @contextlib.contextmanager
    def pinned(self, seg: SegmentInfo) -> Iterator[int]:
        """The address of the segment's first byte, valid (mapped) until the block ends."""
        with self._lock:
            m = self._maps.get(seg.shm_path)
            if m is None:
                m = self._map(seg)
                self._maps[seg.shm_path] = m
            m.refs += 1
        try:
            yield m.addr
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

    def forget(self, seg: SegmentInfo) -> None:
        """Unmap a peer's segment (the peer left or died) once no copy uses it."""
        if self.is_own(seg):
            return
        with self._lock:
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
