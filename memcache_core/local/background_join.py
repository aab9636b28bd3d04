"""Joining the pool in the background: a member that starts while the MetaService is down (an engine's
LocalService, a standalone provider applied with the MetaService in one go) keeps trying and joins as
soon as the pool answers.

``BackgroundJoin(attempt, on_joined)`` calls ``attempt()`` on a daemon thread until it succeeds,
waiting ``INITIAL_BACKOFF_S`` after the first failure and twice as long after each next one, at most
``max_s``; then ``on_joined(result)``, and a line saying so that ends with ``joined_note``. Later
failures are logged at debug level: the caller logs the first one (one line per outage, not one per
attempt). A failure that ``permanent(exc)`` calls permanent (a wrong pool secret, a config error:
waiting cannot mend it) ends the retries and goes to ``on_failed(exc)``. ``stop()`` ends the retries
(a result produced after it is handed to ``on_joined`` anyway, which must close it);
``wait(timeout_s)`` waits for an attempt in flight to end.

The SGLang backend joins this way (``memcache_sglang.pool_join``), and so does ``memcache
local-service`` (``LocalService.start(wait_for_pool=True)``); ``refused_for_good`` is their ``permanent``.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..auth import AuthMismatch
from ..errors import ConfigError, InvalidParameter

logger = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


def never(_: BaseException) -> bool:
    return False


class BackgroundJoin:
    def __init__(self, attempt: Callable[[], Any], on_joined: Callable[[Any], None],
                 initial_s: float = INITIAL_BACKOFF_S, max_s: float = MAX_BACKOFF_S, *,
                 name: str = "npu_memcache",
                 joined_note: str | Callable[[], str] = "pages are read and written again",
                 permanent: Callable[[BaseException], bool] = never,
                 on_failed: Callable[[BaseException], None] | None = None) -> None:
        self._attempt = attempt
        self._on_joined = on_joined
        self._initial_s = initial_s
        self._max_s = max_s
        self._name = name
        self._joined_note = joined_note
        self._permanent = permanent
        self._on_failed = on_failed
        self._stop = threading.Event()
        self.attempts = 0
        self.failures = 0
        self.joined = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-join", daemon=True)

    def start(self) -> BackgroundJoin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float) -> None:
        """Wait for the thread (an attempt in flight) to end, at most ``timeout_s``."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        delay = min(self._initial_s, self._max_s)
        while not self._stop.wait(delay):
            self.attempts += 1
            try:
                result = self._attempt()
            except Exception as exc:
                self.failures += 1
                if self._permanent(exc):
                    if self._on_failed is not None:
                        self._on_failed(exc)
                    return
                logger.debug("%s: join attempt %d failed: %s", self._name, self.attempts, exc)
                delay = min(delay * 2, self._max_s)
                continue
            self._on_joined(result)
            note = self._joined_note() if callable(self._joined_note) else self._joined_note
            logger.warning("%s: joined the pool after %d attempt(s) in the background; %s", self._name,
                           self.attempts, note)
            self.joined.set()
            return


def refused_for_good(e: BaseException) -> bool:
    """A join error that waiting cannot mend: the pool's authentication differs (wrong secret,
    ``auth_enable``), the MetaService's TLS certificate does not verify (another CA), or the
    MetaService refused the Join as invalid (a config error). Anything else (unreachable, restarting,
    out of connection slots, ``max_members``, not the leader) is waited out."""
    return any(isinstance(c, (AuthMismatch, ConfigError, InvalidParameter, ssl.SSLCertVerificationError))
               for c in causes(e))


def causes(e: BaseException | None) -> Iterator[BaseException]:
    """``e`` and its causes (the control-plane client raises ``MetaServiceUnavailable`` from what failed)."""
    for _ in range(16):
        if e is None:
            return
        yield e
        e = e.__cause__
