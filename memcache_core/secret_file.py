"""The pool secret's file: where it is by default, how it is made, and what is refused.

The secret is a file (``auth_secret_path``, or ``MEMCACHE_SECRET_PATH``, or
``~/.config/memcache/pool-<pool_name>.secret``, or ``~/.config/memcache/pool.secret`` for a pool
without a ``pool_name``). A MetaService creates the default file (0600, 32 random bytes)
when it is missing, so a single-host pool is authenticated with no configuration at all; for a pool
across hosts, copy the file to each host (docs/security.md). ``auth.py`` uses it.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import stat

from .errors import ConfigError

logger = logging.getLogger(__name__)

SECRET_ENV = "MEMCACHE_SECRET_PATH"
MIN_SECRET_BITS = 256    # 32 random bytes' worth


def secret_folder() -> str:
    """The folder of the user's default secret files: ``pool.secret`` and ``pool-<pool_name>.secret``."""
    return os.path.join(os.path.expanduser("~"), ".config", "memcache")


def pool_secret_file(pool_name: str = "") -> str:
    """The user's default secret file of the pool named ``pool_name`` ("": of the unnamed pools)."""
    return os.path.join(secret_folder(), f"pool-{pool_name}.secret" if pool_name else "pool.secret")


def default_secret_path(pool_name: str = "") -> str:
    """$MEMCACHE_SECRET_PATH, else the user's file of the pool named ``pool_name`` (``pool_name``
    setting), else the user's one file for unnamed pools (shared by every unnamed pool of the user)."""
    return os.environ.get(SECRET_ENV) or pool_secret_file(pool_name)


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
