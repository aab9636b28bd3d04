"""How an object lies on a provider's disk tier: one file per object, a self-describing header block,
then the payload, both padded to the direct-I/O block.

```
0                                   BLOCK
| magic | version | flags | generation | size | checksum | key length | key (256) | header hash | pad | payload | pad |
```

* The file name is derived from the key (``name_of``: XXH3-128 of the key, 256 sub-directories), so
  a record is found by key without an index on disk; the key in the header must match the name it
  lies under (a record copied or renamed to another key's name is refused).
* ``checksum`` is the payload's XXH3-64, as in DRAM headers (``layout.py``): every read verifies it,
  and a mismatch is a miss, never bytes. The header hash makes a torn or foreign header fail.
* A record is written under a temporary name and renamed into place, so a crash leaves either no
  record or a whole file (whose payload a later read still verifies).

Every field read back is validated like a peer's value (magic, version, key length and UTF-8, size
bounds) before it is used.

With authentication on, the header also carries a MAC (keyed BLAKE2b, 16 bytes, right after the
header hash) keyed from the pool secret (``auth.disk_record_key``) over the header, whose checksum
covers the payload: a record planted by someone without the secret, or left by another pool, is no
record here (removed at the scan, a miss on a read).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import xxhash

from .. import layout

BLOCK = 4096                     # direct-I/O alignment of offsets, lengths and buffers
MAGIC = 0x3143_4552_4443_4D4D    # "MMCDREC1" read as a little-endian u64
VERSION = 1
MAX_RECORD_BYTES = 1 << 40       # the largest payload a record may claim (as a peer's object size)
SUFFIX = ".rec"


def padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def footprint(size: int) -> int:
    """Bytes a record of ``size`` payload bytes occupies on disk (header block and padding included)."""
    return BLOCK + padded(size)


def name_of(key: str) -> str:
    """The record's path relative to the tier's ``objects`` directory."""
    h = xxhash.xxh3_128_hexdigest(key.encode())
    return os.path.join(h[:2], h + SUFFIX)


MAC_AT = len(layout.pack_fields(MAGIC, "k", 1, 1, 1, 0))   # the MAC follows the header hash
MAC_BYTES = 16


def _mac(mac_key: bytes, header: bytes | memoryview) -> bytes:
    return hashlib.blake2b(header[:MAC_AT], key=mac_key, digest_size=MAC_BYTES).digest()


def pack_header(key: str, generation: int, size: int, checksum: int, mac_key: bytes | None = None) -> bytes:
    head = layout.pack_fields(MAGIC, key, generation, size, checksum, BLOCK)
    if mac_key is None:
        return head
    return head[:MAC_AT] + _mac(mac_key, head) + head[MAC_AT + MAC_BYTES:]


def unpack_header(buf: bytes | memoryview, mac_key: bytes | None = None) -> tuple[str, int, int, int] | None:
    """(key, generation, size, checksum) of a valid record header (bound to the pool by its MAC when
    ``mac_key`` is given), else None."""
    fields = layout.unpack_fields(buf, MAGIC)
    if fields is None:
        return None
    if mac_key is not None and not hmac.compare_digest(bytes(buf[MAC_AT:MAC_AT + MAC_BYTES]), _mac(mac_key, buf)):
        return None
    _key, gen, size, _checksum = fields
    if not 0 < size <= MAX_RECORD_BYTES or not 0 < gen < (1 << 63):
        return None
    return fields
