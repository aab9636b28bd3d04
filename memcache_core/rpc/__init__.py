"""Control plane over plain TCP: length-prefixed msgspec frames over authenticated connections.

Frame: ``u32 length | u64 request id | msgpack payload | MAC``, the MAC (16 bytes, keyed by the
connection's session, ``auth.Session``) binding every frame to the connection that authenticated. The MetaService answers every request on
the connection it came from, in order, with the same id. Each connection first passes the pool's
HMAC handshake (``auth.py``); a client keeps a small pool of connections (at most
``MAX_CLIENT_CONNECTIONS``), not one per thread forever. (ZeroMQ was measured first: its I/O thread
hop cost ~110 µs per round trip on a loaded 2-core host against ~20 µs for a plain socket, and an
existence probe has to stay well under 60 µs.)

A MetaService that is down costs a clear error quickly, never a hang: every call waits at most
``timeout_s``; once a call or the heartbeat has seen the MetaService fail, later calls fail at once
with ``MetaServiceUnavailable`` (one call in ``RETRY_DOWN_S`` tries the MetaService again) until an
exchange gets through again, and calls already waiting are woken by that too. Only idempotent calls (lookup, exist) are retried, within ``retry_ms``.

HA: the URL may name several MetaServices or the leader key in etcd (``endpoints.py``). A call that
reached no MetaService, or one that answered "not the leader", moves on to the next at once (the
request was not executed). Every reply carries the leader's term; the client keeps the highest seen
and refuses a reply of an older term, so a paused old leader that wakes up is never believed.

Modules: ``framing.py`` (the frame, a leaf), ``client.py`` (``RpcClient``), ``server.py`` (``FrameServer``);
every name stays importable from ``memcache_core.rpc``.
"""

from __future__ import annotations

from .client import (
    MAX_CLIENT_CONNECTIONS,
    RETRY_DOWN_S,
    SMALL_FRAME,
    Backoff,
    RpcClient,
    expect,
)
from .framing import FRAME_HEAD, MAX_FRAME, is_addr_in_use, seal_frame, take_frame
from .server import (
    MAX_BUFFERED_INPUT,
    MAX_PENDING_REPLIES,
    MAX_PENDING_REPLY,
    MAX_PREAUTH_PER_SOURCE,
    PREAUTH_TIMEOUT_S,
    FrameServer,
)

__all__ = [
    "FRAME_HEAD", "MAX_BUFFERED_INPUT", "MAX_CLIENT_CONNECTIONS", "MAX_FRAME", "MAX_PENDING_REPLIES", "MAX_PENDING_REPLY",
    "MAX_PREAUTH_PER_SOURCE",
    "PREAUTH_TIMEOUT_S", "RETRY_DOWN_S", "SMALL_FRAME", "Backoff", "FrameServer", "RpcClient", "expect",
    "is_addr_in_use", "seal_frame", "take_frame",
]
