"""Pool authentication: one secret per pool, a challenge-response on every connection.

Every TCP plane (control, config store, data) starts with a mutual HMAC-SHA256 handshake before a
single request byte is decoded or a buffer sized by the peer is allocated:

```
server -> client   "MCA1" | nonce_s (32)
client -> server   nonce_c (32) | HMAC(secret, "client" | nonce_s | nonce_c)
server -> client   HMAC(secret, "server" | nonce_s | nonce_c)
```

Every frame after it carries a MAC keyed by the session (``Session``): keys derived from the secret
and both nonces, one per direction, over a per-direction sequence number and the frame's bytes. A
relay that forwards the handshake between a member and the real server holds no session key, so any
frame it injects, replays, reorders or alters is refused and the connection dropped.

The secret never crosses the wire; a peer without it learns nothing but a random nonce, and a client
also proves the server knows the secret (no fake MetaService or data server). The admin HTTP server
takes ``Authorization: Bearer <admin_token(secret)>`` on every route but ``/health``.

The secret is a file (``secret_file.py``: ``auth_secret_path``, or ``MEMCACHE_SECRET_PATH``, or
``~/.config/memcache/pool-<pool_name>.secret``, or ``~/.config/memcache/pool.secret`` for a pool
without a ``pool_name``). ``auth_enable: false`` turns all of this off, for a single trusted host only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import socket
import time

from .errors import MemCacheError
from .secret_file import SECRET_ENV as SECRET_ENV
from .secret_file import default_secret_path as default_secret_path
from .secret_file import load_secret as load_secret

MAGIC = b"MCA1"
NONCE = 32
BUSY = b"MCA0"     # sent for the challenge (or the proof) by a server that must close for want of slots
DENIED = b"MCA!"   # sent for the server's proof when the client's proof is wrong, then the server closes
HANDSHAKE_TIMEOUT_S = 5.0


class AuthFailed(MemCacheError):
    """The peer did not prove it holds the pool secret (or we could not)."""


class AuthMismatch(AuthFailed):
    """This side and the server do not share the pool's authentication: a different pool secret, or
    ``auth_enable`` set differently. Permanent: trying again cannot mend it (``is_auth_mismatch``)."""


def is_auth_mismatch(exc: BaseException | None) -> bool:
    """Whether ``exc`` or a cause of it is an ``AuthMismatch`` (the control-plane client reports a
    failed connection as ``MetaServiceUnavailable`` from its cause)."""
    while exc is not None and not isinstance(exc, AuthMismatch) and exc.__cause__ is not exc:
        exc = exc.__cause__
    return isinstance(exc, AuthMismatch)


def tell(conn: socket.socket, word: bytes) -> None:
    """Send ``word`` (``BUSY``, ``DENIED``) before closing ``conn``, best effort (4 bytes into a send
    buffer holding at most the challenge: never blocks): the client can tell why it was closed from
    a server that closed saying nothing because it was stopping or restarting."""
    try:
        conn.send(word)
    except (OSError, ValueError):   # (a TLS socket not ready to send: the client sees a plain close)
        pass


def refuse_busy(conn: socket.socket, tls: bool) -> None:
    """Close a connection refused for want of slots, saying so (``BUSY``; not over TLS, whose
    handshake comes first)."""
    if not tls:
        conn.setblocking(False)
        tell(conn, BUSY)
    conn.close()


def _mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, role + nonce_s + nonce_c, hashlib.sha256).digest()


TAG = 16   # bytes of MAC after every frame of an authenticated connection


class Session:
    """The frame MACs of one authenticated connection, keyed from its handshake.

    Keyed BLAKE2b (a MAC by construction, ~1 us a frame in CPython where HMAC-SHA256 costs ~2 us;
    docs/security.md has the measurements), 16 bytes, over ``sequence number (u64) | frame``, with one
    key and one counter per direction: a frame injected by a relay, replayed, reordered, cut or
    altered fails. Used by one thread at a time (a connection is)."""

    size = TAG

    def __init__(self, secret: bytes, nonce_s: bytes, nonce_c: bytes, client: bool) -> None:
        c2s = _mac(secret, b"session client->server", nonce_s, nonce_c)
        s2c = _mac(secret, b"session server->client", nonce_s, nonce_c)
        send, recv = (c2s, s2c) if client else (s2c, c2s)
        self._keys = (send, recv)
        self._send = hashlib.blake2b(key=send, digest_size=TAG)
        self._recv = hashlib.blake2b(key=recv, digest_size=TAG)
        self._sent = 0
        self._received = 0

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytes:
        """The MAC of the next frame sent, made of ``parts``."""
        h = self._send.copy()
        h.update(self._sent.to_bytes(8, "little"))
        for part in parts:
            h.update(part)
        self._sent += 1
        return h.digest()

    def check(self, tag: bytes | bytearray | memoryview, *parts: bytes | bytearray | memoryview) -> bool:
        """Whether ``tag`` is the MAC of the next frame received, made of ``parts``."""
        h = self._recv.copy()
        h.update(self._received.to_bytes(8, "little"))
        for part in parts:
            h.update(part)
        self._received += 1
        return hmac.compare_digest(h.digest(), tag)

    def native_state(self) -> tuple[bytes, bytes, int, int]:
        """(send key, receive key, frames sent, frames received): what a native loop needs to go on
        with this session (``transfer/dataloop.py``); it gives the counters back with ``resume``."""
        return self._keys[0], self._keys[1], self._sent, self._received

    def resume(self, sent: int, received: int) -> None:
        """Take back the counters after a native loop sealed and checked frames of this session."""
        self._sent, self._received = sent, received


class _NoSession(Session):
    """Authentication off (``auth_enable: false``): frames carry no MAC."""

    size = 0

    def __init__(self) -> None:
        pass

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytes:
        return b""

    def check(self, tag: bytes | bytearray | memoryview, *parts: bytes | bytearray | memoryview) -> bool:
        return True

    def native_state(self) -> tuple[bytes, bytes, int, int]:
        return b"", b"", 0, 0

    def resume(self, sent: int, received: int) -> None:
        pass


NO_SESSION: Session = _NoSession()


def disk_record_key(secret: bytes) -> bytes:
    """The key of the MAC that binds a disk tier's records to the pool (``local/disk_record.py``)."""
    return hmac.new(secret, b"disk tier records", hashlib.sha256).digest()


def admin_token(secret: bytes) -> str:
    return hmac.new(secret, b"admin", hashlib.sha256).hexdigest()


def admin_authorized(authorization: str, token: str | None, basic: bool = True) -> bool:
    """An HTTP ``Authorization`` header carries the admin token: ``Bearer <token>``, or, with
    ``basic``, the token as the password of HTTP Basic (what a browser can send). Always true when
    auth is off (no token).

    Basic is for reading pages only: a browser caches it and sends it with any request to the host,
    a form another site submits included (CSRF). A state change takes the Bearer header, which no
    other origin can make a browser send (no CORS is ever granted)."""
    if token is None:
        return True
    if authorization.startswith("Basic "):
        if not basic:
            return False
        try:
            authorization = "Bearer " + base64.b64decode(authorization[6:], validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
    return hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if not (chunk := sock.recv(n - len(buf))):
            raise ConnectionError("peer closed the connection during authentication")
        buf += chunk
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes | None, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Session:
    """Authenticate to a server on a blocking socket: its ``Session`` (``NO_SESSION`` with auth off). Raises
    AuthFailed (AuthMismatch: the secrets or auth_enable differ) or OSError (closed: it is restarting)."""
    if secret is None:
        return NO_SESSION
    old = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        try:
            hello = _recv_upto(sock, len(MAGIC) + NONCE, "its authentication challenge")
        except TimeoutError as e:
            raise AuthFailed(f"no authentication challenge from the server within {timeout_s:g}s: it runs with "
                             f"auth_enable: false? Set auth_enable (and auth_secret_path) alike on the MetaService "
                             f"and every member (docs/security.md)") from e
        if hello[:len(MAGIC)] != MAGIC:
            raise AuthMismatch("the server does not speak the authenticated protocol (auth_enable differs?)")
        nonce_s, nonce_c = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
        proof = _recv_upto(sock, 32, "its proof of the pool secret")
        if proof == DENIED:
            raise AuthMismatch("the server refused our proof of the pool secret: the secret here is not the "
                               "pool's (wrong pool secret)")
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_s, nonce_c)):
            raise AuthMismatch("the server did not prove it holds the pool secret (wrong pool secret)")
        return Session(secret, nonce_s, nonce_c, client=True)
    finally:
        sock.settimeout(old)


def _recv_upto(sock: socket.socket, n: int, what: str) -> bytes:
    """``n`` bytes of the server's handshake: a close before them is named, ``BUSY`` (out of slots)
    from a close without a word (stopping or restarting, which a caller waits out); ``DENIED`` is
    returned for the caller to read."""
    buf = bytearray()
    try:
        while len(buf) < n and (chunk := sock.recv(n - len(buf))):
            buf += chunk
    except ConnectionError as e:
        raise ConnectionResetError(f"the server reset the connection before {what}: it is stopping or "
                                   f"restarting ({e})") from e
    if len(buf) == n or bytes(buf) == DENIED:
        return bytes(buf)
    if bytes(buf) == BUSY:
        raise AuthFailed(f"the server closed the connection before {what}, for want of slots: it is out of "
                         f"connection slots, or this address has too many connections open or in their "
                         f"handshake (its log says which); not a secret mismatch")
    raise ConnectionResetError(f"the server closed the connection before {what}: it is stopping or restarting")


class ServerHandshake:
    """The server side, incremental, for non-blocking servers: feed bytes, read ``done``/``failed``."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.nonce_s = secrets.token_bytes(NONCE)
        self.hello = MAGIC + self.nonce_s
        self.buf = bytearray()
        self.done = False
        self.failed = False
        self.session: Session = NO_SESSION   # the connection's MACs, once done

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """Bytes received -> (bytes to send back, bytes left over after the handshake)."""
        self.buf += data
        need = NONCE + 32
        if len(self.buf) < need:
            return b"", b""
        nonce_c, mac = bytes(self.buf[:NONCE]), bytes(self.buf[NONCE:need])
        rest = bytes(self.buf[need:])
        self.buf.clear()
        if not hmac.compare_digest(mac, _mac(self.secret, b"client", self.nonce_s, nonce_c)):
            self.failed = True
            return b"", b""
        self.done = True
        self.session = Session(self.secret, self.nonce_s, nonce_c, client=False)
        return _mac(self.secret, b"server", self.nonce_s, nonce_c), rest


def server_handshake(sock: socket.socket, secret: bytes | None, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Session | None:
    """Authenticate a client on a blocking socket: the connection's ``Session`` (``NO_SESSION`` with
    auth off), or None (and nothing else read) if it fails. ``timeout_s`` bounds the whole
    handshake, however slowly the peer trickles its bytes."""
    if secret is None:
        return NO_SESSION
    hs = ServerHandshake(secret)
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    try:
        sock.sendall(hs.hello)
        buf = bytearray()
        while len(buf) < NONCE + 32:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            chunk = sock.recv(NONCE + 32 - len(buf))
            if not chunk:
                return None
            buf += chunk
        reply, _ = hs.feed(bytes(buf))
        if hs.failed:
            tell(sock, DENIED)
            return None
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(reply)
        return hs.session
    except (OSError, ConnectionError):
        return None
    finally:
        sock.settimeout(old)
