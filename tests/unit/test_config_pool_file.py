"""One pool file for every role (docs/configuration.md, "Where configuration comes from"): a key of the
other role's config is that role's, neither warned about nor refused; a key neither role knows is
warned about as before, and refused in strict mode, with the nearest key of either role."""

from __future__ import annotations

import json
import logging

import pytest

from memcache_core.config import (
    LocalConfig,
    MetaConfig,
    file_values,
    load_file,
    local_config_from_env,
    meta_config_from_env,
)
from memcache_core.errors import ConfigError

POOL = {"meta_service_url": "tcp://127.0.0.1:5123", "config_store_url": "tcp://127.0.0.1:6123",
        "metrics_url": "http://127.0.0.1:8123", "pool_name": "blue", "auth_enable": True, "log_level": "info",
        "evict_threshold_high": 85, "lease_ttl_ms": 20000, "placement_policy": "spread",
        "protocol": "host_tcp", "dram_size": "64MB", "hcom_url": "tcp://127.0.0.1:0", "heartbeat_interval_ms": 200,
        "log_output_target": "stderr"}


@pytest.fixture
def pool_file(tmp_path):
    p = tmp_path / "pool.json"
    p.write_text(json.dumps(POOL))
    return p


def test_both_roles_read_one_file_in_strict_mode_without_a_warning(pool_file, monkeypatch, caplog):
    monkeypatch.setenv("MEMCACHE_CONFIG_STRICT", "true")
    with caplog.at_level(logging.WARNING):
        meta = load_file(MetaConfig, str(pool_file))
        local = load_file(LocalConfig, str(pool_file))
    assert caplog.text == ""
    assert (meta.meta_service_url, meta.metrics_url, meta.pool_name, meta.evict_threshold_high,
            meta.placement_policy) == ("tcp://127.0.0.1:5123", "http://127.0.0.1:8123", "blue", 85, "spread")
    assert (local.meta_service_url, local.config_store_url, local.pool_name, local.protocol, local.dram_bytes,
            local.heartbeat_interval_ms) == ("tcp://127.0.0.1:5123", "tcp://127.0.0.1:6123", "blue", "host_tcp",
                                             64 << 20, 200)
    # the environment's files are read the same way
    monkeypatch.setenv("MMC_LOCAL_CONFIG_PATH", str(pool_file))
    monkeypatch.setenv("MMC_META_CONFIG_PATH", str(pool_file))
    assert local_config_from_env().dram_bytes == 64 << 20 and meta_config_from_env().lease_ttl_ms == 20000


def test_a_key_neither_role_knows_is_still_named_warned_and_refused_in_strict_mode(pool_file, caplog):
    pool_file.write_text(json.dumps({**POOL, "evict_threshold_hgih": 95, "dram_szie": "1GB"}))
    with caplog.at_level(logging.WARNING):
        load_file(LocalConfig, str(pool_file), strict=False)
    # the nearest key of either role: a provider reading the pool file points at the MetaService's key too
    assert "'evict_threshold_hgih' (did you mean 'evict_threshold_high'?)" in caplog.text
    assert "'dram_szie' (did you mean 'dram_size'?)" in caplog.text
    assert "metrics_url" not in caplog.text and "lease_ttl_ms" not in caplog.text
    for load in (lambda: load_file(LocalConfig, str(pool_file), strict=True),
                 lambda: load_file(MetaConfig, str(pool_file), strict=True)):
        with pytest.raises(ConfigError, match=r"unknown \w+Config keys: 'dram_szie'.*'evict_threshold_hgih'.*strict"):
            load()


def test_the_other_roles_keys_are_checked_by_that_role(pool_file):
    """A bad value of a MetaService key is no reason for a provider to stop; the MetaService reading
    the same file refuses it, naming the key (and the other way round)."""
    pool_file.write_text(json.dumps({**POOL, "placement_policy": "nearest", "kv_events_enable": True}))
    assert load_file(LocalConfig, str(pool_file), strict=True).protocol == "host_tcp"
    with pytest.raises(ConfigError, match="placement_policy: expected"):
        load_file(MetaConfig, str(pool_file), strict=True)
    pool_file.write_text(json.dumps({**POOL, "dram_size": "lots"}))
    assert load_file(MetaConfig, str(pool_file), strict=True).pool_name == "blue"
    with pytest.raises(ConfigError, match="dram_size: expected a size"):
        load_file(LocalConfig, str(pool_file), strict=True)


def test_file_values_are_the_files_keys_of_one_role_over_the_environment(pool_file, tmp_path, monkeypatch):
    """What an engine lays its inline keys over: the file's keys of that role, and the environment's
    overrides of the keys the file leaves out; never the defaults."""
    monkeypatch.setenv("MEMCACHE_CLIENT_TIMEOUT_SECONDS", "7")
    monkeypatch.setenv("MEMCACHE_DRAM_SIZE", "2GB")            # the file's value wins
    values = file_values(LocalConfig, str(pool_file))
    assert values["dram_size"] == "64MB" and values["client_timeout_seconds"] == 7.0
    assert "metrics_url" not in values and "lease_ttl_ms" not in values and "checksum" not in values
    with pytest.raises(ConfigError, match="^config_path: cannot read .*missing.json"):
        file_values(LocalConfig, str(tmp_path / "missing.json"))
    pool_file.write_text("{")
    with pytest.raises(ConfigError, match="^config_path: .* is not valid JSON"):
        file_values(LocalConfig, str(pool_file))
    pool_file.write_text("[]")
    with pytest.raises(ConfigError, match="^config_path: .*expected a JSON object, got list"):
        file_values(MetaConfig, str(pool_file))
