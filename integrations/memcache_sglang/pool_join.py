"""Joining the pool in the background: a server that starts while the MetaService is down serves
misses (failures are misses) and joins as soon as the pool answers.

``BackgroundJoin(open_store, on_joined)`` calls ``open_store()`` on a daemon thread until it
succeeds, waiting ``INITIAL_BACKOFF_S`` after the first failure and twice as long after each
next one, at most ``MAX_BACKOFF_S`` (the backend's ``join_retry_max_seconds``); then
``on_joined(store)``. The first failure is logged as a
warning, later ones at debug level (one line per outage, not one per attempt); the join is logged
when it happens (the backend counts the attempts in :mod:`memcache_sglang.join_metrics`). ``stop()``
ends the retries (a store opened after it is handed to ``on_joined`` anyway, which must close it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class BackgroundJoin:
    def __init__(self, open_store: Callable[[], Any], on_joined: Callable[[Any], None],
                 initial_s: float = INITIAL_BACKOFF_S, max_s: float = MAX_BACKOFF_S) -> None:
        self._open = open_store
        self._on_joined = on_joined
        self._initial_s = initial_s
        self._max_s = max_s
        self._stop = threading.Event()
        self.attempts = 0
        self.failures = 0
        self.joined = threading.Event()
        self._thread = threading.Thread(target=self._run, name="npu-memcache-join", daemon=True)

    def start(self) -> BackgroundJoin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        delay = min(self._initial_s, self._max_s)
        while not self._stop.wait(delay):
            self.attempts += 1
            try:
                store = self._open()
            except Exception as exc:
                self.failures += 1
                logger.debug("npu_memcache: join attempt %d failed: %s", self.attempts, exc)
                delay = min(delay * 2, self._max_s)
                continue
            logger.warning("npu_memcache: joined the pool after %d attempt(s) in the background; "
                           "pages are read and written again", self.attempts)
            self._on_joined(store)
            self.joined.set()
            return
