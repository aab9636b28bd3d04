"""Same-host transfers: map the owner's shared-memory segment and memmove (releases the GIL)."""

from __future__ import annotations

import ctypes
import threading

from ..errors import PeerUnavailable
from ..local.segment import Mapping
from ..protocol import SegmentInfo

memmove = ctypes.memmove


class ShmTransport:
    def __init__(self, own: Mapping | None, own_id: int | None) -> None:
        self._maps: dict[int, Mapping] = {}
        if own is not None and own_id is not None:
            self._maps[own_id] = own
        self._own_id = own_id
        self._lock = threading.Lock()

    def base(self, seg: SegmentInfo) -> int:
        m = self._maps.get(seg.segment_id)
        if m is None:
            with self._lock:
                m = self._maps.get(seg.segment_id)
                if m is None:
                    try:
                        m = Mapping(seg.shm_path, seg.size, create=False)
                    except OSError as e:
                        raise PeerUnavailable(f"cannot map segment {seg.segment_id} ({seg.shm_path}): {e}") from e
                    self._maps[seg.segment_id] = m
        return m.addr

    def write(self, seg: SegmentInfo, offset: int, pieces: list[tuple[int, int]]) -> None:
        pos = self.base(seg) + offset
        for ptr, size in pieces:
            memmove(pos, ptr, size)
            pos += size

    def read(self, seg: SegmentInfo, offset: int, pieces: list[tuple[int, int]]) -> None:
        pos = self.base(seg) + offset
        for ptr, size in pieces:
            memmove(ptr, pos, size)
            pos += size

    def forget(self, segment_id: int) -> None:
        """Unmap a peer's segment (the peer left or died)."""
        if segment_id == self._own_id:
            return
        with self._lock:
            m = self._maps.pop(segment_id, None)
        if m is not None:
            m.close()

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for sid, m in maps.items():
            if sid != self._own_id:
                m.close()
