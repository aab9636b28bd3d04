"""Page-aligned buffers for direct I/O, lent by a small pool so that a record's read or write does not
map (and fault in) fresh pages every time."""

from __future__ import annotations

import ctypes
import mmap
import threading

GRAIN = 1 << 20


class Aligned:
    """A buffer lent by ``AlignedPool``: ``view()`` is its first ``n`` bytes; ``close()`` gives it back."""

    __slots__ = ("_pool", "mm", "n", "addr")

    def __init__(self, pool: AlignedPool, mm: mmap.mmap, n: int) -> None:
        self._pool: AlignedPool | None = pool
        self.mm = mm
        self.n = n
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))   # for copies that release the GIL

    def view(self) -> memoryview:
        return memoryview(self.mm)[:self.n]

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.give(self.mm)


class AlignedPool:
    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> Aligned:
        with self._lock:
            fits = [m for m in self._free if len(m) >= n]
            if fits:
                mm = min(fits, key=len)
                self._free.remove(mm)
                return Aligned(self, mm, n)
        return Aligned(self, mmap.mmap(-1, (n + GRAIN - 1) // GRAIN * GRAIN), n)

    def give(self, mm: mmap.mmap) -> None:
        with self._lock:
            self._free.append(mm)
            if len(self._free) <= self.keep:
                return
            self._free.sort(key=len)
            drop = self._free.pop(0)
        try:
            drop.close()
        except BufferError:   # a view is still held somewhere: the GC frees it
            pass
