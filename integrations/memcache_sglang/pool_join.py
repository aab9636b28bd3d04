"""Joining the pool in the background: a server that starts while the MetaService is down serves
misses (failures are misses) and joins as soon as the pool answers.

The retry loop is the core's (``memcache_core.local.background_join``, which ``memcache
local-service`` uses too): ``BackgroundJoin(open_store, on_joined)`` calls ``open_store()`` on a
daemon thread until it succeeds, waiting ``INITIAL_BACKOFF_S`` after the first failure and twice as
long after each next one, at most ``MAX_BACKOFF_S`` (the backend's ``join_retry_max_seconds``); then
``on_joined(store)``. The first failure is logged by the backend as a warning, later ones at debug
level (one line per outage, not one per attempt); the join is logged when it happens (the backend
counts the attempts in :mod:`memcache_sglang.join_metrics`). ``stop()`` ends the retries (a store
opened after it is handed to ``on_joined`` anyway, which must close it).
"""

from __future__ import annotations

from memcache_core.local.background_join import INITIAL_BACKOFF_S, MAX_BACKOFF_S, BackgroundJoin

__all__ = ["INITIAL_BACKOFF_S", "MAX_BACKOFF_S", "BackgroundJoin"]
