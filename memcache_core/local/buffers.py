"""Registered buffers: the only memory that pointer-based calls may read or write.

A (pointer, size) pair given to put_from / get_into must lie inside one registered buffer, or the
call is refused with INVALID_PARAM before anything is dereferenced.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidParameter
from ..memory import buffer_address, view_at

__all__ = ["BufferRegistry", "buffer_address", "view_at"]


class BufferRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def register(self, ptr: int, size: int) -> None:
        _check_int("ptr", ptr)
        _check_int("size", size)
        if ptr <= 0 or size <= 0:
            raise InvalidParameter(f"register_buffer: pointer {ptr:#x} and size {size} must be positive")
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr)
            if i > 0 and self._starts[i - 1] == ptr and self._ends[i - 1] == ptr + size:
                return  # registering the same buffer twice is harmless
            starts, ends = list(self._starts), list(self._ends)
            starts.insert(i, ptr)
            ends.insert(i, ptr + size)
            self._starts, self._ends = starts, ends

    def unregister(self, ptr: int, size: int) -> None:
        with self._lock:
            for i, (s, e) in enumerate(zip(self._starts, self._ends, strict=True)):
                if s == ptr and e == ptr + size:
                    self._starts = self._starts[:i] + self._starts[i + 1:]
                    self._ends = self._ends[:i] + self._ends[i + 1:]
                    return
        raise InvalidParameter(f"unregister_buffer: {ptr:#x}+{size} was not registered")

    def regions(self) -> list[tuple[int, int]]:
        return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=True)]

    def check(self, ptr: int, size: int) -> None:
        """Raise InvalidParameter unless [ptr, ptr+size) lies inside one registered buffer."""
        _check_int("ptr", ptr)
        _check_int("size", size)
        if size <= 0:
            raise InvalidParameter(f"size must be positive, got {size}")
        starts, ends = self._starts, self._ends  # copy-on-write lists: no lock needed to read
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0 or ptr + size > ends[i]:
            raise InvalidParameter(f"buffer {ptr:#x}+{size} is not inside a registered buffer")

    def pieces(self, ptrs: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
        """The (pointer, size) pairs, each checked as ``check`` does; in one pass of C-level calls when
        they are plain ints inside one registered buffer (the usual case: a KV-cache pool), else piece
        by piece. Raises InvalidParameter."""
        if len(ptrs) != len(sizes) or not len(ptrs):
            raise InvalidParameter("each key needs as many pointers as sizes, at least one")
        if {*map(type, ptrs), *map(type, sizes)} == _INT and min(sizes) > 0:
            lo, hi = min(ptrs), max(map(operator.add, ptrs, sizes))
            starts, ends = self._starts, self._ends
            i = bisect.bisect_right(starts, lo) - 1
            if i >= 0 and hi <= ends[i]:    # every piece lies in [lo, hi), inside buffer i
                return list(zip(ptrs, sizes, strict=True))
        for ptr, size in zip(ptrs, sizes, strict=True):
            self.check(ptr, size)
        return [(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]


_INT = {int}


def _check_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidParameter(f"{name} must be an int, got {type(v).__name__}")
