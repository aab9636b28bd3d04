"""Same-host transfers: map the owner's shared-memory segment and memmove (releases the GIL).

Mappings are keyed by the segment file's path, never by a segment id: ids are issued by the
MetaService and can change when a member re-joins, a path names one file for its whole life.
"""

from __future__ import annotations

import ctypes
import threading

from ..errors import PeerUnavailable
from ..memory import Mapping
from ..protocol import SegmentInfo

memmove = ctypes.memmove


class ShmTransport:
    def __init__(self, own: Mapping | None) -> None:
        self._own = own
        self._maps: dict[str, Mapping] = {}
        if own is not None:
            self._maps[own.path] = own
        self._lock = threading.Lock()

    def is_own(self, seg: SegmentInfo) -> bool:
        return self._own is not None and seg.shm_path == self._own.path

    def base(self, seg: SegmentInfo) -> int:
        m = self._maps.get(seg.shm_path)
        if m is None:
            with self._lock:
                m = self._maps.get(seg.shm_path)
                if m is None:
                    try:
                        m = Mapping(seg.shm_path, seg.size, create=False)
                    except OSError as e:
                        raise PeerUnavailable(f"cannot map segment {seg.segment_id} ({seg.shm_path}): {e}") from e
                    self._maps[seg.shm_path] = m
        if m.size < seg.size:
            raise PeerUnavailable(f"segment {seg.segment_id} ({seg.shm_path}) is mapped smaller than announced")
        return m.addr

    def forget(self, seg: SegmentInfo) -> None:
        """Unmap a peer's segment (the peer left or died)."""
        if self.is_own(seg):
            return
        with self._lock:
            m = self._maps.pop(seg.shm_path, None)
        if m is not None:
            m.close()

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for m in maps.values():
            if m is not self._own:
                m.close()
