"""Best-fit range allocator for one segment, with coalescing of neighbouring free ranges.

The MetaService owns one per segment and never touches the memory itself: it hands out offsets.
Every allocation is rounded up to ``ALIGN`` bytes so payload copies start on cache-line boundaries.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from ..layout import ALIGN


def aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class Allocator:
    def __init__(self, size: int) -> None:
        self.size = size - size % ALIGN
        self.used = 0
        self._by_offset: dict[int, int] = {}     # free range start -> length
        self._by_end: dict[int, int] = {}        # free range end -> start
        self._by_size: list[tuple[int, int]] = []  # (length, start), sorted: best fit by bisect
        if self.size:
            self._add_free(0, self.size)

    @classmethod
    def from_used(cls, size: int, used: Iterable[tuple[int, int]]) -> Allocator:
        """Rebuild an allocator from the ranges ``(offset, length)`` known to be in use (recovery)."""
        a = cls(0)
        a.size = size - size % ALIGN
        pos = 0
        for off, length in sorted(used):
            length = aligned(length)
            if off < pos or off + length > a.size:
                raise ValueError(f"overlapping or out-of-bounds range at offset {off}")
            if off > pos:
                a._add_free(pos, off - pos)
            a.used += length
            pos = off + length
        if pos < a.size:
            a._add_free(pos, a.size - pos)
        return a

    @classmethod
    def building(cls, size: int) -> Allocator:
        """An allocator rebuilt from used ranges given in rising offsets, a batch at a time (recovery in
        pieces): ``take`` each, then ``built``. Until then nothing past the last range taken is free."""
        a = cls(0)
        a.size = size - size % ALIGN
        return a

    def take(self, pos: int, off: int, length: int) -> int | None:
        """While building: the range at ``off`` is in use; ``pos`` is where the last one taken ended.
        Returns where this one ends, or None (nothing changed) when it starts before ``pos`` (overlaps
        or is out of order) or ends past the segment."""
        length = aligned(length)
        if off < pos or off + length > self.size:
            return None
        if off > pos:
            self._add_free_after(pos, off - pos)
        self.used += length
        return off + length

    def built(self, pos: int) -> None:
        """Every used range was taken: the rest, from ``pos`` on, is free."""
        if pos < self.size:
            self._add_free_after(pos, self.size - pos)

    def _add_free_after(self, start: int, length: int) -> None:
        """A free range past the last one taken, merged with a free range ending at its start (an
        object taken before was freed meanwhile)."""
        prev = self._by_end.get(start)
        if prev is not None:
            self._remove_free(prev, start - prev)
            start, length = prev, length + start - prev
        self._add_free(start, length)

    @property
    def free(self) -> int:
        return self.size - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def alloc(self, n: int) -> int | None:
        """Offset of a new range of ``n`` bytes (rounded up to ALIGN), or None when nothing fits."""
        n = aligned(n)
        i = bisect.bisect_left(self._by_size, (n, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._remove_free(start, length, index=i)
        if length > n:
            self._add_free(start + n, length - n)
        self.used += n
        return start

    def free_range(self, start: int, n: int) -> None:
        n = aligned(n)
        self.used -= n
        end = start + n
        nxt = self._by_offset.get(end)
        if nxt is not None:
            self._remove_free(end, nxt)
            end += nxt
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        self._add_free(start, end - start)

    def _add_free(self, start: int, length: int) -> None:
        self._by_offset[start] = length
        self._by_end[start + length] = start
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int, index: int | None = None) -> None:
        del self._by_offset[start]
        del self._by_end[start + length]
        if index is None:
            index = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[index]
