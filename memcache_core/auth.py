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

The secret is a file (``auth_secret_path``, or ``MEMCACHE_SECRET_PATH``, or
``~/.config/memcache/pool-<pool_name>.secret``, or ``~/.config/memcache/pool.secret`` for a pool
without a ``pool_name``). A MetaService creates the default file (0600, 32 random bytes)
when it is missing, so a single-host pool is authenticated with no configuration at all; for a pool
across hosts, copy the file to each host (docs/security.md). ``auth_enable: false`` turns all of this
off, for a single trusted host only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import stat
import time

from .errors import ConfigError, MemCacheError

logger = logging.getLogger(__name__)

MAGIC = b"MCA1"
NONCE = 32
BUSY = b"MCA0"   # what a server out of connection slots sends for its challenge, then it closes
HANDSHAKE_TIMEOUT_S = 5.0
SECRET_ENV = "MEMCACHE_SECRET_PATH"
MIN_SECRET_BITS = 256    # 32 random bytes' worth


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


def refuse_busy(conn: socket.socket, tls: bool) -> None:
    """Close a connection refused for want of slots, first saying so (``BUSY`` for the challenge; not
    over TLS, whose handshake comes first): a client tells it from a server stopping or restarting."""
    try:
        if not tls:
            conn.setblocking(False)
            conn.send(BUSY)   # 4 bytes into an empty send buffer: never blocks
    except OSError:
        pass
    conn.close()


def default_secret_path(pool_name: str = "") -> str:
    """$MEMCACHE_SECRET_PATH, else the user's file of the pool named ``pool_name`` (``pool_name``
    setting), else the user's one file for unnamed pools (shared by every unnamed pool of the user)."""
    name = f"pool-{pool_name}.secret" if pool_name else "pool.secret"
    return os.environ.get(SECRET_ENV) or os.path.join(os.path.expanduser("~"), ".config", "memcache", name)


def load_secret(path: str, create: bool = False, pool_name: str = "") -> bytes:
    """Read the pool secret (``path``, else ``default_secret_path(pool_name)``); with ``create`` make
    it (0600, random) when the file does not exist.

    Refused (ConfigError naming the file and the remedy): a symlink another user could have made, not a
    regular file, owned by another user (root's is fine: a Kubernetes Secret mount), readable or
    writable by others, readable by a group this process is not in, writable by its group, or under 32
    random bytes' worth."""
    path = path or default_secret_path(pool_name)
    if create and not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass   # another MetaService made it first
        else:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(secrets.token_hex(32) + "\n")
            logger.info("created the pool secret %s (copy it to every host of the pool)", path)
    try:
        fd = os.open(_trusted_link_target(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"auth_secret_path: cannot read the pool secret {path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"auth_secret_path: {path} is not a regular file")
        raw = f.read(4096).strip()
    _check_secret_file(path, st)
    bits = secret_bits(raw)
    if bits < MIN_SECRET_BITS:
        raise ConfigError(f"auth_secret_path: {path} holds about {bits // 8} random bytes' worth (a short or "
                          f"repeated secret); a pool secret needs at least {MIN_SECRET_BITS // 8}. Make one with "
                          f"`head -c 32 /dev/urandom | base64 > {path}` or "
                          f"`python -c 'import secrets; print(secrets.token_hex(32))' > {path}`, "
                          f"then chmod 600 it and copy it to every host of the pool")
    return raw


def _trusted_link_target(path: str, hops: int = 8) -> str:
    """``path``, or where the symbolic links it names lead when each link is this user's or root's in a
    directory only they can change (a sticky one counts: a Kubernetes Secret volume is root's links,
    ``pool.secret -> ..data/pool.secret``). A link another user could have made is refused."""
    for _ in range(hops):
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            return path
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
        if st.st_uid not in (os.geteuid(), 0) or (parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX):
            raise ConfigError(f"auth_secret_path: {path} is a symbolic link another user could have made "
                              f"(owned by uid {st.st_uid}, or in a directory others can change); point "
                              f"auth_secret_path at the file itself")
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    raise ConfigError(f"auth_secret_path: {path}: more than {hops} symbolic links")


def _check_secret_file(path: str, st: os.stat_result) -> None:
    """Owned by this user (or root), read by nobody else but a group of this process (Kubernetes mounts a
    Secret root-owned, mode 0440, with the pod's fsGroup: examples/k8s/), written by nobody else."""
    mode = st.st_mode & 0o777
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"auth_secret_path: {path} is owned by uid {st.st_uid}, not by this user "
                          f"({os.geteuid()}) or root: another user could have planted it. Use a file of your own")
    if mode & 0o007 or mode & 0o020 or (mode & 0o040 and st.st_gid not in (os.getegid(), *os.getgroups())):
        raise ConfigError(f"auth_secret_path: {path} can be read or changed by other users (mode {mode:o}); "
                          f"chmod 600 it (0440 with a group of this process is allowed)")


def secret_bits(raw: bytes) -> int:
    """A conservative estimate of a secret's random bits: the characters of its shortest repeating
    unit (``abcabc...`` counts as ``abc``) times the bits a character of its alphabet can carry (hex 4,
    base64 6, printable text 6.5, anything else 8; less for fewer than 8 distinct characters)."""
    body = raw.rstrip(b"=")
    if not body:
        return 0
    prefix = [0] * len(body)   # KMP: the shortest period of the string
    k = 0
    for i in range(1, len(body)):
        while k and body[i] != body[k]:
            k = prefix[k - 1]
        if body[i] == body[k]:
            k += 1
        prefix[i] = k
    period = len(body) - prefix[-1]
    if period > len(body) // 2:   # no unit repeated twice (random text ends like it starts by chance)
        period = len(body)
    chars = set(body)
    if chars <= _HEX:
        per_char = 4.0
    elif chars <= _BASE64:
        per_char = 6.0
    elif all(32 < c < 127 for c in chars):
        per_char = 6.5
    else:
        per_char = 8.0
    if len(chars) < 8:   # a few symbols however written ('0101...', 'abab...'): what they can carry
        per_char = min(per_char, math.log2(len(chars)) if len(chars) > 1 else 0.0)
    return int(period * per_char)


_HEX = frozenset(b"0123456789abcdefABCDEF")
_BASE64 = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")


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


class _NoSession(Session):
    """Authentication off (``auth_enable: false``): frames carry no MAC."""

    size = 0

    def __init__(self) -> None:
        pass

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytes:
        return b""

    def check(self, tag: bytes | bytearray | memoryview, *parts: bytes | bytearray | memoryview) -> bool:
        return True


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
        hello = _recv_hello(sock, timeout_s)
        if hello[:len(MAGIC)] != MAGIC:
            raise AuthMismatch("the server does not speak the authenticated protocol (auth_enable differs?)")
        nonce_s, nonce_c = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
        try:
            proof = recv_exact(sock, 32)
        except ConnectionError as e:
            raise AuthMismatch("the server closed the connection on our proof of the pool secret: the secret "
                               "here is not the pool's (wrong pool secret)") from e
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_s, nonce_c)):
            raise AuthMismatch("the server did not prove it holds the pool secret (wrong pool secret)")
        return Session(secret, nonce_s, nonce_c, client=True)
    finally:
        sock.settimeout(old)


def _recv_hello(sock: socket.socket, timeout_s: float) -> bytes:
    """The server's challenge; a refusal (``BUSY``), a close before it or silence, each named."""
    buf, gone = bytearray(), "the server closed the connection before its authentication challenge"
    try:
        while len(buf) < len(MAGIC) + NONCE and (chunk := sock.recv(len(MAGIC) + NONCE - len(buf))):
            buf += chunk
    except TimeoutError as e:
        raise AuthFailed(f"no authentication challenge from the server within {timeout_s:g}s: it runs with "
                         f"auth_enable: false? Set auth_enable (and auth_secret_path) alike on the MetaService "
                         f"and every member (docs/security.md)") from e
    except ConnectionError as e:
        raise ConnectionResetError(f"{gone}: it is stopping or restarting ({e})") from e
    if bytes(buf) == BUSY:
        raise AuthFailed("the server refused the connection: it is out of connection slots, or this address "
                         "has too many connections open (its log says which); not a secret mismatch")
    if len(buf) < len(MAGIC) + NONCE:
        raise ConnectionResetError(f"{gone}: it is stopping or restarting")
    return bytes(buf)


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
            return None
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(reply)
        return hs.session
    except (OSError, ConnectionError):
        return None
    finally:
        sock.settimeout(old)
