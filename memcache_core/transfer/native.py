"""The native copy loop (``copyloop.c``): a list of shared-memory copies with their checksums in one call.

The library is built at install time when a C compiler is present (an optional extension, setup.py)
and loaded with ctypes, which releases the GIL for the whole foreign call: the per-piece loop, its
copies and its hashing run without Python. The hash is XXH3-64 streaming from the installed xxhash
package's own extension, whose C functions the loop is handed, so digests are the ones
``xxhash.xxh3_64`` gives; a self-test at load compares them. Where the library or those functions
are missing, ``load`` returns None and the copies take the pure-Python loop (``shmcopy.py``).

An op row is (segment address of the payload, first piece, piece count, stream bytes skipped, stream
bytes, flags, digest); pieces are (address, bytes) pairs. Both are ``array('Q')`` built per batch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from array import array
from itertools import chain
from typing import Any

import xxhash

from .. import nativelib

logger = logging.getLogger(__name__)

READ, COPY, HASH, RESET, DIGEST = 1, 2, 4, 8, 16
ROW = 7                    # uint64 fields per op row (mc_op)
FLAGS_AT, DIGEST_AT = 5, 6  # the row's flags and digest fields
ALL = (1 << 64) - 1        # "every byte of the stream"
SLICE = 64 << 10           # a read copied then hashed while in L1/L2 (measured: 32-128 KiB alike, 16 KiB slower)
WRITE_SLICE = 32 << 10     # a write's slice, hashed then copied while in L1 (its source written just before:
                           # x0.62-0.71 of memcpy in 64 KiB slices, x0.75-0.88 in 32: benchmarks/README.md)

class _State:
    """An XXH3 state of one thread, freed with it."""

    def __init__(self, create: Any, free: Any) -> None:
        self.ptr, self._free = create(), free
        if not self.ptr:
            raise MemoryError("XXH3_createState failed")

    def __del__(self) -> None:
        try:
            self._free(self.ptr)
        except Exception:  # noqa: BLE001 - at interpreter exit the library (or this module's globals) may be gone
            pass


class NativeLoop:
    """The loaded library and the hash functions it is given."""

    def __init__(self, lib: ctypes.CDLL, xxh: ctypes.CDLL) -> None:
        self._run = lib.mc_copy_ops
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._run.restype = ctypes.c_int
        lib.mc_op_size.restype = ctypes.c_uint64
        if lib.mc_op_size() != ROW * 8:
            raise AssertionError(f"the library's op row is {lib.mc_op_size()} bytes, not {ROW * 8}")
        update = getattr(xxh, "XXH3_64bits_update_dispatch", None) or xxh.XXH3_64bits_update
        self._fns = [_address(f) for f in (xxh.XXH3_64bits_reset, update, xxh.XXH3_64bits_digest)]
        self._create, self._free = xxh.XXH3_createState, xxh.XXH3_freeState
        self._create.restype = ctypes.c_void_p
        self._free.argtypes = [ctypes.c_void_p]
        self._local = threading.local()

    def state(self) -> int:
        st = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = _State(self._create, self._free)
        return st.ptr

    def run(self, pieces: array, rows: array, slice_bytes: int = SLICE) -> None:
        """Run the op rows in order (digests land in the rows); the GIL is released meanwhile."""
        nops = len(rows) // ROW
        if nops and self._run(pieces.buffer_info()[0], rows.buffer_info()[0], nops, slice_bytes,
                              self.state(), *self._fns) != 0:
            raise ValueError("copy loop: bad arguments")


def flat_pieces(piece_lists: list[list[tuple[int, int]]]) -> array:
    """The (address, bytes) pairs of the lists, one after the other."""
    return array("Q", chain.from_iterable(chain.from_iterable(piece_lists)))


def _load() -> NativeLoop | None:
    found = nativelib.find(os.path.dirname(os.path.abspath(__file__)), "_copyloop")
    if found is None:
        logger.info("native copy loop not built (no C compiler at install?): shared-memory copies run the "
                    "Python loop (shm_copy_loop, docs/operations.md)")
        return None
    try:
        xxh = ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
        loop = NativeLoop(ctypes.CDLL(found), xxh)
        _self_test(loop)
        return loop
    except (OSError, AttributeError, AssertionError) as e:
        logger.warning("native copy loop not usable (%s): copies run the Python loop", e)
        return None


def _self_test(loop: NativeLoop) -> None:
    """Copy and hash a buffer in slices that do not divide it; compare bytes and digest with xxhash."""
    src = bytes(range(256)) * 1031
    dst = ctypes.create_string_buffer(len(src))
    keep = ctypes.create_string_buffer(src, len(src))
    half = len(src) // 2
    pieces = array("Q", [ctypes.addressof(dst), half, ctypes.addressof(dst) + half, len(src) - half])
    rows = array("Q", [ctypes.addressof(keep), 0, 2, 0, ALL, READ | COPY | HASH | RESET | DIGEST, 0])
    loop.run(pieces, rows, 1000)
    if dst.raw != src or rows[DIGEST_AT] != xxhash.xxh3_64_intdigest(src):
        raise AssertionError("self-test: bytes or digest differ from xxhash's")


def _address(fn: Any) -> int:
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    if not addr:
        raise AttributeError(f"{fn!r} has no address")
    return addr


load = nativelib.once(_load)
"""The native loop, or None where it was not built or the hash functions are not to be had."""
