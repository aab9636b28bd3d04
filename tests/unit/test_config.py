from __future__ import annotations

import dataclasses
import json
import logging
import logging.handlers
from typing import Any

import pytest

from memcache_core.config import (
    LocalConfig,
    MetaConfig,
    ReplicateConfig,
    apply_dict,
    load_file,
    parse_bool,
    parse_size,
)
from memcache_core.errors import ConfigError, InvalidParameter, check_key
from memcache_core.logs import configure_logging


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
                                       ("ha_enable", "yes"), ("drain_timeout_ms", 0), ("drain_timeout_ms", "1s"),
                                       ("poll_spin_us", -1), ("poll_spin_us", 200_000)])
def test_invalid_meta_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        apply_dict(MetaConfig(), {key: value})


@pytest.mark.parametrize("key,value", [("protocol", "udp"), ("world_size", 0), ("hbm_size", "1GB"),
                                       ("client_timeout_seconds", -1), ("hcom_url", "7000"),
                                       ("drain_timeout_ms", -1), ("drain_timeout_ms", 1.5),
                                       ("rpc_spin_us", -1), ("rpc_spin_us", 0.5)])
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


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (1, True), (0, False), ("TRUE", True),
                                            (" yes ", True), ("on", True), ("y", True), ("0", False),
                                            ("False", False), ("off", False), ("n", False)])
def test_one_boolean_reading(value, expected):
    assert parse_bool("k", value) is expected


@pytest.mark.parametrize("bad", ["maybe", "", 2, 1.0, None, [], "tru"])
def test_a_boolean_that_is_neither_names_the_key(bad):
    with pytest.raises(ConfigError, match="^my_key: expected true or false"):
        parse_bool("my_key", bad)


def test_a_failed_apply_dict_leaves_the_config_as_it_was():
    cfg = MetaConfig()
    before = dataclasses.asdict(cfg)
    with pytest.raises(ConfigError, match="lease_ttl_ms"):
        apply_dict(cfg, {"log_level": "debug", "lease_ttl_ms": -1})
    assert dataclasses.asdict(cfg) == before
    apply_dict(cfg, {"log_level": "debug", "lease_ttl_ms": 500})
    assert (cfg.log_level, cfg.lease_ttl_ms) == ("debug", 500)


def test_log_rotation_keys_are_honoured(tmp_path):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", str(tmp_path), "meta_service", rotate_mb=3, keep=7)
        handler = root.handlers[0]
        assert isinstance(handler, logging.handlers.RotatingFileHandler)
        assert (handler.maxBytes, handler.backupCount) == (3 << 20, 7)
        handler.close()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    with pytest.raises(ConfigError, match="log_rotation_file_count"):
        MetaConfig(log_rotation_file_count=0)


def test_open_store_names_the_failing_step(tmp_path, caplog):
    """Each failing step is named with its code. The pool secret is this test's own file: with the
    user's default one the outcome depended on whether an earlier test (or run) had made it (a fresh
    machine's first run got -3000 where -3017 was meant)."""
    import secrets

    from memcache_core import open_store
    from memcache_core.errors import InvalidParameter, MemCacheError, MetaServiceUnavailable
    from memcache_core.testing import free_port

    with pytest.raises(MemCacheError, match="setup failed with code -3000"):
        open_store(LocalConfig())   # host_rdma needs Ascend hardware: setup refuses it
    secret = tmp_path / "pool.secret"
    down = LocalConfig(protocol="host_shm", meta_service_url=f"tcp://127.0.0.1:{free_port()}",
                       client_timeout_seconds=1, dram_size="0", auth_secret_path=str(secret))
    with pytest.raises(InvalidParameter, match="init failed with code -3000"):
        open_store(down, init_bm=False)   # a client never creates the secret: a missing one is a config error
    assert f"cannot read the pool secret {secret}" in caplog.text
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    with pytest.raises(MetaServiceUnavailable, match="init failed with code -3017"):
        open_store(down, init_bm=False)


@pytest.mark.parametrize("key,value", [("ha_etcd_endpoints", ""), ("ha_etcd_endpoints", "tcp://h:1"),
                                       ("ha_etcd_endpoints", "h"), ("ha_cluster_id", "a/b"),
                                       ("ha_cluster_id", ""), ("ha_lease_ttl_ms", 1000),
                                       ("ha_lease_ttl_ms", 2500)])
def test_invalid_ha_values_name_the_key(key, value):
    good = {"ha_enable": True, "ha_etcd_endpoints": "http://127.0.0.1:2379", "ha_cluster_id": "c1"}
    apply_dict(MetaConfig(), good)
    with pytest.raises(ConfigError, match=key):
        apply_dict(MetaConfig(), {**good, key: value})


def test_meta_service_url_forms():
    from memcache_core.config import parse_meta_target
    assert parse_meta_target("tcp://a:1").urls == ("tcp://a:1",)
    assert parse_meta_target("tcp://a:1, tcp://b:2").urls == ("tcp://a:1", "tcp://b:2")
    t = parse_meta_target("etcd://h1:2379,http://h2:2380/pool-1")
    assert (t.etcd, t.cluster_id, t.urls) == ((("h1", 2379), ("h2", 2380)), "pool-1", ())
    for bad in ("etcd://h1:2379", "etcd://h1:2379/a b", "tcp://a:1,", "http://a:1"):
        with pytest.raises(ConfigError, match="meta_service_url"):
            apply_dict(LocalConfig(protocol="host_shm"), {"meta_service_url": bad})


def test_transfer_engine_is_checked_by_name():
    assert LocalConfig().transfer_engine == "builtin"
    with pytest.raises(ConfigError, match="transfer_engine: expected 'builtin' or 'nixl'"):
        LocalConfig(transfer_engine="ucx")   # type: ignore[arg-type]   # not one of the choices, on purpose
    cfg = LocalConfig()
    cfg.tls_enable, cfg.transfer_engine = True, "nixl"
    with pytest.raises(ConfigError, match="transfer_engine: 'nixl' moves payload outside TLS"):
        cfg.validate()


def test_transfer_engine_nixl_without_the_package_is_a_config_error(monkeypatch):
    """Asking for NIXL where it is not installed fails at setup, naming the key and the install command
    (no silent fallback: a pool that should run on RDMA would quietly run on the TCP data server)."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    with pytest.raises(ConfigError, match=r"transfer_engine: 'nixl' needs the nixl package \(pip install --no-deps"):
        LocalConfig(transfer_engine="nixl")


@pytest.mark.parametrize(("cls", "key", "value"), [
    (MetaConfig, "lru_type", "lfu"), (MetaConfig, "evict_yield_enable", True), (MetaConfig, "evict_yield_interval_ms", 5),
    (MetaConfig, "tag_op_info", True), (LocalConfig, "hcom_tls_enable", True), (LocalConfig, "kv_events_topic_prefix", "m1"),
    (MetaConfig, "kv_events_topic_prefix", "m1"), (LocalConfig, "evict_yield_enable", True),
    (MetaConfig, "config_store_tls_enable", True), (MetaConfig, "config_store_tls_ca_path", "/x/ca.pem"),
    (MetaConfig, "config_store_tls_bogus", 1),
])
def test_memcache_hybrid_keys_without_a_setting_here_are_refused_with_why(cls, key, value):
    """Scenario: a 1.3.0 key asking for a behaviour this pool lacks fails at start-up, naming the key
    and why; the configuration is left as it was."""
    cfg: Any = cls() if cls is MetaConfig else LocalConfig(protocol="host_shm")
    before = dataclasses.asdict(cfg)
    with pytest.raises(ConfigError, match=f"^{key}: .*(here|differs|TLS setting)"):
        apply_dict(cfg, {key: value})
    assert dataclasses.asdict(cfg) == before


def test_memcache_hybrid_keys_asking_for_what_is_done_here_are_accepted(caplog):
    with caplog.at_level(logging.WARNING):
        apply_dict(MetaConfig(), {"lru_type": "LRU", "evict_yield_enable": False, "tag_op_info": 0,
                                  "config_store_tls_enable": False, "log_output_target": "stdout"})
        apply_dict(LocalConfig(protocol="host_shm"), {"hcom_tls_enable": "false", "log_output_target": "file"})
    assert caplog.text == ""   # neither refused nor warned about as unknown
    assert apply_dict(MetaConfig(), {"log_output_target": "stderr"}).log_output_target == "stderr"
    with pytest.raises(ConfigError, match="log_output_target: 'file' needs log_path"):
        apply_dict(MetaConfig(), {"log_output_target": "file"})
    with pytest.raises(ConfigError, match="log_output_target: expected"):
        apply_dict(MetaConfig(), {"log_output_target": "syslog"})


def test_log_output_target_stdout_logs_to_stdout():
    import sys
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "", "meta_service", stdout=True)
        assert isinstance(root.handlers[0], logging.StreamHandler) and root.handlers[0].stream is sys.stdout
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
