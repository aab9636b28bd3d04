"""The records control-plane messages carry (``protocol.py``): a segment, a location, an object's
report and journal entry, the bytes moved through a segment, and the per-key results of Alloc, Lookup
and a drain's moves. Leaf structs: the MetaService's table and the transfer engines use them too.
And the bounds the decoder checks on the lists of keys and reports a request carries."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .errors import MAX_KEY_BYTES

MAX_KEYS = 1 << 13   # keys in one request: the MetaService's single loop answers it in well under a second
# (1M keys took 17.7 s); a LocalService splits a larger batch into requests of at most this many
# (local/membership.py in_batches), so an engine never meets the bound


class SegmentInfo(msgspec.Struct, frozen=True):
    """A LocalService's contribution to the pool, as every peer needs to reach it."""

    segment_id: int
    size: int
    host_id: str
    shm_path: str          # shared-memory file, mappable by peers on the same host
    data_addr: str         # "host:port" of the owner's data server (TCP transfers)
    tag: str = ""
    nixl: bytes = b""      # NIXL agent metadata and region (transfer/nixl.py): a capability, members only
    metrics_addr: str = ""  # "host:port" of the owner's own /metrics (metrics_port); "" = none
    gva_slot: int = 0      # the pool's number for this segment in GVAs (local/gva.py), issued by the
                           # MetaService at join (0: none, past 16,383 segments): one number per process
    owner_lock: bool = False  # the owner holds its lock on shm_path while it lives (memory.owner_alive);
    #                           False: an older build's segment, whose owner cannot be asked that way


class Location(msgspec.Struct, array_like=True, frozen=True, gc=False):   # two ints: never in a cycle
    segment_id: int
    offset: int


class ObjectReport(msgspec.Struct, array_like=True, frozen=True):
    """One committed object held in a segment, as its header describes it (MetaService recovery).

    ``offset`` is where the object's header starts; the payload follows it (``layout.py``).
    ``checksum`` is the payload's XXH3-64, 0 when the writer computed none.
    """

    key: str
    offset: int
    size: int
    generation: int
    checksum: int = 0


class JournalEntry(msgspec.Struct, array_like=True, frozen=True):
    """A change to a segment's objects, pushed to its owner on heartbeat replies."""

    seq: int
    added: bool
    obj: ObjectReport
    disk: bool = False   # (not added) the owner's disk tier deletes its record of ``obj`` before acknowledging



class SegmentBytes(msgspec.Struct, array_like=True, frozen=True):
    """Payload bytes a member moved through shared memory out of (``read``) and into (``written``)
    one segment since its last heartbeat: the segment's owner never sees such copies, so the
    MetaService passes the sums on to it (``HeartbeatReply.served``)."""
    segment_id: int
    read: int
    written: int


class DrainMove(msgspec.Struct, array_like=True, frozen=True):
    """Copy one committed object from the owner's segment (``source_offset``) to ``target``, where
    space is reserved for it; ``generation`` and ``checksum`` are the committed object's."""

    key: str
    size: int
    source_offset: int
    generation: int
    checksum: int
    new_generation: int
    target: Location
    fence: int = 0                 # the fence token of the target segment's join the space was reserved in
    #                                (fence.py; 0: a MetaService before join tokens)


class AllocResult(msgspec.Struct, array_like=True):
    code: int                      # 0 allocated, OBJECT_ALREADY_EXISTS (with the object's generation and
    #                                locations), or a negative error code
    generation: int = 0
    locations: list[Location] = []
    fences: list[int] = []         # allocated: per location, the fence token of its segment's join (fence.py;
    #                                a write there carries it); none from a MetaService before join tokens


class Found(msgspec.Struct, array_like=True):
    size: int
    generation: int
    locations: list[Location]
    checksum: int = 0
    disk: int = 0                  # segment id of the provider holding a disk copy (0: none)


# Checked by the decoder itself (about 2 ns a key): a key of 1 to 255 characters (the UTF-8 byte
# bound is checked where a key is stored: meta/validate.py), at most MAX_KEYS of them.
Keys = Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES - 1)]],
                 msgspec.Meta(max_length=MAX_KEYS)]
# A segment's objects (or disk records) a Join or a Report carries: at most MAX_KEYS a request
Reports = Annotated[list[ObjectReport], msgspec.Meta(max_length=MAX_KEYS)]


class Copied(msgspec.Struct):
    """Copies a member made of its objects (the fields of ``DrainDone`` and ``RepairDone``, protocol.py):
    ``ok`` per move, the payload checksum it computed while copying, and the new generations the moves
    were planned with."""

    client_id: int
    token: bytes
    keys: list[str]
    generations: list[int]
    checksums: list[int]
    ok: list[bool]
