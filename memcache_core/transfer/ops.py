"""What one copy is: ``CopyOp``, the data the engine and both copy loops (``shmcopy.py``,
``shmloop.py``) share. A leaf of ``transfer/``: it imports none of them."""

from __future__ import annotations

import dataclasses

from ..errors import MemCacheError
from ..layout import pack_header, payload_offset
from ..records import SegmentInfo


@dataclasses.dataclass(slots=True)
class CopyOp:
    """Copy between one object replica and local pieces laid end to end in its payload.

    ``offset`` is where the object's header starts; the payload starts ``HEADER_BYTES`` later.
    Writes: ``key``/``generation`` go into the header; ``checksum`` is computed when ``hash`` is set.
    Reads: ``checksum`` is the committed one; the bytes are verified when ``hash`` is set and it is
    non-zero.
    A range of the payload (the GVA path's ``batch_copy``): the pieces start ``start`` bytes into it,
    and a write of a range (``with_header`` False) leaves the header alone (it is written when the
    object is finished, after all its bytes); such ops carry no hash.
    A read with ``fallback`` (another replica or a disk record can serve it) waits on a TCP peer at
    most ``tcp.Deadline(stall_s, bytes)``, not the whole client timeout.
    A write's ``epoch`` is the fence token of the segment's join its space was granted in (or, from a
    MetaService before join tokens, its epoch): it lands only while the owner's fence holds that same
    value, i.e. the owner has not re-joined since (``fence.py``); 0: not fenced.
    """

    segment: SegmentInfo
    offset: int
    pieces: list[tuple[int, int]]
    nbytes: int
    key: str = ""
    generation: int = 0
    checksum: int = 0
    hash: bool = False
    error: MemCacheError | None = None
    start: int = 0
    with_header: bool = True
    fallback: bool = False    # a read with somewhere else to go: a peer that stalls gets ``stall_s``, not the timeout
    epoch: int = 0            # a write's: the fence token its space was granted under (0: not fenced)

    @property
    def payload_offset(self) -> int:
        return payload_offset(self.offset) + self.start

    def header(self) -> bytes:
        return pack_header(self.key, self.generation, self.nbytes, self.checksum)
