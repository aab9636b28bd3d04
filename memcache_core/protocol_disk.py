"""The disk tier's control-plane requests (docs/design.md, "Disk tier"): a provider's sync of its
records, promotions back into DRAM and demotions. Part of ``protocol.Request`` and read through
``protocol`` (``p.DiskSync``); answered by ``protocol.DiskWork``, ``AllocReply`` and ``Codes``."""

from __future__ import annotations

import msgspec

from .records import Keys, ObjectReport


class DiskSync(msgspec.Struct, tag=True):
    """A provider with a disk tier: records written (``added``) and dropped since its last sync, its
    tier's state, and how many bytes its writer queue takes now (``room``). Answered by ``DiskWork``."""

    client_id: int
    token: bytes
    policy: str
    capacity: int
    used: int
    room: int
    added: list[ObjectReport] = []
    dropped: list[ObjectReport] = []
    counters: dict[str, int] = {}


class Promote(msgspec.Struct, tag=True):
    """The owner of disk records asks for space in its own segment to bring these objects back into
    DRAM (answered like ``Alloc``), then reports the copies with ``Promoted``."""

    client_id: int
    token: bytes
    keys: list[str]


class Promoted(msgspec.Struct, tag=True):
    client_id: int
    token: bytes
    keys: list[str]
    offsets: list[int]
    ok: list[bool]


class Demote(msgspec.Struct, tag=True):
    """The tier call ``evict``: keep these objects on their disk tier only (answered with ``Codes``)."""

    keys: Keys
