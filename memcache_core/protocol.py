"""Every control-plane message, as msgspec Structs (tagged unions decoded with typed decoders): client ->
MetaService ``Request``, replies ``Reply``; one message per batch call, never one per key. Framing is in
``rpc/framing.py``; the records messages carry (``SegmentInfo``, ``Location``, ...) in ``records.py``,
read through this module too (``p.Location``)."""

from __future__ import annotations

import msgspec

from .protocol_disk import Demote as Demote  # (the disk tier's requests, in the union below)
from .protocol_disk import DiskSync as DiskSync
from .protocol_disk import Promote as Promote
from .protocol_disk import Promoted as Promoted
from .records import MAX_KEYS as MAX_KEYS  # (bounds checked by the decoder: records.py)
from .records import AllocResult, DrainMove, Found, JournalEntry, ObjectReport, SegmentBytes, SegmentInfo
from .records import Copied as Copied  # (the fields of DrainDone and RepairDone)
from .records import Keys as Keys
from .records import Location as Location  # no message here holds one directly; read as p.Location
from .records import Reports as Reports

# ---- requests ---------------------------------------------------------------------------------

class Join(msgspec.Struct, tag=True):
    """Join the pool. ``client_id`` 0 asks for a new id; a re-joining member proposes the id it had. Ids
    are issued by the MetaService (never an engine-seeded ``random``); ``segment_id`` becomes the issued id."""

    client_id: int
    host_id: str
    pid: int
    segment: SegmentInfo | None = None
    objects: Reports = []
    token: bytes = b""             # the member token of the id proposed, when re-joining a live member
    disk_objects: Reports = []     # records in the member's disk tier (``offset`` unused)
    generation_ceiling: int = 0    # the highest generation ceiling this member heard (meta/generations.py)
    more: bool = False             # more reports (past MAX_KEYS of either list) follow in ``Report``s
    held: bool = False             # writes of an earlier join still in flight: place nothing new in the segment
    fences: bool = False           # the owner sets its fence to ``Joined.fence`` (an older one: to the epoch)
    rotates: bool = False          # the owner rotates its fence to ``HeartbeatReply.rotate`` when asked


class Report(msgspec.Struct, tag=True):
    """More reports of a segment that joined with ``Join.more`` (objects in rising offsets); after the
    ``last`` the segment takes new objects. Answered by ``Ok`` (refusals reach the owner's journal)."""

    client_id: int
    token: bytes
    objects: Reports = []
    disk_objects: Reports = []
    last: bool = True


class Leave(msgspec.Struct, tag=True):
    client_id: int
    token: bytes


class Heartbeat(msgspec.Struct, tag=True):
    client_id: int
    token: bytes
    journal_ack: int = 0
    moved: list[SegmentBytes] = []
    held: bool = False             # as ``Join.held``, sent at every beat until the hold is over (fence.py)
    fence: int = 0                 # the token the owner's fence is open to alone (0: held, or none)


class Alloc(msgspec.Struct, tag=True):
    client_id: int
    token: bytes
    keys: Keys
    sizes: list[int]
    replicas: int = 1
    preferred: list[int] = []


class Commit(msgspec.Struct, tag=True):
    client_id: int
    token: bytes
    keys: Keys
    generations: list[int]
    checksums: list[int] = []      # payload XXH3-64 per key (0: none computed); empty: none at all


class ArenaCommit(msgspec.Struct, tag=True):
    """Small puts in one round trip (``meta/arena.py``): objects the caller placed and wrote in its
    allocation arena ``arena`` (a range of its own segment it was granted), committed at once:
    ``offsets[i]`` is where the header of ``keys[i]`` (``sizes[i]`` payload bytes) starts. The
    MetaService issues their generations. ``refill``: retire the arena (its free part returns to the
    segment) and grant a new one in the reply; ``release``: retire it, grant none. No keys and
    ``refill``: the first grant. Answered by ``ArenaReply``."""

    client_id: int
    token: bytes
    arena: int
    keys: Keys
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    refill: bool = False
    release: bool = False


class Abort(msgspec.Struct, tag=True):
    client_id: int
    token: bytes
    keys: Keys
    generations: list[int]

class OwnerGone(msgspec.Struct, tag=True):
    """A member found the owner of a segment of its host dead (``memory.owner_alive``; meta/members.py)."""
    client_id: int
    token: bytes
    segment_id: int
    shm_path: str


class Lookup(msgspec.Struct, tag=True):
    keys: Keys
    lease: bool = True


class Exist(msgspec.Struct, tag=True):
    keys: Keys


class Validate(msgspec.Struct, tag=True):
    keys: Keys
    generations: list[int]


class Remove(msgspec.Struct, tag=True):
    keys: Keys


class RemoveAll(msgspec.Struct, tag=True):
    pass


class Confirmed(msgspec.Struct, tag=True):
    """Have the owners cleared the headers of what a remove took out of their segments? Each entry is
    a ``Codes.confirm`` triple (segment id, the segment's serial, journal seq); answered with ``Flags``,
    or an error when ``epoch`` (the ``Codes``') is not the MetaService's now (it restarted meanwhile)."""

    epoch: int
    journal: list[tuple[int, int, int]]


class RemovePrefix(msgspec.Struct, tag=True):
    """Remove every committed object whose key starts with ``prefix`` (one tenant's namespace)."""

    prefix: str


class Corrupt(msgspec.Struct, tag=True):
    """A reader found these objects' bytes do not match their checksums: count them, drop them (only
    the replica in ``segments[i]`` when the object has others; no ``segments``: the whole objects)."""

    client_id: int
    token: bytes
    keys: Keys
    generations: list[int]
    segments: list[int] = []


class DrainNext(msgspec.Struct, tag=True):
    """The owner of a draining segment asks for the next objects to copy out of it. Starts a drain of
    the caller's own segment when none runs (bounded by ``timeout_ms``; 0: the MetaService's
    ``drain_timeout_ms``)."""

    client_id: int
    token: bytes
    timeout_ms: int = 0


class DrainDone(Copied, tag=True):
    """The copies of ``DrainNext``'s moves."""


class RepairNext(msgspec.Struct, tag=True):
    """A holder of under-replicated objects asks for the copies it should make of them (answered by
    ``DrainBatch``: each move's ``new_generation`` is the object's own, as the copy is a replica)."""

    client_id: int
    token: bytes


class RepairDone(Copied, tag=True):
    """The copies of ``RepairNext``'s moves."""


class Info(msgspec.Struct, tag=True):
    """``batch_get_key_info``: the objects of these keys, committed or allocated by the caller and not
    finished yet (the GVA path's ``batch_alloc``); no lease is taken. Answered by ``InfoReply``."""

    client_id: int
    token: bytes
    keys: Keys


class Lease(msgspec.Struct, tag=True):
    """``batch_add_lease`` (``ttl_ms`` > 0) / ``batch_remove_lease`` (``ttl_ms`` 0): the caller's own
    lease on committed objects, which a copy out of them through a GVA needs. Answered by ``Codes``."""

    client_id: int
    token: bytes
    keys: Keys
    generations: list[int]
    ttl_ms: int = 0


class Grant(msgspec.Struct, tag=True):
    """Before a copy through GVAs: may the caller write (``write``) or read the payload bytes
    ``[starts[i], ends[i])`` of the object ``keys[i]`` of generation ``generations[i]`` at its replica in
    ``segments[i]``? Writes need an allocated, unfinished object of the caller's with time left before
    its pending deadline; reads a committed object the caller holds a lease on. Answered by ``Granted``."""

    client_id: int
    token: bytes
    keys: list[str]
    generations: list[int]
    segments: list[int]
    starts: list[int]
    ends: list[int]
    write: bool


class GetSegments(msgspec.Struct, tag=True):
    segment_ids: list[int] = []


class ConfigPut(msgspec.Struct, tag=True):
    key: str
    value: bytes


class ConfigGet(msgspec.Struct, tag=True):
    key: str


Request = (Join | Leave | Heartbeat | Alloc | Commit | ArenaCommit | Abort | OwnerGone | Lookup | Exist | Validate | Remove
           | RemoveAll | RemovePrefix | Confirmed | Corrupt | GetSegments | ConfigPut | ConfigGet | DrainNext | DrainDone
           | RepairNext | RepairDone | DiskSync | Promote | Promoted | Demote | Info | Lease | Grant | Report)

# ---- replies ----------------------------------------------------------------------------------

class _Reply(msgspec.Struct, tag=True, kw_only=True):
    """Every reply carries the term of the HA leader that sent it (0 without HA). Clients remember
    the highest term seen and refuse replies of an older one (a paused old leader). Decoders of
    either side ignore the field's absence or presence, so the wire stays compatible."""

    term: int = 0


class Error(_Reply):
    code: int
    message: str


class Ok(_Reply):
    pass


class Joined(_Reply):
    client_id: int                 # issued by the MetaService; also the id of the member's segment
    meta_epoch: int
    lease_ttl_ms: int
    pending_timeout_ms: int
    token: bytes = b""             # the member's token: requests acting as this member must carry it
    generation_ceiling: int = 0    # generations are issued at or below it (the member carries it)
    fence: int = 0                 # this join's fence token: the owner sets its segment's fence to it (fence.py)


class HeartbeatReply(_Reply):
    meta_epoch: int
    known: bool
    journal: list[JournalEntry] = []
    drain: bool = False            # the member's segment is being drained: it should copy its objects out
    repair: bool = False           # copies of objects in the member's segment are wanted elsewhere (RepairNext)
    disk_tiers: int = 0            # segments of the pool with a disk tier (none: no disk-held object to promote)
    generation_ceiling: int = 0    # generations are issued at or below it (the member carries it)
    served: list[int] = []         # [read, written]: bytes members moved out of / into the member's segment
                                   # through shared memory since its last heartbeat
    departures: int = 0            # members that left, died or re-joined so far: a change means re-read the segments
    rotate: int = 0                # rotate the segment's fence to this token (reclaimed grants: local/hold.py)


class DrainBatch(_Reply):
    moves: list[DrainMove]
    done: bool = False             # nothing is left to move, or the drain ended: stop asking
    left_ms: int = 0               # time left before the drain's deadline


class AllocReply(_Reply):
    results: list[AllocResult]


class ArenaReply(_Reply):
    """``ArenaCommit``'s answer: per key a code (0, ``OBJECT_ALREADY_EXISTS``, ``ARENA_VOID`` when the
    arena is not the caller's live one: put it the two-phase way, or another refusal) and the
    generation issued; and the arena the caller holds now (``arena`` 0: none; ``start`` is an offset in
    the caller's segment, ``size`` bytes long)."""

    codes: list[int]
    generations: list[int]
    arena: int = 0
    start: int = 0
    size: int = 0


class LookupReply(_Reply):
    results: list[Found | None]
    lease_ttl_ms: int = 0


class InfoReply(_Reply):
    results: list[Found | None]
    pending: list[bool]            # allocated by the caller, not finished yet (its bytes are being written)
    fences: list[list[int]] = []   # per pending result: its locations' fence tokens (as ``AllocResult.fences``)


class Granted(_Reply):
    codes: list[int]               # per range: 0, or why the copy may not run
    left_ms: list[int]             # per granted range: time left on the caller's lease / pending deadline


class Codes(_Reply):
    codes: list[int]
    # removes: (segment id, its serial, journal seq) per segment whose owner must clear headers; the
    # remover waits until they have (``Confirmed``) so that a crash cannot bring the objects back
    confirm: list[tuple[int, int, int]] = []
    epoch: int = 0                 # removes: the MetaService's epoch (``Confirmed`` carries it)


class Flags(_Reply):
    flags: list[bool]


class Segments(_Reply):
    segments: list[SegmentInfo]


class Value(_Reply):
    value: bytes | None


class DiskWork(_Reply):
    """What a provider's disk tier should do: copy these objects of its segment to disk (``offload``,
    ``offset`` is the object's place in the segment), delete these records (``drop``: objects that
    left the pool; compare-and-delete on the generation), and bring these back into DRAM (``promote``)."""

    offload: list[ObjectReport] = []
    drop: list[ObjectReport] = []
    promote: list[ObjectReport] = []   # records to bring back into the provider's DRAM (admin /memory/prefetch)


Reply = (Error | Ok | Joined | HeartbeatReply | AllocReply | ArenaReply | LookupReply | Codes | Flags | Segments
         | Value | DrainBatch | DiskWork | InfoReply | Granted)

request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
