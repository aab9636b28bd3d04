"""Settings of the MemCache connector, read from ``kv_connector_extra_config``.

One dict carries two kinds of keys:

* connector keys (below), including those of vllm-ascend's pool connector (``backend``,
  ``lookup_rpc_port``, ``load_async``, ``use_layerwise``, ``consumer_is_to_put``,
  ``consumer_is_to_load``, ``discard_partial_chunks``) with the same meaning where it applies;
* the store's own keys: any field of ``memcache_core.LocalConfig`` (``meta_service_url``,
  ``protocol``, ``dram_size``, ``client_timeout_seconds``, ...), passed to the LocalService;
* ``config_path``: the pool's JSON file (the one ``memcache meta-service`` and ``memcache
  local-service`` read), whose ``LocalConfig`` keys, over the ``MEMCACHE_<KEY>`` environment
  overrides, come under the store keys given here (those given here win).

Unknown keys are warned about, never fatal; invalid values fail at start-up naming the key.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from memcache_core.config import parse_bool

logger = logging.getLogger("vllm." + __name__)

# Keys of vllm-ascend's AscendStoreConnector that have no effect here, accepted for compatibility.
_COMPAT_ONLY_KEYS = frozenset({
    "mooncake_rpc_port", "prefill_pp_size", "prefill_pp_layer_partition", "prefill_tp_size",
    "decode_tp_size", "layerwise_max_transfer_blocks",
    "layerwise_max_transfer_bytes", "h2d_stagger_us",
})

# Store defaults that differ from LocalConfig's: its protocol default needs Ascend hardware, and a
# MetaService that does not answer must cost a step a few seconds at most, not a minute.
_STORE_DEFAULTS: dict[str, Any] = {"protocol": "host_shm", "client_timeout_seconds": 5.0}


def _as_bool(key: str, value: Any) -> bool:
    return parse_bool(f"kv_connector_extra_config.{key}", value)


def _as_float(key: str, value: Any, low: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config.{key}: expected a number, got {value!r}") from None
    if out < low:
        raise ValueError(f"kv_connector_extra_config.{key}: must be >= {low}, got {value!r}")
    return out


def _pool_file(path: Any) -> dict[str, Any]:
    """The ``LocalConfig`` keys of the pool file ``config_path`` (none without one); a file that
    cannot be read, or holds a bad or (in strict mode) unknown key, fails naming ``config_path``."""
    from memcache_core.config import LocalConfig, file_values
    from memcache_core.errors import ConfigError

    if path in (None, ""):
        return {}
    if not isinstance(path, str):
        raise ValueError(f"kv_connector_extra_config.config_path: expected the path of a JSON file, got {path!r}")
    try:
        return file_values(LocalConfig, path)
    except ConfigError as exc:
        raise ValueError(f"kv_connector_extra_config.{exc}" if str(exc).startswith("config_path")
                         else f"kv_connector_extra_config.config_path: {exc}") from None


@dataclasses.dataclass
class ConnectorConfig:
    """Connector settings; every field is a key of ``kv_connector_extra_config``."""

    backend: str = "memcache"
    """Pool backend (vllm-ascend key); only ``memcache`` exists here."""
    lookup_rpc_port: int = 0
    """vllm-ascend key. Lookups here go straight to the MetaService through a pure client, so no
    scheduler-to-worker socket exists and the value is unused (kept unique-per-instance safe)."""
    load_async: bool = False
    """Load in the background: the request waits in WAITING_FOR_REMOTE_KVS while other requests
    run, and completion is reported through ``get_finished``. False: the step that needs the blocks
    loads them before its forward."""
    save_async: bool = True
    """Save in the background without blocking the step. The source blocks stay alive until the save
    is done (finished requests are freed late, preemptions wait for in-flight saves)."""
    use_layerwise: bool = False
    """vllm-ascend key: per-layer transfers over the pool's GVA path (``layerwise.py``): loads overlap
    the forward layer by layer, saves copy each layer as it is computed. Loads are then synchronous and
    saves end inside their step (``load_async`` and ``save_async`` are off). KV caches on a CUDA
    device still move whole blocks (logged)."""
    layerwise_prefetch_layers: int = 1
    """vllm-ascend key (with ``use_layerwise``): how many layers a load may run ahead of the layer
    the forward waits for (layers l+1 .. l+k load while layer l computes)."""
    consumer_is_to_put: bool = False
    """A ``kv_consumer`` instance also saves to the pool."""
    consumer_is_to_load: bool = False
    """A ``kv_consumer`` instance also loads from the pool (else it neither looks up nor loads)."""
    discard_partial_chunks: bool = True
    """Only full blocks are stored or looked up. Always true here (a partial block has no vLLM block
    hash); false is logged and ignored."""
    save_decode_cache: bool = False
    """Also save blocks filled by generated tokens (default: prompt blocks only)."""
    cache_prefix: str = ""
    """Extra namespace in front of every key, to separate tenants or experiments sharing a pool."""
    weights_full_hash: bool = False
    """Identify the checkpoint's weight files by the SHA-256 of their bytes (read once at start-up)
    instead of their size, modification time and safetensors header: the same checkpoint copied
    to other hosts without its modification times then still shares blocks."""
    lookup_retry_s: float = 5.0
    """After the pool could not be reached, lookups answer "miss" at once for this long."""
    load_failure_policy: str = "recompute"
    """What vLLM does with a block that was looked up but does not load (evicted or lost between
    lookup and load): ``recompute`` (a miss; the connector sets vLLM's ``kv_load_failure_policy`` to
    it, whatever kv_transfer_config says, since for a cache a miss is never an error) or ``fail``
    (vLLM's own ``kv_load_failure_policy`` is left as it is: its default ends such requests with an
    error)."""
    store_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The store's own keys (``memcache_core.LocalConfig`` fields)."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        from memcache_core import LocalConfig

        extra = dict(extra or {})
        store_fields = {f.name for f in dataclasses.fields(LocalConfig)}
        cfg = cls()
        cfg.store_config = {**_STORE_DEFAULTS, **_pool_file(extra.pop("config_path", None))}
        for key, value in extra.items():
            if key in ("backend", "cache_prefix"):
                setattr(cfg, key, str(value))
            elif key in ("lookup_rpc_port", "mooncake_rpc_port"):
                cfg.lookup_rpc_port = int(_as_float(key, value, 0))
            elif key in ("load_async", "save_async", "use_layerwise", "consumer_is_to_put",
                         "consumer_is_to_load", "discard_partial_chunks", "save_decode_cache",
                         "weights_full_hash"):
                setattr(cfg, key, _as_bool(key, value))
            elif key == "layerwise_prefetch_layers":
                cfg.layerwise_prefetch_layers = int(_as_float(key, value, 1))
            elif key == "lookup_retry_s":
                cfg.lookup_retry_s = _as_float(key, value, 0.0)
            elif key == "load_failure_policy":
                if value not in ("recompute", "fail"):
                    raise ValueError(f"kv_connector_extra_config.load_failure_policy: expected 'recompute' or "
                                     f"'fail', got {value!r}")
                cfg.load_failure_policy = str(value)
            elif key in store_fields:
                cfg.store_config[key] = value
            elif key in _COMPAT_ONLY_KEYS:
                logger.info("MemCacheConnector: extra config key %s has no effect here", key)
            else:
                logger.warning("MemCacheConnector: unknown extra config key %s ignored", key)
        if cfg.backend.lower() != "memcache":
            raise ValueError(
                f"kv_connector_extra_config.backend: only 'memcache' is supported, got {cfg.backend!r}")
        if cfg.use_layerwise and (cfg.load_async or cfg.save_async):
            logger.info("MemCacheConnector: use_layerwise loads during the forward and saves inside the step; "
                        "load_async and save_async are off")
            cfg.load_async = cfg.save_async = False
        if not cfg.discard_partial_chunks:
            logger.warning("MemCacheConnector: partial blocks are never stored (no block hash); "
                           "discard_partial_chunks=false ignored")
            cfg.discard_partial_chunks = True
        local = cfg.local_config()  # validate the store keys now, naming the bad key
        if local.disk_path and local.dram_bytes <= 0:
            raise ValueError("kv_connector_extra_config.disk_path: a disk tier lies under the worker's own DRAM "
                             "segment, and dram_size is 0; give disk_path to the provider (memcache local-service) "
                             "that holds the pool instead, or set dram_size")
        return cfg

    def local_config(self) -> Any:
        """A ``memcache_core.LocalConfig`` built from the store keys (validated)."""
        from memcache_core import LocalConfig

        values = dict(self.store_config)
        try:
            return LocalConfig(**values)
        except TypeError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from exc

    def worker_local_config(self, tp_rank: int, pp_rank: int, pcp_rank: int = 0) -> Any:
        """The worker's store config: with a disk tier, each rank keeps it in its own directory
        ``disk_path/r{tp_rank}p{pp_rank}`` (``c{pcp_rank}`` appended for prefill-context-parallel
        ranks above 0; every worker gets the same extra config, and a disk tier serves one
        LocalService)."""
        local = self.local_config()
        if local.disk_path:
            rank_dir = f"r{tp_rank}p{pp_rank}" + (f"c{pcp_rank}" if pcp_rank else "")
            local.disk_path = os.path.join(local.disk_path, rank_dir)
        return local


@dataclasses.dataclass(frozen=True)
class RolePolicy:
    """What this instance does with the pool, from ``kv_role`` and the consumer keys."""

    can_load: bool
    can_save: bool

    @classmethod
    def from_role(cls, kv_role: str | None, cfg: ConnectorConfig) -> RolePolicy:
        if kv_role == "kv_consumer":
            return cls(can_load=cfg.consumer_is_to_load, can_save=cfg.consumer_is_to_put)
        if kv_role in ("kv_producer", "kv_both"):
            return cls(can_load=True, can_save=True)
        raise ValueError(f"kv_role: expected kv_producer, kv_consumer or kv_both, got {kv_role!r}")


def apply_load_failure_policy(ktc: Any, cfg: ConnectorConfig, can_load: bool) -> str:
    """vLLM's ``kv_load_failure_policy`` as the connector leaves it (returned): ``recompute``, set here
    unless ``load_failure_policy`` is ``fail`` (vLLM's scheduler reads it right after making the
    connector: vllm/v1/core/sched/scheduler.py); a warning where a failed load would fail its request."""
    if (can_load and cfg.load_failure_policy == "recompute" and ktc is not None
            and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute"):
        ktc.kv_load_failure_policy = "recompute"
        logger.info("MemCacheConnector: kv_load_failure_policy set to 'recompute': a block that left the pool "
                    "between lookup and load is a miss to recompute, never an error "
                    "(kv_connector_extra_config.load_failure_policy='fail' keeps vLLM's policy)")
    effective = str(getattr(ktc, "kv_load_failure_policy", "fail"))
    if can_load and effective != "recompute":
        logger.warning("MemCacheConnector: kv_load_failure_policy is %r: a block evicted from the pool between "
                       "lookup and load ends its request with an error; set kv_load_failure_policy='recompute' "
                       "in kv_transfer_config to recompute it instead", effective)
    return effective
