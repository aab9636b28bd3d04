"""What a FrameServer holds per connection (``Peer``), and the bounds on it (rpc/server.py's
docstring says what each bounds and why)."""

from __future__ import annotations

import dataclasses

from ..auth import NO_SESSION, ServerHandshake, Session

MAX_PENDING_REPLY = 64 << 20     # reply bytes a server buffers for a connection that does not read
MAX_PENDING_REPLIES = 256 << 20  # ... and for all connections together (16 peers x 63 MiB grew a
                                 # MetaService by 1 GB before)
MAX_BUFFERED_INPUT = 512 << 20   # bytes of unfinished frames a server holds for all connections together
PREAUTH_TIMEOUT_S = 5.0          # a deadline for the whole handshake (TLS and the pool's), from accept
MAX_PREAUTH_PER_SOURCE = 64      # connections of one source address still in their handshake
PREAUTH_SHARE = 4                # at most 1/4 of max_connections in their handshake: the rest is kept
                                 # for authenticated members
MAX_PER_SOURCE = 512             # connections of one source address open at once, authenticated or not


@dataclasses.dataclass(slots=True, eq=False)
class Peer:
    """A server-side connection: its handshake (until done), input, unsent output, last activity."""

    handshake: ServerHandshake | None
    last: float
    source: str                 # the peer's address, counted in ``FrameServer._preauth`` until authenticated
    opened: float = 0.0         # the handshake must be done by ``opened + PREAUTH_TIMEOUT_S``
    authenticated: bool = False
    session: Session = NO_SESSION
    tls_pending: bool = False
    inbuf: bytearray = dataclasses.field(default_factory=bytearray)
    out: bytearray | None = None
