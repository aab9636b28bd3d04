"""The etcd the HA MetaServices elect their leader through, over etcd's HTTP/JSON gateway.

``etcd3gw`` (OpenStack, maintained) talks to the gateway with ``requests``: no gRPC and no protobuf,
which the older ``etcd3`` package needs and breaks with. It is imported only when HA is used (the
``ha`` extra). Each call tries the endpoints in turn, starting with the last one that answered.

Keys of one pool, under ``/memcache/<cluster_id>/``: ``leader`` (leased by the leader; its value is
the leader's URLs, its create revision the leader's term), ``config/<key>`` (the config store) and
``generations`` (the ceiling generations are issued below, ``meta/generations.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import ConfigError, MetaServiceUnavailable

T = TypeVar("T")


def leader_key(cluster_id: str) -> str:
    return f"/memcache/{cluster_id}/leader"


def generations_key(cluster_id: str) -> str:
    return f"/memcache/{cluster_id}/generations"


def config_prefix(cluster_id: str) -> str:
    return f"/memcache/{cluster_id}/config/"


def _etcd3gw() -> Any:
    try:
        import etcd3gw  # type: ignore[import-untyped]
        import etcd3gw.exceptions  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as e:
        raise ConfigError("ha_enable / etcd:// meta_service_url: the etcd client is missing; "
                          "install the ha extra of this package (pip install etcd3gw, or the wheel with [ha]; "
                          "docs/operations.md, Install)") from e
    return etcd3gw


class Etcd:
    def __init__(self, endpoints: tuple[tuple[str, int], ...], timeout_s: float) -> None:
        gw = _etcd3gw()
        self._gw = gw
        self.endpoints = endpoints
        self.clients = [gw.Etcd3Client(host=h, port=p, timeout=timeout_s, api_path="/v3/") for h, p in endpoints]
        self._first = 0

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on each endpoint in turn until one answers; EtcdUnavailable if none does."""
        errs = []
        n = len(self.clients)
        for i in range(n):
            j = (self._first + i) % n
            try:
                out = fn(self.clients[j])
            except (self._gw.exceptions.ConnectionFailedError, self._gw.exceptions.ConnectionTimeoutError) as e:
                errs.append(f"{self.endpoints[j][0]}:{self.endpoints[j][1]}: {type(e).__name__}")
                continue
            self._first = j
            return out
        raise EtcdUnavailable(f"etcd unreachable ({'; '.join(errs)})")

    def grant(self, ttl_s: int) -> int:
        return self.call(lambda c: c.lease(ttl=ttl_s).id)

    def refresh(self, lease_id: int) -> int:
        """The lease's new TTL in seconds; -1 when it has expired."""
        return self.call(lambda c: self._gw.Lease(lease_id, c).refresh())

    def revoke(self, lease_id: int) -> None:
        self.call(lambda c: self._gw.Lease(lease_id, c).revoke())

    def read(self, key: str) -> tuple[bytes, dict[str, Any]] | None:
        """(value, metadata with create_revision and mod_revision as ints) or None."""
        got = self.call(lambda c: c.get(key, metadata=True))
        if not got:
            return None
        value, meta = got[0]
        return value, {k: int(meta.get(k, 0)) for k in ("create_revision", "mod_revision", "lease")}

    def read_leader(self, cluster_id: str) -> dict[str, Any] | None:
        """The leader's record (``control``, ``config_store``, ``admin``, ``term``), or None."""
        got = self.read(leader_key(cluster_id))
        if got is None:
            return None
        try:
            info = json.loads(got[0])
        except ValueError:
            return None
        return {**info, "term": got[1]["create_revision"]}

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        got = self.call(lambda c: c.get_prefix(prefix))
        return {meta["key"].decode()[len(prefix):]: value for value, meta in got}


class EtcdUnavailable(MetaServiceUnavailable):
    """No etcd endpoint answered."""
