"""The backend's place in the pool, on SGLang's own ``/metrics`` (``--enable-metrics``).

SGLang serves ``/metrics`` from the default ``prometheus_client`` registry of its processes,
collected across them (multiprocess mode, which SGLang turns on before it starts a scheduler);
the backend's storage figures (``get_stats``) reach it that way too. These series are registered
there once per process, labelled with the rank (its place in the TP x PP x attention-CP grid,
``config.rank_index``). They exist from the backend's start, joined or not: a server that cannot
reach its pool is when an operator needs them, and the LocalService's own metrics port
(``metrics_port``) only serves once it has joined.

* ``memcache_sglang_join_attempts_total{rank}``: attempts to join the pool, the one at start-up
  and each background retry (:mod:`memcache_sglang.pool_join`).
* ``memcache_sglang_join_failures_total{rank}``: those that failed.
* ``memcache_sglang_joined{rank}``: 1 while the backend is in the pool, 0 before it joined (and
  after ``close``).
* ``memcache_sglang_unjoined_misses_total{rank}``: pages SGLang asked about (``batch_exists``,
  ``exists``) answered as misses because the backend had not joined the pool.

Without ``--enable-metrics`` the series live in the process's default registry and nobody serves
them (a few objects, no port).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import Counter, Gauge


@dataclass(frozen=True)
class JoinMetrics:
    attempts: Counter
    failures: Counter
    joined: Gauge
    unjoined_misses: Counter

    def of_rank(self, rank: int) -> RankJoinMetrics:
        r = str(rank)
        return RankJoinMetrics(self.attempts.labels(r), self.failures.labels(r), self.joined.labels(r),
                               self.unjoined_misses.labels(r))


@dataclass(frozen=True)
class RankJoinMetrics:
    """One rank's series (children of the families above)."""

    attempts: Counter
    failures: Counter
    joined: Gauge
    unjoined_misses: Counter


@cache
def join_metrics() -> JoinMetrics:
    """The families, registered once per process (a backend attached again reuses them)."""
    return JoinMetrics(
        Counter("memcache_sglang_join_attempts", "Attempts of the npu_memcache backend to join the MemCache "
                "pool (at start-up and each background retry).", ["rank"]),
        Counter("memcache_sglang_join_failures", "Attempts to join the MemCache pool that failed.", ["rank"]),
        # mostrecent: the value the rank's process set last (one process per rank label)
        Gauge("memcache_sglang_joined", "1 while the npu_memcache backend is in the MemCache pool, 0 before "
              "it joined and after close.", ["rank"], multiprocess_mode="mostrecent"),
        Counter("memcache_sglang_unjoined_misses", "Pages answered as misses because the npu_memcache backend "
                "had not joined the MemCache pool.", ["rank"]),
    )
