"""Parsers and checks of single setting values, a leaf below ``config.py``: sizes, URLs, booleans, the
MetaService target, etcd endpoints, cluster ids, and a put's ``ReplicateConfig``. Each raises
``ConfigError`` naming the key it was given."""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from urllib.parse import urlparse

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, key: str = "size") -> int:
    """Bytes from ``134217728``, ``"2048KB"``, ``"200mb"``, ``"2.5G"``, ``"1TB"`` (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size such as '4GB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must not be negative, got {value}")
        return value
    if isinstance(value, float) and value >= 0:
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key}: expected a size such as '4GB', '200mb' or 134217728, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_url(value: str, key: str, schemes: tuple[str, ...]) -> tuple[str, int]:
    """(host, port) of a URL such as ``tcp://127.0.0.1:5000``; raise naming ``key`` if malformed."""
    try:
        u = urlparse(value)
        host, port = u.hostname, u.port
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: malformed URL {value!r}: {e}") from e
    if u.scheme not in schemes or not host or port is None:
        raise ConfigError(f"{key}: expected {schemes[0]}://HOST:PORT, got {value!r}")
    return host, port


_CLUSTER_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class MetaTarget:
    """Where a client finds the MetaService: URLs tried in turn, or the HA leader key in etcd."""

    urls: tuple[str, ...] = ()
    etcd: tuple[tuple[str, int], ...] = ()
    cluster_id: str = ""


def parse_etcd_endpoints(value: Any, key: str) -> tuple[tuple[str, int], ...]:
    """``"h1:2379,http://h2:2379"`` -> ((h1, 2379), (h2, 2379)); raise naming ``key`` if malformed."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected etcd endpoints such as 'http://127.0.0.1:2379,host2:2379', got {value!r}")
    out = []
    for item in value.split(","):
        item = item.strip()
        out.append(parse_url(item if "://" in item else "http://" + item, key, ("http", "https")))
    return tuple(out)


def check_cluster_id(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _CLUSTER_ID_RE.match(value):
        raise ConfigError(f"{key}: expected 1-64 letters, digits, '_', '.' or '-', got {value!r}")
    return value


def parse_meta_target(value: Any, key: str = "meta_service_url") -> MetaTarget:
    """``tcp://h:p``, ``tcp://a:p,tcp://b:p`` (tried in turn) or ``etcd://h1:2379,h2:2379/<cluster_id>``."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a URL string, got {value!r}")
    if value.startswith("etcd://"):
        hosts, sep, cluster = value[len("etcd://"):].rpartition("/")
        if not sep:
            raise ConfigError(f"{key}: expected etcd://HOST:PORT[,HOST:PORT...]/CLUSTER_ID, got {value!r}")
        return MetaTarget(etcd=parse_etcd_endpoints(hosts, key), cluster_id=check_cluster_id(cluster, key))
    urls = tuple(u.strip() for u in value.split(","))
    for u in urls:
        parse_url(u, key, ("tcp",))
    return MetaTarget(urls=urls)


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


TRUE_WORDS = ("1", "true", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "no", "n", "off")


def parse_bool(key: str, value: Any) -> bool:
    """The one reading of a boolean setting everywhere (JSON, extra-config strings, environment):
    true/false, 1/0, or the words in ``TRUE_WORDS`` / ``FALSE_WORDS`` in any case; anything else is
    a ConfigError naming ``key`` (never silently true or false)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def check_log_level(level: str) -> None:
    if str(level).lower() not in ("debug", "info", "warning", "warn", "error", "critical"):
        raise ConfigError(f"log_level: expected debug, info, warning or error, got {level!r}")


@dataclasses.dataclass
class ReplicateConfig:
    """Replica placement of a put (memcache_hybrid field names)."""

    replicaNum: int = 1  # noqa: N815 - memcache_hybrid's name
    """Copies of the object, each in a different segment (at most 8)."""
    preferredLocalServiceIDs: list[int] = dataclasses.field(default_factory=list)  # noqa: N815
    """LocalService ids to place replicas on first (unique, at most replicaNum)."""

    def validate(self) -> None:
        if isinstance(self.replicaNum, bool) or not isinstance(self.replicaNum, int) \
                or not 1 <= self.replicaNum <= 8:
            raise ConfigError(f"replicaNum: expected 1..8, got {self.replicaNum!r}")
        ids = list(self.preferredLocalServiceIDs)
        if len(set(ids)) != len(ids) or len(ids) > self.replicaNum:
            raise ConfigError("preferredLocalServiceIDs: ids must be unique and at most replicaNum")
