"""NIXL descriptors announced by members are checked (size, structure, the agent they name, the region)
before a reader's NIXL agent parses them: before, any member's bytes went straight into
``add_remote_agent``'s native deserializer."""

from __future__ import annotations

import os
import secrets

import msgspec
import pytest

from memcache_core.errors import PeerUnavailable
from memcache_core.protocol import SegmentInfo
from memcache_core.transfer import nixl_descriptor

nixl = pytest.importorskip("memcache_core.transfer.nixl")
if not nixl.available():
    pytest.skip("the nixl package is not installed", allow_module_level=True)

SIZE = 1 << 24


def _seg(desc: bytes) -> SegmentInfo:
    return SegmentInfo(7, SIZE, "peer", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(6)}", "127.0.0.1:9",
                       nixl=desc)


def _desc(agent: str, metadata: bytes, base: int = 1 << 30, size: int = SIZE) -> bytes:
    return msgspec.msgpack.encode(nixl_descriptor.Descriptor(agent, metadata, base, size))


def test_a_members_nixl_descriptor_is_checked_before_the_native_parser():
    """Scenario: an insider announces a segment whose NIXL descriptor is garbage, oversized, claims
    another agent's metadata, a name length the bytes do not hold, or a region that is not its
    segment's. A reader refuses each with PeerUnavailable naming what is wrong, loading nothing into
    its agent; a real peer agent's descriptor is loaded (positive control)."""
    reader = nixl.NixlTransport(None, 5.0)
    peer_name = f"peer-{secrets.token_hex(4)}"
    peer = nixl.make_agent(peer_name, progress=False)
    md = peer.get_agent_metadata()
    bad = {
        "garbage": (_desc(peer_name, b"\xff" * 600), "is not NIXL agent"),
        "oversized": (_desc(peer_name, md + b"\0" * (64 << 10)), "is not NIXL agent"),
        "another agent's": (_desc("someone-else", md), "is not NIXL agent"),
        "a huge name length": (_desc(peer_name, nixl_descriptor.SERDES + (1 << 62).to_bytes(8, "little") + b"x"),
                               "is not NIXL agent"),
        "a region not the segment's": (_desc(peer_name, md, size=SIZE * 2), "is not the segment's"),
        "an unprintable name": (_desc("a\nb", md), "not printable"),
        "not msgpack": (b"\x93\x01", "unreadable"),
        "the reader's own agent": (_desc(reader.name, md), "is not NIXL agent"),
    }
    try:
        for case, (desc, want) in bad.items():
            with pytest.raises(PeerUnavailable, match=want):
                reader._pin(_seg(desc))
            assert not reader._peers, case
        good = reader._pin(_seg(_desc(peer_name, md)))
        assert good.name == peer_name
    finally:
        reader.close()
