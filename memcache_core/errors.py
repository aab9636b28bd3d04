"""One exception hierarchy for the whole core, each class carrying its stable MemCache return code.

The rule: a call that fails as a whole raises (bad arguments, an unreachable MetaService, a dead
peer). The outcome of one key inside a batch is a value, because a batch partly succeeds: on the
wire a per-key code (``Codes``, ``AllocResult.code``: the MetaService's table returns them so that
one refused key does not fail its neighbours), inside ``LocalService`` a ``MemCacheError`` or
``None`` per key. The memcache_hybrid-compatible API (``DistributedObjectStore``) turns both into
integer codes at its boundary; nothing above it sees an exception.
"""

from __future__ import annotations

import errno

SUCCESS = 0
ERROR = -1
INVALID_PARAM = -3000
MALLOC_FAILED = -3001
OBJECT_CREATE_FAILED = -3002
SERVICE_NOT_STARTED = -3003
TIMEOUT = -3004
REPEATED_CALL = -3005
OBJECT_ALREADY_EXISTS = -3006
OBJECT_NOT_EXISTS = -3007
NOT_INITIALIZED = -3008
OVER_CAPACITY = -3013
CONNECTION_NOT_FOUND = -3014
OUT_OF_MEMORY = -3016
META_NOT_CONNECTED = -3017
LOCAL_NOT_CONNECTED = -3018
CLIENT_NOT_INITIALIZED = -3019
STATE_MISMATCH = -3101
WRITE_IN_PROGRESS = -3102      # project code: another writer's put of the key is not committed yet
CHECKSUM_MISMATCH = -3110      # project code: the bytes read do not match the object's checksum
DISK_IO_ERROR = -3111          # project code: the disk tier could not read or write a record (I/O error, disk full)
QUOTA_EXCEEDED = -3112         # project code: a member is at a MetaService quota (member_max_*, max_members)
ARENA_VOID = -3113             # project code: a small-put commit names an arena that is not the writer's live one
                               # (retired, or granted by an earlier MetaService life or term): put it two-phase
NOT_LEADER = -3120             # project code: this MetaService is a standby (HA), or answered with an old term
LEASE_NOT_EXPIRED = -3104

MAX_KEY_BYTES = 256


class MemCacheError(Exception):
    """Base of every error the core raises; ``code`` is the MemCache return code."""

    code: int = ERROR


class InvalidParameter(MemCacheError, ValueError):
    code = INVALID_PARAM


class KeyNotFound(MemCacheError, KeyError):
    code = OBJECT_NOT_EXISTS

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable
        return str(self.args[0]) if self.args else "key not found"


class ObjectExists(MemCacheError):
    code = OBJECT_ALREADY_EXISTS


class OutOfSpace(MemCacheError):
    """No segment can hold the object even after eviction."""

    code = OUT_OF_MEMORY


class OverCapacity(MemCacheError):
    """The object is larger than any segment of the pool."""

    code = OVER_CAPACITY


class StateMismatch(MemCacheError):
    """The object is not in the state the call needs (e.g. commit of an unknown allocation)."""

    code = STATE_MISMATCH


class LeaseExpired(MemCacheError):
    """A read outlived its lease and the object changed underneath: the bytes are not trusted."""

    code = STATE_MISMATCH


class WriteInProgress(MemCacheError):
    """Another writer's put of the key is still pending; ours did not store anything (not a success)."""

    code = WRITE_IN_PROGRESS


class ChecksumMismatch(MemCacheError):
    """The bytes read are not the bytes the writer committed: a miss, never a hit."""

    code = CHECKSUM_MISMATCH


class DiskIOError(MemCacheError):
    """A disk-tier record could not be read or written (I/O error, disk full): a miss."""

    code = DISK_IO_ERROR


class QuotaExceeded(MemCacheError):
    """This member already holds as many uncommitted puts (``member_max_pending_objects``,
    ``member_max_pending_bytes``) or keeps as many objects in the pool (``member_max_objects``,
    ``member_max_bytes``) or holds as many GVA leases (``member_max_leases``) as the MetaService allows:
    nothing was stored. Also a Join refused because ``max_members`` are joined."""

    code = QUOTA_EXCEEDED

    def __str__(self) -> str:
        if self.args and "max_members" in str(self.args[0]):   # a Join refused: the message says it all
            return str(self.args[0])
        return (f"{self.args[0] if self.args else 'put refused'}: this member is at a MetaService quota: "
                "its puts in flight (member_max_pending_objects / member_max_pending_bytes; retry once they "
                "commit) or the objects it keeps (member_max_objects / member_max_bytes; remove some, or "
                "raise the quota)")


class NotAMember(MemCacheError):
    """The request acts as a member the MetaService does not know (restarted, or a wrong token)."""

    code = CLIENT_NOT_INITIALIZED


class Unavailable(MemCacheError):
    """A process the call needs cannot be reached."""


class MetaServiceUnavailable(Unavailable):
    code = META_NOT_CONNECTED


class NotLeader(MetaServiceUnavailable):
    """The MetaService asked is not the HA leader (a standby, or a fenced old leader): ask the leader."""

    code = NOT_LEADER


class PeerUnavailable(Unavailable):
    """The LocalService that owns a segment cannot be reached (dead or unreachable)."""

    code = LOCAL_NOT_CONNECTED


class TransferFailed(MemCacheError):
    code = ERROR


class NotInitialized(MemCacheError):
    code = NOT_INITIALIZED


class ConfigError(MemCacheError, ValueError):
    """A configuration value is invalid; the message names the key."""

    code = INVALID_PARAM


class UnsupportedProtocol(ConfigError):
    """An Ascend-only protocol was asked for on a host without MemFabric."""


class CannotListen(ConfigError):
    """A server cannot listen where its setting says; the message names the setting and what to do."""

    code = SERVICE_NOT_STARTED


def cannot_listen(key: str, host: str, port: int, e: OSError) -> CannotListen:
    """The error for a failed bind of ``host:port``, chosen by the setting ``key``."""
    if e.errno == errno.EADDRINUSE:
        why = f"the port is in use by another process (stop it, or choose a free port in {key})"
    elif e.errno == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this host (set {key} to one of its addresses, or 0.0.0.0)"
    elif e.errno == errno.EACCES:
        why = f"ports below 1024 need privileges (choose a port above 1024 in {key})"
    else:
        why = f"{e.strerror or e}"
    return CannotListen(f"{key}: cannot listen on {host}:{port}: {why}")


_BY_CODE: dict[int, type[MemCacheError]] = {
    INVALID_PARAM: InvalidParameter,
    OBJECT_NOT_EXISTS: KeyNotFound,
    OBJECT_ALREADY_EXISTS: ObjectExists,
    OUT_OF_MEMORY: OutOfSpace,
    OVER_CAPACITY: OverCapacity,
    STATE_MISMATCH: StateMismatch,
    WRITE_IN_PROGRESS: WriteInProgress,
    CLIENT_NOT_INITIALIZED: NotAMember,
    CHECKSUM_MISMATCH: ChecksumMismatch,
    DISK_IO_ERROR: DiskIOError,
    QUOTA_EXCEEDED: QuotaExceeded,
    META_NOT_CONNECTED: MetaServiceUnavailable,
    NOT_LEADER: NotLeader,
    LOCAL_NOT_CONNECTED: PeerUnavailable,
    NOT_INITIALIZED: NotInitialized,
}


def error_from_code(code: int, message: str) -> MemCacheError:
    """Rebuild an exception from a code carried over the wire."""
    return _BY_CODE.get(code, MemCacheError)(message)


def check_key(key: str) -> bytes:
    """Return the key's UTF-8 bytes, or raise InvalidParameter for an empty or oversized key."""
    if not isinstance(key, str):
        raise InvalidParameter(f"key must be str, got {type(key).__name__}")
    raw = key.encode()
    if not raw:
        raise InvalidParameter("key is empty")
    if len(raw) >= MAX_KEY_BYTES:
        raise InvalidParameter(f"key is {len(raw)} bytes; keys must be shorter than {MAX_KEY_BYTES} bytes")
    return raw


def check_keys(keys: list[str] | tuple[str, ...]) -> None:
    """check_key for a batch. Keys of 1-63 characters (at most 4 UTF-8 bytes each, so under
    MAX_KEY_BYTES) pass without being encoded, which is ~4x faster for a batch of 1,000; so do
    longer ASCII keys (one byte a character: ``str.isascii`` reads a flag, encodes nothing)."""
    try:
        ascii_only = all(map(str.isascii, keys))   # TypeError for a key that is no str: the loop says so
    except TypeError:
        ascii_only = False
    else:
        lengths = list(map(len, keys))
        if keys and min(lengths) > 0 and max(lengths) < (MAX_KEY_BYTES if ascii_only else MAX_KEY_BYTES // 4):
            return
    for k in keys:
        check_key(k)


def valid_key(key: str, results: list[MemCacheError | None], i: int) -> bool:
    """check_key for slot ``i`` of a batch: an invalid key's error goes into ``results[i]`` (the batch
    goes on without it) and the answer is False."""
    try:
        check_key(key)
        return True
    except InvalidParameter as e:
        results[i] = e
        return False
