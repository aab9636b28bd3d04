"""The etcd the HA MetaServices elect their leader through, over etcd's HTTP/JSON gateway.

``etcd3gw`` (OpenStack, maintained) talks to the gateway with ``requests``: no gRPC and no protobuf,
which the older ``etcd3`` package needs and breaks with. It is imported only when HA is used (the
``ha`` extra). Each call tries the endpoints in turn, starting with the last one that answered.

Keys of one pool, under ``/memcache/<cluster_id>/``: ``leader`` (leased by the leader; its value is
the leader's URLs, its create revision the leader's term), ``config/<key>`` (the config store) and
``generations`` (the ceiling generations are issued below, ``meta/generations.py``).

A secured etcd (``EtcdAuth``): TLS with the pool's CA (``ha_etcd_ca_path``: every endpoint is then
``https``) and a client certificate (``ha_etcd_cert_path``/``ha_etcd_key_path``), and/or etcd's own
users (``ha_etcd_user`` with the password in the file ``ha_etcd_password_path``): the client
authenticates for a token and authenticates again when etcd says the token expired. Give that user a
role limited to ``/memcache/<cluster_id>/`` (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import ConfigError, MemCacheError, MetaServiceUnavailable

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


@dataclasses.dataclass(frozen=True)
class EtcdAuth:
    """How this process proves itself to etcd (all empty: a plain, open etcd)."""

    ca_path: str = ""        # the CA of etcd's server certificate: speak https
    cert_path: str = ""      # a client certificate (etcd's --client-cert-auth) ...
    key_path: str = ""       # ... and its key
    user: str = ""           # an etcd user (etcd's auth enabled) ...
    password_path: str = ""  # ... whose password is this file's first line

    @classmethod
    def of(cls, config: Any) -> EtcdAuth:
        """The ``ha_etcd_*`` keys of a MetaConfig or LocalConfig."""
        return cls(*(str(getattr(config, f"ha_etcd_{k}", "") or "") for k in
                     ("ca_path", "cert_path", "key_path", "user", "password_path")))

    def password(self) -> str:
        try:
            st = os.stat(self.password_path, follow_symlinks=False)
            with open(self.password_path, encoding="utf-8") as f:
                line = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"ha_etcd_password_path: cannot read {self.password_path}: {e.strerror}") from e
        if st.st_mode & 0o077:
            raise ConfigError(f"ha_etcd_password_path: {self.password_path} is readable by other users "
                              f"(mode {st.st_mode & 0o777:o}); chmod 600 it")
        if not line:
            raise ConfigError(f"ha_etcd_password_path: {self.password_path} is empty")
        return line


class Etcd:
    def __init__(self, endpoints: tuple[tuple[str, int], ...], timeout_s: float, auth: EtcdAuth | None = None) -> None:
        gw = _etcd3gw()
        self._gw = gw
        self.endpoints = endpoints
        self.auth = auth or EtcdAuth()
        a = self.auth
        self.clients = [gw.Etcd3Client(host=h, port=p, timeout=timeout_s, api_path="/v3/",
                                       protocol="https" if a.ca_path else "http", ca_cert=a.ca_path or None,
                                       cert_cert=a.cert_path or None, cert_key=a.key_path or None)
                        for h, p in endpoints]
        if a.ca_path:
            for c in self.clients:
                # requests lets $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE override the session's CA: etcd's
                # certificate is verified against ha_etcd_ca_path and nothing else
                c.session.trust_env = False
        self._first = 0

    def _authenticate(self, client: Any) -> None:
        """Log ``client`` in as ``auth.user`` (etcd answers a token, sent as the Authorization header)."""
        try:
            token = client.post(client.get_url("/auth/authenticate"),
                                json={"name": self.auth.user, "password": self.auth.password()})["token"]
        except (self._gw.exceptions.ConnectionFailedError, self._gw.exceptions.ConnectionTimeoutError):
            raise
        except (self._gw.exceptions.Etcd3Exception, KeyError, TypeError) as e:
            raise EtcdRefused(f"etcd refused user {self.auth.user!r} (ha_etcd_user / ha_etcd_password_path): "
                              f"{e}") from e
        client.session.headers["Authorization"] = token

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on each endpoint in turn until one answers; EtcdUnavailable if none does,
        EtcdRefused when etcd refuses our credentials or the operation."""
        errs = []
        n = len(self.clients)
        for i in range(n):
            j = (self._first + i) % n
            client = self.clients[j]
            try:
                if self.auth.user and "Authorization" not in client.session.headers:
                    self._authenticate(client)
                try:
                    out = fn(client)
                except self._gw.exceptions.Etcd3Exception as e:
                    if not self.auth.user or "Unauthorized" not in str(e.args):
                        raise
                    self._authenticate(client)   # the token expired: once more with a new one
                    out = fn(client)
            except (self._gw.exceptions.ConnectionFailedError, self._gw.exceptions.ConnectionTimeoutError) as e:
                errs.append(f"{self.endpoints[j][0]}:{self.endpoints[j][1]}: {type(e).__name__}")
                continue
            except self._gw.exceptions.WatchTimedOut:
                raise
            except self._gw.exceptions.Etcd3Exception as e:
                raise EtcdRefused(f"etcd at {self.endpoints[j][0]}:{self.endpoints[j][1]} refused the request "
                                  f"({' '.join(map(str, e.args))}): check ha_etcd_user / ha_etcd_cert_path and "
                                  f"the user's role") from e
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


class EtcdRefused(MemCacheError):
    """etcd answered but refused: our credentials, or a permission of our user's role."""
