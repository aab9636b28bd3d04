"""How an object lies in a segment: a self-describing header, then the payload.

```
offset                          offset + HEADER_BYTES
| magic | version | generation | size | checksum | key length | key ... | header hash | payload ... |
```

The writer copies the payload first and the header last, before it commits, so a valid header means
the payload under it was written completely. After a MetaService crash the segment's owner finds its
objects again by scanning for headers (``scan``), so a put that returned success is never lost with
the MetaService, whoever wrote it. The header hash makes a header that was torn, half overwritten or
left over in freed space fail validation; the payload checksum (XXH3-64, 0 = none) proves the bytes.

This module is a leaf: the MetaService uses ``footprint`` for allocation, the LocalService and the
transfer paths pack, read and scan headers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import xxhash

if TYPE_CHECKING:
    import numpy as np

from .errors import MAX_KEY_BYTES

ALIGN = 64                      # every allocation starts on a cache line; headers are found there
MAGIC = 0x314A424F4D43_4D4D     # "MMCMOBJ1" read as a little-endian u64
VERSION = 1
_FIXED = struct.Struct("<QIIQQQH")   # magic, version, flags, generation, size, checksum, key length
_HASH = struct.Struct("<Q")
HEADER_BYTES = (_FIXED.size + MAX_KEY_BYTES + _HASH.size + ALIGN - 1) // ALIGN * ALIGN   # 320


class Header(Protocol):
    key: str
    offset: int
    size: int
    generation: int
    checksum: int


def footprint(size: int) -> int:
    """Bytes an object of ``size`` payload bytes occupies in a segment (header included)."""
    return HEADER_BYTES + size


def payload_offset(offset: int) -> int:
    return offset + HEADER_BYTES


def pack_header(key: str, generation: int, size: int, checksum: int) -> bytes:
    return pack_fields(MAGIC, key, generation, size, checksum, HEADER_BYTES)


def unpack_header(buf: bytes | memoryview) -> tuple[str, int, int, int] | None:
    """(key, generation, size, checksum) of a valid header, else None (torn, stale or no header)."""
    return unpack_fields(buf, MAGIC)


def pack_fields(magic: int, key: str, generation: int, size: int, checksum: int, pad_to: int) -> bytes:
    """The self-describing header both a segment's objects and a disk tier's records carry (their
    ``magic`` tells them apart): fixed fields, the key, a hash of both, padded to ``pad_to``."""
    raw = key.encode()
    fixed = _FIXED.pack(magic, VERSION, 0, generation, size, checksum, len(raw))
    body = fixed + raw.ljust(MAX_KEY_BYTES, b"\0")
    return (body + _HASH.pack(xxhash.xxh3_64_intdigest(body))).ljust(pad_to, b"\0")


def unpack_fields(buf: bytes | memoryview, magic: int) -> tuple[str, int, int, int] | None:
    """(key, generation, size, checksum) of a valid ``pack_fields`` header with this magic, else None."""
    body_len = _FIXED.size + MAX_KEY_BYTES
    if len(buf) < body_len + _HASH.size:
        return None
    got_magic, version, _flags, gen, size, checksum, klen = _FIXED.unpack_from(buf)
    if got_magic != magic or version != VERSION or not 0 < klen < MAX_KEY_BYTES:
        return None
    (want,) = _HASH.unpack_from(buf, body_len)
    if xxhash.xxh3_64_intdigest(bytes(buf[:body_len])) != want:
        return None
    try:
        key = bytes(buf[_FIXED.size:_FIXED.size + klen]).decode()
    except UnicodeDecodeError:
        return None
    return key, gen, size, checksum


def header_generation(buf: bytes | memoryview) -> int | None:
    """The generation a header claims, without validating it (for compare-and-clear)."""
    magic, _v, _f, gen, *_ = _FIXED.unpack_from(buf)
    return gen if magic == MAGIC else None


def candidate_offsets(memory: np.ndarray, base: int) -> Iterator[int]:
    """Offsets (``base`` + multiples of ALIGN) where ``memory`` holds the header magic: one word is
    read per 64 bytes. ``base`` must be a multiple of ALIGN."""
    import numpy as np
    n = len(memory) // ALIGN * ALIGN
    words = memory[:n].view(np.uint64)[:: ALIGN // 8]
    for i in np.flatnonzero(words == MAGIC):
        yield base + int(i) * ALIGN
