"""memcache_hybrid 1.3.0 configuration keys that have no setting of their own here.

A value that asks for what this pool does anyway is accepted (logged at info); any other value is
refused at start-up with a ``ConfigError`` that names the key and says why, so a configuration written
for Ascend's MetaService never silently loses a behaviour it asked for. (Keys this pool implements are
``MetaConfig`` / ``LocalConfig`` fields; ``zmq_*`` keys are not handled here.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .errors import ConfigError
from .values import FALSE_WORDS

logger = logging.getLogger(__name__)

TLS_FIELDS = {"enable": "tls_enable", "ca_path": "tls_ca_path", "cert_path": "tls_cert_path",
              "key_path": "tls_key_path"}


def _off(v: Any) -> bool:
    """False, 0, "", None, or a false word ("false", "off", ...)."""
    return v is None or v is False or v == 0 or (isinstance(v, str) and (not v or v.strip().lower() in FALSE_WORDS))


# (key, or a prefix ending in "*"; the values accepted; why any other value is refused)
RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("lru_type", lambda v: str(v).strip().lower() in ("", "lru"),
     "eviction here is LRU over the pool's committed, unleased objects (docs/design.md 'Eviction'); "
     "no other policy exists"),
    ("evict_yield_*", _off,
     "an eviction pass here runs inside the MetaService's housekeeping, between control-plane requests; "
     "it has no yield points to tune (evict_check_interval_seconds sets how often it runs)"),
    ("tag_op_info", _off,
     "per-tag operation statistics are not kept; /metrics counts operations per request type"),
    ("hcom_*", _off,
     "hcom is Ascend's transport layer; the data plane here is host_shm / host_tcp (hcom_url, "
     "hcom_advertise_url) or NIXL (transfer_engine), with TLS from tls_*"),
    ("kv_events_*", _off,
     "not a setting of the KV events here (the MetaService's kv_events_enable, kv_events_endpoint, "
     "kv_events_model_name, kv_events_block_size, kv_events_queue_size, kv_events_replay_endpoint, "
     "kv_events_buffer_steps and the kv_events_replay_* bounds are)"),
    ("log_output_target", lambda v: str(v).strip().lower() in ("", "stdout", "stderr", "file"),
     "a LocalService inside an engine logs through the engine's logging; expected stdout, stderr or file"),
)


def _rule(key: str) -> tuple[Callable[[Any], bool], str] | None:
    for name, ok, why in RULES:
        if key == name or (name.endswith("*") and key.startswith(name[:-1])):
            return ok, why
    return None


def check(key: str, value: Any, setting: Callable[[str], Any]) -> bool:
    """Whether ``key`` is one of these keys (then its value was accepted: else ConfigError). ``setting``
    gives the value a field of the configuration being built will have (``config_store_tls_*`` must
    equal the control plane's TLS settings)."""
    if key.startswith("config_store_tls_"):
        field = TLS_FIELDS.get(key.removeprefix("config_store_tls_"))
        if field is None:
            raise ConfigError(f"{key}: not a TLS setting (config_store_tls_enable, _ca_path, _cert_path, _key_path)")
        mine = setting(field)
        same = (_off(value) == _off(mine)) if field == "tls_enable" else (value or "") == (mine or "")
        if not same:
            raise ConfigError(f"{key}: {value!r} differs from {field} ({mine!r}): the config store is served by "
                              f"the control plane's server with its TLS settings; set {field} instead")
        return True
    rule = _rule(key)
    if rule is None:
        return False
    ok, why = rule
    if not ok(value):
        raise ConfigError(f"{key}: {value!r} is not supported here: {why}")
    logger.info("%s: %r accepted (memcache_hybrid key; this is what the pool does anyway)", key, value)
    return True
