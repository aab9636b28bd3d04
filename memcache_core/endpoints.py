"""Which MetaService a client talks to: one URL, a list tried in turn, or the HA leader in etcd.

``meta_service_url`` is parsed by ``config.parse_meta_target``. ``advance(url)`` is called when the
MetaService at ``url`` failed or said it is not the leader: a list moves to its next URL, an
``etcd://`` target reads the leader key again. Several threads that saw the same failure move once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .config import parse_meta_target, parse_url
from .errors import MemCacheError

if TYPE_CHECKING:
    from .etcd import Etcd, EtcdAuth

logger = logging.getLogger(__name__)

REREAD_S = 0.1   # etcd is asked for the leader at most this often per client


class MetaEndpoints:
    def __init__(self, value: str, timeout_s: float, etcd_auth: EtcdAuth | None = None) -> None:
        self.target = parse_meta_target(value)
        self._timeout_s = min(timeout_s, 2.0)
        self._lock = threading.Lock()
        self._i = 0
        self._next_read = 0.0
        self._etcd: Etcd | None = None
        self.url = self.target.urls[0] if self.target.urls else ""
        self.addr: tuple[str, int] | None = parse_url(self.url, "meta_service_url", ("tcp",)) if self.url else None
        if self.target.etcd:
            from .etcd import Etcd
            self._etcd = Etcd(self.target.etcd, self._timeout_s, etcd_auth)  # no client installed: fail now
            self._resolve()

    @property
    def count(self) -> int:
        """How many endpoints one call may try before giving up (a re-read of etcd counts as one)."""
        return len(self.target.urls) if self.target.urls else 2

    def advance(self, failed_url: str) -> bool:
        """Move on from ``failed_url``; True when the endpoint changed."""
        with self._lock:
            if failed_url != self.url:
                return True   # another thread already moved on
            if self.target.urls:
                self._i = (self._i + 1) % len(self.target.urls)
                self._set(self.target.urls[self._i])
            elif time.monotonic() >= self._next_read:
                self._next_read = time.monotonic() + REREAD_S
                self._resolve()
            return self.url != failed_url

    def _set(self, url: str) -> None:
        self.addr = parse_url(url, "meta_service_url", ("tcp",)) if url else None
        self.url = url

    def _resolve(self) -> None:
        try:
            info = self._etcd.read_leader(self.target.cluster_id)  # type: ignore[union-attr]
        except MemCacheError as e:
            logger.warning("cannot read the MetaService leader from etcd: %s", e)
            info = None
        url = str(info.get("control", "")) if info else ""
        if url != self.url:
            logger.info("MetaService leader of cluster %r: %s", self.target.cluster_id,
                        f"{url} (term {info['term']})" if info else "none elected")
        try:
            self._set(url)
        except MemCacheError:
            self._set("")
