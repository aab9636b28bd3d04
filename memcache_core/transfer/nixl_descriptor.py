"""A segment's NIXL descriptor (``nixl.py``): the owner's agent name, its metadata and the region,
carried in ``SegmentInfo.nixl``; ``checked`` holds a peer's descriptor to its size and structure
before NIXL's native parser sees any of it."""

from __future__ import annotations

import msgspec

from ..errors import PeerUnavailable
from ..records import SegmentInfo


class Descriptor(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs to reach a segment through NIXL: the owner's agent and the region."""

    agent: str
    metadata: bytes
    base: int
    size: int


descriptor_decoder = msgspec.msgpack.Decoder(Descriptor)
MAX_METADATA = 64 << 10        # an agent's metadata is about 0.5 KiB (meta/validate.py MAX_NIXL_BYTES)
SERDES = b"nixlSerDes|Agent"  # NIXL's serialized metadata: this tag, the agent name's length (u64 LE), the name
AGENT_NAME = 256


def checked(seg: SegmentInfo) -> Descriptor:
    """A member's NIXL descriptor, its size and structure checked before the native parser sees any of it:
    at most MAX_METADATA bytes of metadata in NIXL's serialized form, naming the agent the descriptor
    names (a printable name of at most AGENT_NAME bytes), and the region of the announced segment."""
    where = f"segment {seg.segment_id}: NIXL descriptor"
    if not seg.nixl or len(seg.nixl) > MAX_METADATA + 1024:
        raise PeerUnavailable(f"{where}: {len(seg.nixl)} bytes")
    try:
        d = descriptor_decoder.decode(seg.nixl)
    except msgspec.DecodeError as e:
        raise PeerUnavailable(f"{where}: unreadable ({e})") from e
    name = d.agent.encode()
    if not 0 < len(name) <= AGENT_NAME or not d.agent.isprintable():
        raise PeerUnavailable(f"{where}: agent name {d.agent[:64]!r} is empty, too long or not printable")
    n = len(SERDES)
    m = d.metadata
    if (len(m) > MAX_METADATA or not m.startswith(SERDES) or len(m) < n + 8
            or int.from_bytes(m[n:n + 8], "little") != len(name) or m[n + 8:n + 8 + len(name)] != name):
        raise PeerUnavailable(f"{where}: the metadata is not NIXL agent {d.agent!r}'s ({len(m)} bytes)")
    if d.size != seg.size or not 0 < d.base < (1 << 64) - d.size:
        raise PeerUnavailable(f"{where}: region [{d.base:#x}, +{d.size}) is not the segment's ({seg.size} bytes)")
    return d
