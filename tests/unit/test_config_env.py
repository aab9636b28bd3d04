"""Unknown keys name the nearest known key (a warning, or an error in strict mode); MEMCACHE_<KEY>
environment overrides sit between the defaults and the config file (docs/configuration.md)."""

from __future__ import annotations

import json
import logging

import pytest

from memcache_core.config import LocalConfig, MetaConfig, apply_dict, load_file, local_config_from_env
from memcache_core.errors import ConfigError


def test_unknown_key_suggests_the_nearest_known_key(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = apply_dict(LocalConfig(protocol="host_shm"), {"dram_szie": "2GB", "zzz_qqq": 1}, source="p.json")
    assert cfg.dram_bytes == 1 << 30      # a typo changes nothing
    assert "'dram_szie' (did you mean 'dram_size'?)" in caplog.text
    assert "'zzz_qqq' (no such key; docs/configuration.md lists them)" in caplog.text


def test_strict_mode_refuses_unknown_keys(tmp_path, monkeypatch):
    p = tmp_path / "meta.json"
    p.write_text(json.dumps({"evict_threshold_hgih": 95}))
    with pytest.raises(ConfigError, match=r"'evict_threshold_hgih' \(did you mean 'evict_threshold_high'\?\)"):
        load_file(MetaConfig, str(p), strict=True)
    monkeypatch.setenv("MEMCACHE_CONFIG_STRICT", "1")
    with pytest.raises(ConfigError, match="strict mode: MEMCACHE_CONFIG_STRICT is set; fix or remove them"):
        load_file(MetaConfig, str(p))
    monkeypatch.setenv("MEMCACHE_CONFIG_STRICT", "maybe")
    with pytest.raises(ConfigError, match="MEMCACHE_CONFIG_STRICT: expected true or false"):
        load_file(MetaConfig, str(p))


def test_environment_overrides_fill_what_the_file_leaves_unset(tmp_path, monkeypatch):
    """Scenario: a Kubernetes pod's IP reaches hcom_advertise_url through the environment, while the
    file's own keys win over the environment (explicit > file > environment > default)."""
    p = tmp_path / "provider.json"
    p.write_text(json.dumps({"protocol": "host_tcp", "hcom_url": "tcp://0.0.0.0:7000", "dram_size": "64MB"}))
    monkeypatch.setenv("MEMCACHE_HCOM_ADVERTISE_URL", "tcp://10.1.2.3:7000")
    monkeypatch.setenv("MEMCACHE_DRAM_SIZE", "2GB")                    # the file's value wins
    monkeypatch.setenv("MEMCACHE_CHECKSUM", "off")
    monkeypatch.setenv("MEMCACHE_HEARTBEAT_INTERVAL_MS", "250")
    monkeypatch.setenv("MEMCACHE_CHECKSUM_VERIFY_RATIO", "0.5")
    cfg = load_file(LocalConfig, str(p))
    assert cfg.hcom_advertise_url == "tcp://10.1.2.3:7000" and cfg.dram_bytes == 64 << 20
    assert cfg.checksum is False and cfg.heartbeat_interval_ms == 250 and cfg.checksum_verify_ratio == 0.5
    monkeypatch.setenv("MMC_LOCAL_CONFIG_PATH", str(p))
    assert local_config_from_env().hcom_advertise_url == "tcp://10.1.2.3:7000"
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH")
    assert local_config_from_env().dram_bytes == 2 << 30                # no file: the environment's
    assert LocalConfig().dram_bytes == 1 << 30                          # explicit objects: untouched


@pytest.mark.parametrize(("var", "value", "message"), [
    ("MEMCACHE_HEARTBEAT_INTERVAL_MS", "fast", "MEMCACHE_HEARTBEAT_INTERVAL_MS: expected an integer for heartbeat_interval_ms"),
    ("MEMCACHE_CHECKSUM", "sometimes", "MEMCACHE_CHECKSUM: expected true or false"),
    ("MEMCACHE_DRAM_SIZE", "lots", "dram_size: expected a size such as '4GB'"),
])
def test_a_bad_environment_override_names_the_variable(tmp_path, monkeypatch, var, value, message):
    p = tmp_path / "c.json"
    p.write_text("{}")
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=message):
        load_file(LocalConfig, str(p))


def test_a_pair_of_keys_may_come_half_from_the_environment(tmp_path, monkeypatch):
    """Scenario: hcom_url binds every interface (in the file), hcom_advertise_url comes from the
    environment: they are validated together, not the file's half alone."""
    p = tmp_path / "provider.json"
    p.write_text(json.dumps({"protocol": "host_tcp", "hcom_url": "tcp://0.0.0.0:7000"}))
    with pytest.raises(ConfigError, match="hcom_url: tcp://0.0.0.0:7000 binds every interface"):
        load_file(LocalConfig, str(p))
    monkeypatch.setenv("MEMCACHE_HCOM_ADVERTISE_URL", "tcp://10.1.2.3:7000")
    assert load_file(LocalConfig, str(p)).hcom_advertise_url == "tcp://10.1.2.3:7000"
    p.write_text(json.dumps({"hcom_advertise_url": "tcp://10.9.9.9:7000"}))
    monkeypatch.setenv("MEMCACHE_HCOM_URL", "tcp://0.0.0.0:7000")
    assert load_file(LocalConfig, str(p)).hcom_advertise_url == "tcp://10.9.9.9:7000"
    p.write_text("[1]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        load_file(LocalConfig, str(p))
