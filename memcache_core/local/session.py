"""What the LocalService's parts share, a leaf of ``local/``: the ``Session`` one Join established, the
``Pieces`` an object is laid across and ``clip``, and ``Member``, what a helper (the drainer, the disk
tier) needs of the LocalService that owns it. A helper is given its owner as a ``Member`` and never
imports ``service.py``, which imports it."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Callable
from operator import itemgetter
from typing import Protocol

from .. import protocol as p
from ..config import LocalConfig
from ..memory import Mapping
from ..transfer import TransferEngine

Pieces = list[tuple[int, int]]   # (address, length) of the buffers an object is laid across, end to end


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    """What one Join established; replaced as a whole on a re-join."""

    client_id: int
    epoch: int
    lease_ttl_s: float
    pending_timeout_s: float
    segment: p.SegmentInfo | None
    token: bytes = b""


class Member(Protocol):
    """The LocalService as its helpers see it (``membership.Membership`` declares the same)."""

    config: LocalConfig
    host_id: str
    secret: bytes | None
    session: Session
    segment: Mapping | None
    engine: TransferEngine | None
    tls_client: ssl.SSLContext | None

    @property
    def client_id(self) -> int: ...
    def member_call(self, make: Callable[[Session], p.Request]) -> p.Reply: ...
    def member_call_in(self, make: Callable[[Session], p.Request]) -> tuple[p.Reply, Session]: ...
    def segment_info(self, sid: int) -> p.SegmentInfo: ...


def clip(pieces: Pieces, size: int) -> Pieces:
    """The pieces cut to ``size`` bytes in total (for reads into buffers larger than the object)."""
    if sum(map(itemgetter(1), pieces)) <= size:
        return pieces
    out, left = [], size
    for ptr, s in pieces:
        if left <= 0:
            break
        out.append((ptr, min(s, left)))
        left -= s
    return out

