"""``MemCacheConnector``: vLLM's KV connector interface over the MemCache pool.

A thin facade: the scheduler-role instance delegates to ``MemCacheScheduler`` (lookups, load and
save planning), the worker-role instance to ``MemCacheWorker`` (the data moves). Select it with

    --kv-transfer-config '{"kv_connector": "MemCacheConnector",
        "kv_connector_module_path": "memcache_vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"meta_service_url": "tcp://127.0.0.1:5000",
                                      "protocol": "host_shm", "dram_size": "4GB"}}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from memcache_vllm.config import ConnectorConfig, RolePolicy
from memcache_vllm.metadata import MemCacheConnectorMetadata, MemCacheWorkerMetadata
from memcache_vllm.scheduler import MemCacheScheduler
from memcache_vllm.stats import MemCacheConnectorStats, MemCachePromMetrics, StatsRecorder
from memcache_vllm.worker import MemCacheWorker

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm." + __name__)


class MemCacheConnector(KVConnectorBase_V1):
    # The pool is host memory shared by every instance.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._cfg = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self._policy = RolePolicy.from_role(ktc.kv_role, self._cfg)
        self._stats = StatsRecorder()
        self._scheduler: MemCacheScheduler | None = None
        self._worker: MemCacheWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = MemCacheScheduler(vllm_config, kv_cache_config, self._cfg,
                                                self._policy, self._stats)
        else:
            self._worker = MemCacheWorker(vllm_config, kv_cache_config, self._cfg,
                                          self._policy, self._stats)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise hooks run between layers: vLLM must not capture whole-model CUDA graphs.
        return ConnectorConfig.from_extra_config(extra_config).use_layerwise

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never a lost hand-off.
        return False

    # -- worker side -----------------------------------------------------------------------

    def _meta(self) -> MemCacheConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MemCacheConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # The worker's key namespace, computed from the KV caches it holds, for the scheduler.
        return self._worker.handshake() if self._worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, MemCacheConnectorMetadata):
            self._worker.begin_step(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, MemCacheConnectorMetadata):
            self._worker.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # use_layerwise: returns once this layer's blocks are in place; else a no-op (whole blocks
        # of all layers were loaded before the forward)
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # use_layerwise: copies this layer's new blocks now; else a no-op (saved in wait_for_save)
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side --------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self._scheduler is not None:
            self._scheduler.bind_gpu_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        worker_meta = connector_output.kv_connector_worker_meta
        self._scheduler.update_connector_output(
            set(connector_output.invalid_block_ids or ()),
            worker_meta if isinstance(worker_meta, MemCacheWorkerMetadata) else None)

    def take_events(self) -> Iterable[KVCacheEvent]:
        # Drained by vLLM's scheduler every step and published on the engine's KV-event stream.
        return self._scheduler.events.take() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        # reset_prefix_cache(reset_connector=True), e.g. after a weight update.
        assert self._scheduler is not None
        return self._scheduler.reset_cache()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- stats -----------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MemCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return MemCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
