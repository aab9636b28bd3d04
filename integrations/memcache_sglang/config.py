"""Configuration of the ``npu_memcache`` backend, merged the way SGLang's built-in backend does.

Precedence (later wins): the ``LocalConfig`` keys of the pool file named by ``config_path`` (the
one ``memcache meta-service`` and ``memcache local-service`` read, over the ``MEMCACHE_<KEY>``
environment overrides), then the JSON file named by ``SGLANG_HICACHE_MEMCACHE_CONFIG_PATH``, then
SGLang's ``--hicache-storage-backend-extra-config``. Keys split into:

* control keys read by the backend itself (:data:`CONTROL_KEYS`);
* everything else, applied to :class:`memcache_core.LocalConfig` when it has such a field
  (``meta_service_url``, ``config_store_url``, ``protocol``, ``dram_size``, ``world_size``, ...);
  other keys (``file_storage_path`` injected by SGLang, typos) are warned about, never fatal.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from memcache_core.config import parse_bool
from memcache_core.errors import ConfigError
from memcache_sglang.pool_join import MAX_BACKOFF_S

logger = logging.getLogger(__name__)

CONFIG_PATH_ENV = "SGLANG_HICACHE_MEMCACHE_CONFIG_PATH"
WARMUP_ENV = "SGLANG_NPU_MEMCACHE_ENABLE_WARMUP"

#: Keys the backend reads; never applied to LocalConfig. The first seven are the built-in
#: backend's; ``clear_scope``, ``disk_prefetch``, ``weights_full_hash`` and ``join_retry_max_seconds``
#: are ours (see docs/sglang.md).
CONTROL_KEYS = frozenset(
    {
        "device_id",
        "init_bm",
        "conf_file_path",
        "check_server",
        "metrics_url",
        "memcache_metrics_url",
        "extra_backend_tag",
        "clear_scope",
        "disk_prefetch",
        "weights_full_hash",
        "join_retry_max_seconds",
    }
)

#: Keys SGLang consumes on its normal path; on the PD-decode offload path they reach us. They
#: are dropped silently rather than reported as unknown LocalConfig keys.
SGLANG_KEYS = frozenset(
    {
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        "interface_v1",
        "backend_name",
        "module_path",
        "class_name",
    }
)

CLEAR_SCOPES = ("namespace", "all")


def env_flag(name: str) -> bool:
    """An environment switch: unset or empty is false; otherwise ``parse_bool`` decides (a typo is an error)."""
    value = os.environ.get(name, "").strip()
    return parse_bool(name, value) if value else False


def positive_seconds(name: str, raw: Any) -> float:
    """A duration setting: a finite number of seconds above zero (a number or its text), else an
    error that names the key."""
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {raw!r}; give e.g. "
                          f"{MAX_BACKOFF_S:g} (the default) or leave it out")
    return value


def pool_file(path: Any) -> dict[str, Any]:
    """The ``LocalConfig`` keys of the pool file ``config_path`` (none without one); a file that
    cannot be read, or holds an unknown key in strict mode, fails naming ``config_path``."""
    from memcache_core.config import LocalConfig, file_values

    if path in (None, ""):
        return {}
    if not isinstance(path, str):
        raise ConfigError(f"config_path: expected the path of the pool's JSON file, got {path!r}")
    try:
        values = file_values(LocalConfig, path)
    except ConfigError as exc:
        raise ConfigError(str(exc) if str(exc).startswith("config_path") else f"config_path: {exc}") from None
    logger.info("MemCache store keys read from the pool file %s (config_path)", path)
    return values


@dataclass
class BackendConfig:
    """The merged configuration: LocalConfig fields and control fields."""

    local_fields: dict[str, Any] = field(default_factory=dict)
    ctrl: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_sources(cls, extra_config: dict[str, Any] | None) -> BackendConfig:
        merged: dict[str, Any] = {}
        path = os.environ.get(CONFIG_PATH_ENV)
        if path:
            # A file named but unusable stops the backend: starting on the defaults instead (protocol
            # host_rdma, which then fails far from the cause) would hide the operator's settings.
            fix = (f"fix the file, or unset {CONFIG_PATH_ENV} and give the settings in "
                   f"--hicache-storage-backend-extra-config")
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as exc:
                raise ConfigError(f"{CONFIG_PATH_ENV}: cannot read {path}: {exc.strerror}; {fix}") from exc
            except ValueError as exc:
                raise ConfigError(f"{CONFIG_PATH_ENV}: {path} is not valid JSON ({exc}); {fix}") from exc
            if not isinstance(data, dict):
                raise ConfigError(f"{CONFIG_PATH_ENV}: {path} holds a JSON {type(data).__name__}, not an object "
                                  f"of settings; {fix}")
            merged.update(data)
            logger.info("MemCache backend config loaded from %s", path)
        merged.update(extra_config or {})
        pool = pool_file(merged.pop("config_path", None))
        ctrl = {k: v for k, v in merged.items() if k in CONTROL_KEYS}
        local = {**pool, **{k: v for k, v in merged.items() if k not in CONTROL_KEYS and k not in SGLANG_KEYS}}
        scope = ctrl.get("clear_scope", "namespace")
        if scope not in CLEAR_SCOPES:
            raise ValueError(f"clear_scope must be one of {CLEAR_SCOPES}, got {scope!r}")
        parse_bool("disk_prefetch", ctrl.get("disk_prefetch", True))  # a bad value fails now, naming the key
        parse_bool("weights_full_hash", ctrl.get("weights_full_hash", False))
        positive_seconds("join_retry_max_seconds", ctrl.get("join_retry_max_seconds", MAX_BACKOFF_S))
        return cls(local_fields=local, ctrl=ctrl)

    def apply_to(self, local_cfg: Any) -> list[str]:
        """Set every known LocalConfig field; return the unknown keys."""
        unknown = []
        for key, value in self.local_fields.items():
            if hasattr(local_cfg, key):
                setattr(local_cfg, key, value)
            else:
                unknown.append(key)
        return unknown

    @property
    def init_bm(self) -> bool:
        return parse_bool("init_bm", self.ctrl.get("init_bm", True))

    @property
    def check_server(self) -> bool:
        return parse_bool("check_server", self.ctrl.get("check_server", False))

    @property
    def metrics_url(self) -> str | None:
        return self.ctrl.get("metrics_url") or self.ctrl.get("memcache_metrics_url")

    @property
    def extra_backend_tag(self) -> str | None:
        tag = self.ctrl.get("extra_backend_tag")
        return str(tag) if tag not in (None, "") else None

    @property
    def disk_prefetch(self) -> bool:
        return parse_bool("disk_prefetch", self.ctrl.get("disk_prefetch", True))

    @property
    def weights_full_hash(self) -> bool:
        """Identify weight files by the SHA-256 of their bytes (read once per load), not by size,
        modification time and safetensors header."""
        return parse_bool("weights_full_hash", self.ctrl.get("weights_full_hash", False))

    @property
    def join_retry_max_seconds(self) -> float:
        """The longest wait between two background attempts to join the pool (``pool_join``)."""
        return positive_seconds("join_retry_max_seconds", self.ctrl.get("join_retry_max_seconds", MAX_BACKOFF_S))

    @property
    def clear_scope(self) -> str:
        return self.ctrl.get("clear_scope", "namespace")

    def device_id(self, tp_rank: int, tp_size: int) -> int:
        """``device_id`` as the built-in backend resolves it: absent -> tp_rank, map -> by rank."""
        if "device_id" not in self.ctrl:
            return tp_rank
        raw = self.ctrl["device_id"]
        mapping = raw if isinstance(raw, dict) else None
        if mapping is None and isinstance(raw, str) and raw.strip().startswith("{"):
            try:
                mapping = json.loads(raw)
            except ValueError:
                logger.warning("cannot parse device_id %r as JSON; using tp_rank", raw)
                return tp_rank
        if isinstance(mapping, dict):
            for key in (tp_rank, str(tp_rank)):
                if key in mapping:
                    return int(mapping[key])
            logger.warning("device_id map has no entry for tp_rank=%s; using tp_rank", tp_rank)
            return tp_rank
        if tp_size > 1:
            logger.warning("device_id=%s is shared by all %d TP ranks", raw, tp_size)
        return int(raw)


def rank_index(sc: Any) -> int:
    """This rank's place in the server's TP x PP x attention-CP grid, 0..size-1: with ``metrics_port``
    set, each rank serves its metrics on ``metrics_port + rank_index`` (one port for all would leave
    every rank but the first without metrics)."""
    return int(sc.tp_rank + sc.tp_size * (sc.pp_rank + sc.pp_size * getattr(sc, "attn_cp_rank", 0)))


def place_disk_tier(local_cfg: Any, init_bm: bool, rank_dir: str) -> None:
    """Give this rank its own directory under ``disk_path`` (a disk tier serves one LocalService,
    and every rank of a server gets the same extra config). A disk tier lies under this process's
    DRAM segment, so it needs one: refused, naming the key, for a pure client."""
    if not local_cfg.disk_path:
        return
    if not init_bm or local_cfg.dram_bytes <= 0:
        raise ValueError("disk_path: a disk tier lies under this process's own DRAM segment, and this one has none "
                         "(init_bm false or dram_size 0); give disk_path to the provider (memcache local-service) "
                         "that holds the pool instead")
    local_cfg.disk_path = os.path.join(local_cfg.disk_path, rank_dir)
