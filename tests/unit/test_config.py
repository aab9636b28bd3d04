from __future__ import annotations

import json
import logging

import pytest

from memcache_core.config import LocalConfig, MetaConfig, ReplicateConfig, apply_dict, load_file, parse_size
from memcache_core.errors import ConfigError, InvalidParameter, check_key


@pytest.mark.parametrize("text,expected", [
    (134217728, 134217728), ("134217728", 134217728), ("2048KB", 2048 << 10), ("200mb", 200 << 20),
    ("2.5G", int(2.5 * (1 << 30))), ("1TB", 1 << 40), ("50GB", 50 << 30), ("4GiB", 4 << 30), ("0", 0)])
def test_size_strings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GB", "1PB", "", True, -5])
def test_bad_sizes_name_the_key(bad):
    with pytest.raises(ConfigError, match="dram_size"):
        parse_size(bad, "dram_size")


def test_defaults_match_memcache_hybrid():
    m = MetaConfig()
    assert (m.meta_service_url, m.config_store_url, m.metrics_url) == (
        "tcp://127.0.0.1:5000", "tcp://127.0.0.1:6000", "http://127.0.0.1:8000")
    assert (m.evict_threshold_high, m.evict_threshold_low, m.lease_ttl_ms) == (90, 80, 10000)
    c = LocalConfig()
    assert (c.world_size, c.protocol, c.dram_size, c.client_timeout_seconds) == (256, "host_rdma", "1GB", 60)
    for name in ("meta_service_url", "config_store_url", "log_level", "world_size", "protocol", "hcom_url",
                 "dram_size", "hbm_size", "max_dram_size", "max_hbm_size"):
        assert hasattr(c, name)   # SGLang's stock backend detects supported keys with hasattr


@pytest.mark.parametrize("key,value", [("evict_threshold_high", 150), ("evict_threshold_low", 95),
                                       ("metrics_url", "tcp://x:1"), ("lease_ttl_ms", 0), ("log_level", "loud"),
                                       ("ha_enable", True), ("drain_timeout_ms", 0), ("drain_timeout_ms", "1s")])
def test_invalid_meta_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        apply_dict(MetaConfig(), {key: value})


@pytest.mark.parametrize("key,value", [("protocol", "udp"), ("world_size", 0), ("hbm_size", "1GB"),
                                       ("client_timeout_seconds", -1), ("hcom_url", "7000"),
                                       ("drain_timeout_ms", -1), ("drain_timeout_ms", 1.5)])
def test_invalid_local_values_name_the_key(key, value):
    cfg = LocalConfig(protocol="host_shm")
    with pytest.raises(ConfigError, match=key):
        apply_dict(cfg, {key: value})


def test_unknown_keys_warn_and_file_loading(tmp_path, caplog):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"protocol": "host_tcp", "dram_size": "2GB", "prefetch_threshold": 1}))
    with caplog.at_level(logging.WARNING):
        cfg = load_file(LocalConfig, str(p))
    assert cfg.protocol == "host_tcp" and cfg.dram_bytes == 2 << 30
    assert "prefetch_threshold" in caplog.text
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_file(LocalConfig, str(p))
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(LocalConfig, str(tmp_path / "missing.json"))


def test_replicate_config():
    ReplicateConfig(2, [5]).validate()
    with pytest.raises(ConfigError, match="replicaNum"):
        ReplicateConfig(9).validate()
    with pytest.raises(ConfigError, match="preferredLocalServiceIDs"):
        ReplicateConfig(1, [1, 2]).validate()


def test_keys():
    assert check_key("a" * 255) == b"a" * 255
    for bad in ("", "a" * 256, "é" * 128):
        with pytest.raises(InvalidParameter):
            check_key(bad)
