"""Connector statistics: vLLM's ``KVConnectorStats`` (logged as "KV Transfer metrics") and
Prometheus counters (``vllm:memcache_*``).

Every field is a plain number summed over workers and steps, so the object stays serializable
and aggregation is addition.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

FIELDS: tuple[str, ...] = (
    "lookups",              # existence queries (one per request admission)
    "lookup_errors",        # queries that could not reach the pool (answered as misses)
    "hit_tokens",           # tokens the pool could serve at lookup time
    "hit_blocks",
    "load_blocks",          # blocks loaded into vLLM's KV cache
    "load_bytes",
    "load_failed_blocks",   # blocks reported through get_block_ids_with_load_errors
    "load_time_s",
    "layer_wait_s",         # time the forward waited in wait_for_layer_load (use_layerwise)
    "save_blocks",          # blocks written to the pool
    "save_bytes",
    "save_failed_blocks",
    "save_time_s",
    "save_fenced_blocks",   # blocks not saved: computed over a block that failed to load
    "poisoned_removed",     # keys removed: saved from a step that read a block that failed to load
    "poisoned_evicted",     # blocks evicted from vLLM's prefix cache: they failed to load, or were
                            # computed over such a block
    "save_poisoned_blocks", # blocks not saved (scheduler): computed over a poisoned block
    "resets",               # reset_cache calls (namespace epoch changes)
)


@dataclass
class MemCacheConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        fresh: dict[str, Any] = dict.fromkeys(FIELDS, 0)
        self.data = fresh

    def add(self, **values: float) -> None:
        for name, value in values.items():
            self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name in FIELDS:
            value = self.data.get(name, 0)
            out[name] = round(value, 4) if isinstance(value, float) else value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in FIELDS)


class StatsRecorder:
    """Thread-safe accumulator; ``take()`` hands over what was recorded since the last call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = MemCacheConnectorStats()

    def add(self, **values: float) -> None:
        with self._lock:
            self._stats.add(**values)

    def take(self) -> MemCacheConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, MemCacheConnectorStats()
            return out


class MemCachePromMetrics(KVConnectorPromMetrics):
    """Counters ``vllm:memcache_<field>_total`` per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:memcache_{name}_total",
                documentation=f"MemCache connector: {name.replace('_', ' ')}.",
                labelnames=labelnames,
            )
            for name in FIELDS
        }
        self._bound: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            if name not in self._counters or not value:
                continue
            key = (engine_idx, name)
            if key not in self._bound:
                self._bound[key] = self._counters[name].labels(*self.per_engine_labelvalues[engine_idx])
            self._bound[key].inc(value)
